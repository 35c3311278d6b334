"""Compaction: a ReLU output (or pre-activation) turned into the operand the sparse GEMMs read.

The operand is the :class:`~sparsa.layouts.ReluCompact` layout (*sliced padded CSR* over pixels, see
:mod:`sparsa.kernels.adaptive`): for every pixel (one row of the implicit im2col matrix, or one row of
a Linear input) and every slice of ``slice`` channels, the ascending channel indices and values of the
nonzeros. The ReLU is fused into the conversion (only positive values are kept), and the per-(pixel,
slice) counts double as an exact, free sparsity measurement for the monitor. :func:`compact` is
``ReluCompact.from_dense`` for ``[N, C, H, W]`` activations; ``CompactActivation`` is the layout's
former name.

Example::

    >>> import torch
    >>> from sparsa.adaptive import compact
    >>> x = torch.tensor([[[[1.0]], [[-2.0]], [[0.0]], [[3.0]]]])  # [N=1, C=4, H=1, W=1]
    >>> a = compact(x)
    >>> a.nnz, a.density, type(a).name
    (2, 0.5, 'relu_compact')
    >>> torch.equal(a.to_dense(), x.relu())
    True
"""

from __future__ import annotations

from torch import Tensor

from ..layouts.relu_compact import DEFAULT_SLICE, ReluCompact

__all__ = ["CompactActivation", "compact", "compact_matrix", "DEFAULT_SLICE"]

#: the compacted activation; an alias of the layout it became
CompactActivation = ReluCompact


def _slice(slice: int) -> int:
    if isinstance(slice, bool) or int(slice) != slice or int(slice) < 1:
        raise ValueError(f"slice must be a positive number of channels, got {slice!r}; e.g. slice=64")
    return int(slice)


def compact(x: Tensor, slice: int = DEFAULT_SLICE) -> ReluCompact:
    """Fused ``relu(x)`` + compaction of an ``[N, C, H, W]`` tensor (any memory format)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"x must be 4-D [N, C, H, W], got shape {tuple(x.shape)}; use compact_matrix for [P, K]")
    return ReluCompact.from_dense(x, slice=_slice(slice))


def compact_matrix(x: Tensor, slice: int = DEFAULT_SLICE) -> ReluCompact:
    """Compaction of a ``[P, K]`` matrix (a Linear input) as the ``[1, K, P, 1]`` image the kernels read;
    ``ReluCompact.from_dense(x)`` keeps the logical ``[P, K]`` shape (same components)."""
    if not isinstance(x, Tensor) or x.dim() != 2:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"x must be 2-D [P, K], got shape {got}; flatten leading dims first")
    return compact(x.t().unsqueeze(0).unsqueeze(-1), slice)
