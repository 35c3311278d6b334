"""``CastLinear``: an ``nn.Linear`` that computes in another dtype than the model around it.

``only_if_faster`` may find that a layer runs fastest as a dense bfloat16 GEMM inside a float32
model (CPUs with AMX or AVX512-BF16); this module holds its parameters in that dtype, casts the
input to it and the output back, so the rest of the model is unchanged::

    >>> import torch, torch.nn as nn
    >>> from sparsa.nn.cast_linear import CastLinear
    >>> lin = CastLinear.from_linear(nn.Linear(8, 4), torch.bfloat16)
    >>> lin(torch.randn(2, 8)).dtype, lin.weight.dtype
    (torch.float32, torch.bfloat16)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CastLinear"]


class CastLinear(nn.Linear):
    """``F.linear`` in the parameters' dtype; the result is returned in the input's dtype."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype, weight: torch.Tensor = None) -> "CastLinear":
        """A copy of ``linear`` (or of ``weight`` with ``linear``'s bias) with parameters in ``dtype``."""
        if not dtype.is_floating_point:
            raise TypeError(f"CastLinear: dtype must be a floating-point dtype, got {dtype}")
        w = (linear.weight if weight is None else weight).detach()
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device=w.device, dtype=dtype)
        with torch.no_grad():
            new.weight.copy_(w.to(dtype))
            if linear.bias is not None:
                new.bias.copy_(linear.bias.detach().to(dtype))
        new.weight.requires_grad_(linear.weight.requires_grad)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)
