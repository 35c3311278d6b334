"""Small helpers shared by the Triton wrappers: dtype flags, dot precision, launch options."""

from __future__ import annotations

from typing import Any, Dict

import torch
from torch import Tensor

from ._triton import interpreting

#: dtypes the kernels accept
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def dot_flags(dtype: torch.dtype) -> Dict[str, Any]:
    """Compile-time flags for a kernel that multiplies ``dtype`` operands.

    ``F64``: accumulate in float64. ``UPCAST``: cast half-precision tiles to float32 before ``tl.dot``
    (only under the CPU interpreter, whose half-precision dot is wrong in Triton 3.9). ``PREC``: the
    fp32 dot precision, tf32 when PyTorch allows it for matmuls (as cuBLAS does), else exact.
    """
    half = dtype in (torch.bfloat16, torch.float16)
    tf32 = torch.backends.cuda.matmul.allow_tf32 and not interpreting()
    return {"F64": dtype == torch.float64, "UPCAST": half and interpreting(), "PREC": "tf32" if tf32 else "ieee"}


def launch_opts(num_warps: int = 4, num_stages: int = 3) -> Dict[str, int]:
    """``num_warps``/``num_stages`` for a compiled launch (the interpreter ignores them)."""
    return {} if interpreting() else {"num_warps": num_warps, "num_stages": num_stages}


def check_kernel_tensor(t: Tensor, arg: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in KERNEL_DTYPES:
        raise TypeError(
            f"{arg} has dtype {t.dtype}; sparsa's Triton kernels take float32, bfloat16, float16 or "
            f"float64 (convert with {arg}.float())"
        )


def next_pow2(n: int, lo: int = 16) -> int:
    p = lo
    while p < n:
        p *= 2
    return p
