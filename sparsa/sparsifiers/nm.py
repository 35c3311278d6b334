"""NM: keep the ``n`` largest magnitudes in every group of ``m`` consecutive values (last dim)."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Sparsifier, check_nm, check_no_nan, top_mask


class NM(Sparsifier):
    """N:M structured sparsity along the last dimension (e.g. 2:4).

    The mask comes from :func:`sparsa.layouts.nm.nm_mask` when that layout is installed, so the
    pattern always fits the ``"nm"`` layout; otherwise an equivalent local computation is used
    (a trailing partial group keeps ``min(n, len)`` values; ties keep the lower index).
    NaN weights raise ``ValueError``.

    >>> import torch
    >>> from sparsa.sparsifiers import NM
    >>> NM(2, 4).mask(torch.tensor([[1.0, -4.0, 3.0, 2.0]])).tolist()
    [[False, True, True, False]]
    >>> NM(2, 4).layout_params()
    {'n': 2, 'm': 4}
    """

    name = "nm"

    def __init__(self, n: int, m: int):
        self.n, self.m = check_nm(n, m)

    def _mask(self, dense: Tensor) -> Tensor:
        check_no_nan(dense, "NM")
        try:
            from ..layouts.nm import nm_mask
        except ImportError:
            return local_nm_mask(dense, self.n, self.m)
        return nm_mask(dense, self.n, self.m)

    def layout_params(self):
        return {"n": self.n, "m": self.m}

    def _repr_args(self):
        return {"n": self.n, "m": self.m}


def local_nm_mask(dense: Tensor, n: int, m: int) -> Tensor:
    """Reference n:m mask along the last dim (pads a partial tail group with never-kept slots)."""
    if dense.dim() == 0 or dense.numel() == 0:
        return torch.ones(dense.shape, dtype=torch.bool, device=dense.device)
    cols = dense.shape[-1]
    pad = (-cols) % m
    mag = dense.abs().reshape(-1, cols)
    if pad:
        mag = torch.cat([mag, mag.new_full((mag.shape[0], pad), -1.0)], dim=1)
    groups = mag.reshape(mag.shape[0], -1, m)
    keep = top_mask(groups, n).reshape(mag.shape[0], -1)[:, :cols]
    return keep.reshape(dense.shape)
