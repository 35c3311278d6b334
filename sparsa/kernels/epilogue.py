"""Activations the native linear kernels apply in their epilogue (after the bias, before the output
is stored), and the matching PyTorch semantics and gradient.

    >>> import torch
    >>> from sparsa.kernels.epilogue import activate, activation_code
    >>> activation_code("gelu"), activate(torch.zeros(2), "gelu").tolist()
    (1, [0.0, 0.0])
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ACTIVATIONS", "activation_code", "activate", "activation_backward"]

#: epilogue activations: "none", or GELU in its erf form (``torch.nn.GELU()``)
ACTIVATIONS = ("none", "gelu")
_CODE = {"none": 0, "gelu": 1}


def activation_code(activation: str, op: str = "linear") -> int:
    """The kernels' integer code for ``activation``; a clear error naming ``op`` for anything else."""
    if activation not in _CODE:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    return _CODE[activation]


def activate(y: Tensor, activation: str) -> Tensor:
    """``y`` after the epilogue activation (the reference the kernels are tested against)."""
    return torch.nn.functional.gelu(y) if activation == "gelu" else y


def activation_backward(pre: Tensor, grad: Tensor, activation: str) -> Tensor:
    """The gradient at the pre-activation ``pre`` given the gradient ``grad`` of the activated output
    (computed in float32 for reduced types, returned in ``grad``'s dtype)."""
    if activation == "none":
        return grad
    with torch.enable_grad():
        p = pre.detach().float().requires_grad_()
        (g,) = torch.autograd.grad(activate(p, activation), p, grad.float())
    return g.to(grad.dtype)
