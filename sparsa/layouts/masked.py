"""The Masked layout: a dense values tensor plus a boolean mask of kept positions.

The simplest sparse layout; it saves no compute by itself but keeps a pattern exactly (explicit
zeros included) and every op can run on it through the dense path.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional

import torch
from torch import Tensor

from .base import Layout, register_layout


@register_layout
class Masked(Layout):
    """``values`` (zero outside the mask) and ``mask`` (bool), both of the logical shape.

    >>> import torch
    >>> from sparsa.layouts import Masked
    >>> m = Masked.from_dense(torch.tensor([1.0, 0.0, 3.0]))
    >>> m.nnz, m.mask().tolist()
    (2, [True, False, True])
    """

    name = "masked"

    def __init__(self, values: Tensor, mask: Tensor, validate: bool = True):
        self.values = values
        self._mask = mask
        self.shape = values.shape
        self.dtype = values.dtype
        if validate:
            self.validate()

    @classmethod
    def from_dense(cls, dense: Tensor, mask: Optional[Tensor] = None, **params: Any) -> "Masked":
        if params:
            raise TypeError(f"Masked takes no parameters, got {sorted(params)}")
        if mask is None:
            mask = dense != 0
        else:
            if mask.shape != dense.shape:
                raise ValueError(f"mask has shape {tuple(mask.shape)} but dense has {tuple(dense.shape)}")
            mask = mask.to(torch.bool)
        return cls(
            torch.where(mask, dense, torch.zeros((), dtype=dense.dtype, device=dense.device)), mask, validate=False
        )

    def to_dense(self) -> Tensor:
        return self.values

    def mask(self) -> Tensor:
        return self._mask

    @property
    def nnz(self) -> int:
        return int(self._mask.sum())

    def components(self) -> Dict[str, Tensor]:
        return {"values": self.values, "mask": self._mask}

    @classmethod
    def from_components(cls, components: Dict[str, Tensor], shape: Iterable[int], **params: Any) -> "Masked":
        out = cls(components["values"], components["mask"])
        if tuple(out.shape) != tuple(shape):
            raise ValueError(f"Masked: values has shape {tuple(out.shape)}, expected {tuple(shape)}")
        return out

    def validate(self) -> None:
        if self._mask.dtype != torch.bool:
            raise ValueError(f"Masked: mask must be bool, got {self._mask.dtype}")
        if self._mask.shape != self.values.shape:
            raise ValueError(f"Masked: mask shape {tuple(self._mask.shape)} != values shape {tuple(self.values.shape)}")

    def refill(self, dense: Tensor) -> "Masked":
        return Masked(
            torch.where(self._mask, dense.to(self.dtype), torch.zeros((), dtype=self.dtype, device=dense.device)),
            self._mask,
            validate=False,
        )

    @property
    def nbytes(self) -> int:
        # a bitmask would cost numel/8; report what is actually held in memory
        return self.values.numel() * self.values.element_size() + self._mask.numel()
