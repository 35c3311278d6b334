"""sparsa: composable, fast sparsity for PyTorch.

Layouts (storage formats), sparsifiers (which values survive) and operator implementations are
independent; a dispatcher picks an implementation for each op and falls back to dense.
"""
from . import layouts  # noqa: F401
from .tensor import SparseTensor, to_sparse, to_dense  # noqa: F401
from . import ops  # noqa: F401
from .ops import fallback_counts, reset_fallback_counts, SparseFallbackWarning, implements  # noqa: F401
from . import sparsifiers  # noqa: F401
from .nn import Rule, sparsify, densify, sparsity_report, format_report, sparsify_linears, fuse_gelu  # noqa: F401
from .io import save, load  # noqa: F401
from . import methods  # noqa: F401
from .methods.recover import recover  # noqa: F401

__version__ = "0.1.0"
