"""bf16 autocast and the activation-sparse kernels.

Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` PyTorch's conv/linear take bf16 operands with fp32
accumulation and return bf16. The sparse path takes the same inputs and returns the same dtype. Where the
CPU has AVX512-BF16, the union conv kernels take the bf16 activation and the bf16-rounded weight
(:mod:`sparsa.kernels.adaptive_union_bf16`); elsewhere the sparse path runs the fp32 kernels on the
upcast activation and the fp32 master weights, and rounds once, at its output. On CPUs without bf16
hardware the fp32 kernels are the fast ones anyway.

Example::

    >>> import torch
    >>> from sparsa.adaptive.autocast import autocast_bf16, sparse_under_autocast
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     y = sparse_under_autocast(lambda t: t * 2, torch.ones(2, dtype=torch.bfloat16))
    ...     on = autocast_bf16()
    >>> on, y.dtype, autocast_bf16()
    (True, torch.bfloat16, False)
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

__all__ = ["autocast_bf16", "sparse_under_autocast"]


def autocast_bf16() -> bool:
    """Whether CPU autocast to bf16 is on here (then the dense path computes in bf16)."""
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def sparse_under_autocast(fn: Callable[[Tensor], Tensor], x: Tensor, bf16_operands: bool = False) -> Tensor:
    """``fn(x)`` through the sparse kernels; under bf16 autocast ``fn`` runs with autocast off (so no op inside
    it is cast again) and the result comes back in bf16, as autocast's own op would. ``fn`` gets ``x`` in
    bf16 when ``bf16_operands`` (kernels that take bf16 operands and return bf16), else an fp32 copy."""
    if not autocast_bf16():
        return fn(x)
    with torch.autocast("cpu", enabled=False):
        if bf16_operands:
            return fn(x.to(torch.bfloat16))
        return fn(x.float()).to(torch.bfloat16)
