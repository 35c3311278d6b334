"""Sparse operands under ``torch.autocast``: the dispatcher casts them as autocast casts dense ones.

A ``SparseTensor`` argument reaches sparsa's dispatcher at the torch-function level, above the autocast
dispatch key, so autocast never sees the call. Without this module a model trained or run under
``torch.autocast("cpu", dtype=torch.bfloat16)`` would meet a bf16 activation and an fp32 sparse weight in
one ``F.linear`` and fail. For the ops autocast runs in the lower precision (:data:`AUTOCAST_OPS`), every
float32 argument is cast to autocast's dtype (a differentiable copy: gradients reach the fp32 master
weights in fp32; float64 ones stay, as autocast leaves them), and the op runs with autocast off.
Layouts whose kernels compute in float32 only (:data:`FLOAT32_LAYOUTS`) run the op in float32 instead and
cast its output to autocast's dtype, so what follows sees the dtype it would see from the dense op.

Example::

    >>> import torch, sparsa
    >>> lin = torch.nn.Linear(32, 8)
    >>> _ = sparsa.sparsify(lin, [sparsa.Rule(sparsifier=sparsa.sparsifiers.Magnitude(0.5), layout="sliced_ell")])
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     y = lin(torch.randn(4, 32).bfloat16())
    >>> y.dtype
    torch.bfloat16
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from ..tensor_base import SparseTensorBase

__all__ = ["AUTOCAST_OPS", "FLOAT32_LAYOUTS", "autocast_dtype", "run_under_autocast"]

#: the dispatcher's ops that autocast computes in its lower precision (PyTorch's CPU and CUDA lists)
AUTOCAST_OPS = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "conv2d"})
#: layouts whose ops compute in float32 or float64 only (torch.sparse CSR products, the activation-sparse
#: training kernels of relu_compact): under autocast their ops run in float32
FLOAT32_LAYOUTS = frozenset({"csr", "relu_compact"})


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """Autocast's lower-precision dtype on ``device_type`` when autocast is on there, else None."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _cast(a: Any, dtype: torch.dtype) -> Any:
    if not isinstance(a, Tensor) or a.dtype == dtype:
        return a
    # as autocast: float32 goes down to autocast's dtype and float64 stays; the float32 path widens bf16/fp16
    castable = (torch.bfloat16, torch.float16) if dtype == torch.float32 else (torch.float32,)
    return a.to(dtype) if a.dtype in castable else a


def run_under_autocast(func: Callable, args: tuple, kwargs: dict, device_type: str, dtype: torch.dtype) -> Any:
    """``func(*args, **kwargs)`` as autocast would run it: float32 arguments cast to ``dtype`` (or the reduced
    ones to float32 when a sparse argument's layout is in :data:`FLOAT32_LAYOUTS`, the result then cast to
    ``dtype``), with autocast off inside."""
    wide = any(isinstance(a, SparseTensorBase) and a.layout_name in FLOAT32_LAYOUTS for a in (*args, *kwargs.values()))
    to = torch.float32 if wide else dtype
    with torch.autocast(device_type, enabled=False):
        out = func(*(_cast(a, to) for a in args), **{k: _cast(v, to) for k, v in kwargs.items()})
    if wide and isinstance(out, Tensor) and out.is_floating_point():
        out = out.to(dtype)
    return out
