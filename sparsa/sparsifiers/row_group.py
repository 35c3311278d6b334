"""RowGroupSparsifier: every ``group`` rows keep the same input columns (the ``"row_group"`` layout's
structure, the fast CPU pattern)."""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from ..layouts.base import check_fraction
from .base import Sparsifier

__all__ = ["RowGroupSparsifier"]


class RowGroupSparsifier(Sparsifier):
    """The fast CPU pattern: every ``group`` rows keep the same input columns (those with the
    largest L2 norm over the group); stored by the ``"row_group"`` layout.

    ``permute=True`` lets rows of similar column importance form the groups instead of consecutive
    rows (more of the weight kept at the same kernel speed). ``scores``: importance used instead of
    ``|W|``, shape ``(K,)`` per input feature (multiplies ``|W|``, e.g. Wanda's input norms) or the
    weight's shape.

    >>> import torch
    >>> from sparsa.sparsifiers import RowGroupSparsifier
    >>> RowGroupSparsifier(0.5, group=4).mask(torch.randn(8, 10)).sum(1).tolist()
    [5, 5, 5, 5, 5, 5, 5, 5]
    >>> RowGroupSparsifier(0.5, group=4, permute=True).mask(torch.randn(8, 10)).sum(1).tolist()
    [5, 5, 5, 5, 5, 5, 5, 5]
    """

    name = "row_group"

    def __init__(self, sparsity: float, group: int = 16, permute: bool = False, scores: Optional[Tensor] = None):
        if not isinstance(permute, bool):
            raise TypeError(f"permute must be True or False, got {permute!r}")
        if scores is not None and not isinstance(scores, Tensor):
            raise TypeError(
                f"scores must be a tensor (per input feature or per weight) or None, got {type(scores).__name__}"
            )
        self.sparsity = check_fraction(sparsity, "sparsity")
        self.group = group
        self.permute = permute
        self.scores = scores

    def _mask(self, dense: Tensor) -> Tensor:
        from ..layouts.row_group import row_group_mask

        return row_group_mask(dense, self.sparsity, self.group, permute=self.permute, scores=self.scores)

    def layout_params(self):
        return {"group": self.group}

    def _repr_args(self):
        out = {"sparsity": self.sparsity, "group": self.group}
        if self.permute:
            out["permute"] = True
        if self.scores is not None:
            out["scores"] = f"<tensor {tuple(self.scores.shape)}>"
        return out
