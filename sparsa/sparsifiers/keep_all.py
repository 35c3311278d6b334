"""KeepAll: the identity sparsifier (every position kept)."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Sparsifier


class KeepAll(Sparsifier):
    """Keep every value (useful to store a tensor in a layout without pruning it).

    >>> import torch
    >>> from sparsa.sparsifiers import KeepAll
    >>> KeepAll().mask(torch.zeros(2)).tolist()
    [True, True]
    """

    name = "keep_all"

    def _mask(self, dense: Tensor) -> Tensor:
        return torch.ones(dense.shape, dtype=torch.bool, device=dense.device)
