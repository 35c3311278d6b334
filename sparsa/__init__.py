"""sparsa: composable, fast sparsity for PyTorch.

Layouts (storage formats), sparsifiers (which values survive) and operator implementations are
independent; a dispatcher picks an implementation for each op and falls back to dense.

The public API (``__all__``):

* subpackages: ``layouts`` (storage formats), ``sparsifiers`` (which values survive), ``ops``
  (registry and dispatcher), ``methods`` (pruning methods), ``adaptive`` (activation-sparse training);
* tensors: ``SparseTensor``, ``to_sparse``, ``to_dense``;
* models: ``sparsify`` (the one way to sparsify: a method config from ``methods`` such as
  ``methods.OneShot`` / ``methods.Wanda``, a ``Rule`` or list of them, or a sparsifier; returns the
  model), ``Rule``, ``densify``, ``sparsity_report`` (the reports), ``format_report``, ``fuse_gelu``,
  ``fuse_projections``, ``fuse_mlp``, ``fuse_for_inference`` (all three), ``recover``, ``sparsify_linears``
  (deprecated: ``sparsify(model, methods.OneShot(...))``);
  checkpoints: ``save``, ``load``;
* activation sparsity: ``sparsify(model, ActivationSparsity(...))`` (the one way to turn it on;
  ``adaptive.enable(model)`` is the lower-level call, ``adaptive.runtime_of(model)`` its runtime);
* dispatcher: ``implements``, ``fallback_counts``, ``reset_fallback_counts``,
  ``SparseFallbackWarning``, ``strict``, ``is_strict``, ``SparseFallbackError``.

Example::

    >>> import torch, sparsa
    >>> w = sparsa.to_sparse(torch.randn(4, 8), sparsa.layouts.NM, n=2, m=4)
    >>> with sparsa.strict():                      # any dense fallback raises in this block
    ...     y = torch.nn.functional.linear(torch.randn(3, 8), w)
    >>> y.shape
    torch.Size([3, 4])
"""

from . import layouts
from .tensor import SparseTensor, to_sparse, to_dense
from . import ops
from .ops import (
    fallback_counts,
    reset_fallback_counts,
    SparseFallbackWarning,
    implements,
    strict,
    is_strict,
    SparseFallbackError,
)
from . import sparsifiers
from .nn import Rule, sparsify, densify, sparsity_report, format_report, sparsify_linears
from .nn import fuse_gelu, fuse_projections, fuse_mlp, fuse_for_inference
from .io import save, load
from . import methods
from .methods.recover import recover  # noqa: F401
from .methods.activation import ActivationSparsity
from . import adaptive

__version__ = "0.1.0"

__all__ = [
    # subpackages
    "layouts",
    "sparsifiers",
    "ops",
    "methods",
    "adaptive",
    # tensors
    "SparseTensor",
    "to_sparse",
    "to_dense",
    # models and checkpoints
    "Rule",
    "sparsify",
    "densify",
    "sparsity_report",
    "format_report",
    "sparsify_linears",
    "fuse_gelu",
    "fuse_projections",
    "fuse_mlp",
    "fuse_for_inference",
    "recover",
    "save",
    "load",
    # activation sparsity
    "ActivationSparsity",
    # dispatcher
    "implements",
    "fallback_counts",
    "reset_fallback_counts",
    "SparseFallbackWarning",
    "strict",
    "is_strict",
    "SparseFallbackError",
]
