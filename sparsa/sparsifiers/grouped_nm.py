"""GroupedNM: an n:m pattern shared by groups of ``g`` rows (the ``"grouped_nm"`` layout's structure)."""

from __future__ import annotations

from torch import Tensor

from .base import Sparsifier, check_nm, check_no_nan, check_positive_int


class GroupedNM(Sparsifier):
    """Grouped N:M sparsity: ``n`` of every ``m`` values along the last dim, with the pattern shared
    within each group of ``g`` rows (chosen from the group's combined magnitudes).

    The mask is computed by :func:`sparsa.layouts.grouped_nm.grouped_nm_mask`, so it always fits
    the ``"grouped_nm"`` layout. NaN weights raise ``ValueError``.

    >>> from sparsa.sparsifiers import GroupedNM
    >>> GroupedNM(2, 4, g=8).layout_params()
    {'n': 2, 'm': 4, 'g': 8}
    """

    name = "grouped_nm"

    def __init__(self, n: int, m: int, g: int = 4):
        self.n, self.m = check_nm(n, m)
        self.g = check_positive_int(g, "g")

    def _mask(self, dense: Tensor) -> Tensor:
        check_no_nan(dense, "GroupedNM")
        try:
            from ..layouts.grouped_nm import grouped_nm_mask
        except ImportError as e:  # pragma: no cover - depends on the layout being installed
            raise RuntimeError(
                f"GroupedNM needs the 'grouped_nm' layout (sparsa.layouts.grouped_nm), which could not be imported: {e}"
            ) from e
        return grouped_nm_mask(dense, self.n, self.m, self.g)

    def layout_params(self):
        return {"n": self.n, "m": self.m, "g": self.g}

    def _repr_args(self):
        return {"n": self.n, "m": self.m, "g": self.g}
