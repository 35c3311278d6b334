"""Magnitude: keep the largest ``|w|`` (per tensor or per row), an exact count."""

from __future__ import annotations

from torch import Tensor

from ..layouts.base import check_fraction
from .base import Sparsifier, check_no_nan, n_removed, top_mask


class Magnitude(Sparsifier):
    """Remove exactly ``round(sparsity * numel)`` smallest-magnitude values.

    Args:
        sparsity: fraction of values removed, in ``[0, 1)``.
        per: ``"tensor"`` ranks all values together; ``"row"`` removes ``round(sparsity * row_len)``
            values from every row (rows are along the last dim).

    Ties are broken deterministically (the lower flat index is kept). NaN weights raise a
    ``ValueError``: a NaN has no magnitude, and keeping or dropping it silently hides a bug.

    >>> import torch
    >>> from sparsa.sparsifiers import Magnitude
    >>> Magnitude(0.5, per="row").mask(torch.tensor([[1.0, 2.0], [4.0, 3.0]])).tolist()
    [[False, True], [True, False]]
    """

    name = "magnitude"

    def __init__(self, sparsity: float, per: str = "tensor"):
        self.sparsity = check_fraction(sparsity, "sparsity")
        if per not in ("tensor", "row"):
            raise ValueError(f"per must be 'tensor' or 'row', got {per!r}")
        self.per = per

    def _mask(self, dense: Tensor) -> Tensor:
        check_no_nan(dense, "Magnitude")
        mag = dense.abs()
        if dense.numel() == 0:
            return mag != mag
        if self.per == "row" and dense.dim() >= 1:
            cols = dense.shape[-1]
            rows = mag.reshape(-1, cols)
            return top_mask(rows, cols - n_removed(self.sparsity, cols)).reshape(dense.shape)
        flat = mag.reshape(1, -1)
        n = flat.shape[-1]
        return top_mask(flat, n - n_removed(self.sparsity, n)).reshape(dense.shape)

    def _repr_args(self):
        return {"sparsity": self.sparsity, "per": self.per}
