"""Threshold: keep values whose magnitude exceeds a fixed threshold."""

from __future__ import annotations

import math

from torch import Tensor

from .base import Sparsifier


class Threshold(Sparsifier):
    """Keep ``|w| > threshold``. NaN values are dropped (``NaN > t`` is false).

    >>> import torch
    >>> from sparsa.sparsifiers import Threshold
    >>> Threshold(0.5).mask(torch.tensor([0.4, -0.6, 0.5])).tolist()
    [False, True, False]
    """

    name = "threshold"

    def __init__(self, threshold: float):
        try:
            t = float(threshold)
        except (TypeError, ValueError):
            raise TypeError(f"threshold must be a number, got {threshold!r}") from None
        if math.isnan(t) or t < 0:
            raise ValueError(f"threshold must be a non-negative number (a magnitude), got {threshold!r}")
        self.threshold = t

    def _mask(self, dense: Tensor) -> Tensor:
        return dense.abs() > self.threshold

    def _repr_args(self):
        return {"threshold": self.threshold}
