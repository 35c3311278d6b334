"""Compaction: a ReLU output (or pre-activation) turned into the operand the sparse GEMMs read.

The format is *sliced padded CSR* over pixels (see :mod:`sparsa.kernels.adaptive`): for every pixel
(one row of the implicit im2col matrix, or one row of a Linear input) and every slice of ``slice``
channels, the ascending channel indices and values of the nonzeros. The ReLU is fused into the
conversion (only positive values are kept), and the per-(pixel, slice) counts double as an exact,
free sparsity measurement for the monitor.

Example::

    >>> import torch
    >>> from sparsa.adaptive import compact
    >>> x = torch.tensor([[[[1.0]], [[-2.0]], [[0.0]], [[3.0]]]])  # [N=1, C=4, H=1, W=1]
    >>> a = compact(x)
    >>> a.nnz, a.density
    (2, 0.5)
    >>> torch.equal(a.to_dense(), x.relu())
    True
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch
from torch import Tensor

from ..kernels import adaptive as _k

__all__ = ["CompactActivation", "compact", "compact_matrix", "DEFAULT_SLICE"]

#: channels per slice (the K-slice of the sparse GEMMs)
DEFAULT_SLICE = 128


@dataclass
class CompactActivation:
    """A compacted activation: ``cnt``/``idx``/``val`` plus the logical ``[N, C, H, W]`` shape."""

    cnt: Tensor
    idx: Tensor
    val: Tensor
    shape: Tuple[int, int, int, int]
    slice: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nnz(self) -> int:
        return int(self.cnt.sum(dtype=torch.int64))

    @property
    def density(self) -> float:
        return self.nnz / max(1, self.numel)

    @property
    def sparsity(self) -> float:
        return 1.0 - self.density

    def to_dense(self) -> Tensor:
        """The dense ``[N, C, H, W]`` tensor (channels-last strided) this operand encodes."""
        N, C, H, W = self.shape
        geo = [N, C, H, W] + [0] * 11 + [self.slice]
        return _k.densify(self.cnt, self.idx, self.val, geo)


def compact(x: Tensor, slice: int = DEFAULT_SLICE) -> CompactActivation:
    """Fused ``relu(x)`` + compaction of an ``[N, C, H, W]`` tensor (any memory format)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"x must be 4-D [N, C, H, W], got shape {tuple(x.shape)}; use compact_matrix for [P, K]")
    if int(slice) < 1:
        raise ValueError(f"slice must be a positive number of channels, got {slice!r}; e.g. slice=64")
    cnt, idx, val = _k.compact(x.detach(), int(slice))
    return CompactActivation(cnt, idx, val, tuple(int(s) for s in x.shape), int(slice))


def compact_matrix(x: Tensor, slice: int = DEFAULT_SLICE) -> CompactActivation:
    """Compaction of a ``[P, K]`` matrix (a Linear input): rows are pixels, columns channels."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [P, K], got shape {tuple(x.shape)}; flatten leading dims first")
    return compact(x.t().unsqueeze(0).unsqueeze(-1), slice)
