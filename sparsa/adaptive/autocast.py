"""bf16 autocast and the activation-sparse kernels.

Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` PyTorch's conv/linear take bf16 operands with fp32
accumulation and return bf16. The sparse path takes the same inputs and returns the same dtype: it runs
the fp32 kernels on the upcast activation and the fp32 master weights, and rounds once, at its output.
Kernels with bf16 operands (AMX tiles, ``VDPBF16PS``) would slot in here; on CPUs without bf16 hardware
the fp32 kernels are the fast ones anyway.

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


def sparse_under_autocast(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """``fn(x)`` through the fp32 kernels; under bf16 autocast ``fn`` gets an fp32 copy of ``x`` with autocast
    off (so no op inside it is cast again) and the result comes back in bf16, as autocast's own op would."""
    if not autocast_bf16():
        return fn(x)
    with torch.autocast("cpu", enabled=False):
        return fn(x.float()).to(torch.bfloat16)
