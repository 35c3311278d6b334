"""The Dense layout: a plain strided tensor. It is the dispatcher's name for "not sparse"."""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional

import torch
from torch import Tensor

from .base import Layout, register_layout


@register_layout
class Dense(Layout):
    """A plain tensor seen as a layout (every position stored).

    >>> import torch
    >>> from sparsa.layouts import Dense
    >>> Dense.from_dense(torch.ones(2, 2)).nnz
    4
    """

    name = "dense"

    def __init__(self, values: Tensor):
        self.values = values
        self.shape = values.shape
        self.dtype = values.dtype

    @classmethod
    def from_dense(cls, dense: Tensor, mask: Optional[Tensor] = None, **params: Any) -> "Dense":
        if params:
            raise TypeError(f"Dense takes no parameters, got {sorted(params)}")
        return cls(dense if mask is None else dense * mask)

    def to_dense(self) -> Tensor:
        return self.values

    def mask(self) -> Tensor:
        return torch.ones(self.shape, dtype=torch.bool, device=self.values.device)

    @property
    def nnz(self) -> int:
        return self.values.numel()

    def components(self) -> Dict[str, Tensor]:
        return {"values": self.values}

    @classmethod
    def from_components(cls, components: Dict[str, Tensor], shape: Iterable[int], **params: Any) -> "Dense":
        out = cls(components["values"])
        if tuple(out.shape) != tuple(shape):
            raise ValueError(f"values has shape {tuple(out.shape)}, expected {tuple(shape)}")
        return out

    def validate(self) -> None:
        pass

    def refill(self, dense: Tensor) -> "Dense":
        return Dense(dense.to(self.dtype))
