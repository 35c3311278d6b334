"""Which native kernel flavour a set of linear operands can run.

Every native linear kernel (row_group, sliced_ell, grouped_nm) comes in a float32 and a bfloat16
flavour with the same rule: input and weight values on the CPU in one of those dtypes, and a bias
that is absent, float32, or of the input's dtype (it is added in float32 before the output is rounded).
Anything else runs the pure-PyTorch reference.

    >>> import torch
    >>> from sparsa.kernels.operands import native_kind
    >>> native_kind(torch.ones(2, 3), torch.ones(4), None)
    'f32'
    >>> native_kind(torch.ones(2, 3, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bfloat16), torch.ones(4))
    'bf16'
    >>> native_kind(torch.ones(2, 3, dtype=torch.float64), torch.ones(4, dtype=torch.float64), None) is None
    True
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

__all__ = [
    "native_kind",
    "REDUCED_DTYPES",
    "compute_dtype",
    "token_rows",
    "version_key",
    "float_bias",
    "bitmask_rows_call",
]

_KINDS = {torch.float32: "f32", torch.bfloat16: "bf16"}
#: dtypes the kernels and references compute in float32 and round once
REDUCED_DTYPES = (torch.bfloat16, torch.float16)


def native_kind(x: Tensor, values: Tensor, bias: Optional[Tensor]) -> Optional[str]:
    """``"f32"``, ``"bf16"``, or None (the reference runs). Says nothing about whether the library is
    built (see each kernel module's ``native_library``)."""
    # ``is_cpu``, not ``device.type``: building a device object per operand is a visible part of a decode call
    if not (x.is_cpu and values.is_cpu and (bias is None or bias.is_cpu)):
        return None
    if x.dtype != values.dtype or x.dtype not in _KINDS:
        return None
    if bias is not None and bias.dtype not in (torch.float32, x.dtype):
        return None
    return _KINDS[x.dtype]


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype a reference or backward computes in: float64 stays float64; float32 and the reduced
    types compute in float32."""
    out = torch.float32
    for d in dtypes:
        out = torch.promote_types(out, d)
    return torch.float32 if out in REDUCED_DTYPES else out


def token_rows(x: Tensor, out_features: int) -> Tuple[Tensor, int, Tensor]:
    """``(x2, T, y)`` for a linear kernel: ``x`` contiguous (the kernel reads it as ``[T, K]``, no reshape), its
    number of token rows, and the output allocated in its final shape ``(*x.shape[:-1], out_features)``.
    ``K = 0`` raises as ``x.reshape(-1, 0)`` does."""
    K = x.shape[-1]
    x2 = x if x.is_contiguous() else x.contiguous()
    T = x2.numel() // K if K else x.reshape(-1, K).shape[0]
    return x2, T, torch.empty(*x.shape[:-1], out_features, dtype=x.dtype)


def version_key(t: Tensor) -> Optional[Tuple[int, int]]:
    """``(data pointer, version)`` of ``t``: what a cache derived from ``t``'s values is valid for (an in-place
    update bumps the version); None for an inference tensor, which has no version counter."""
    try:
        return t.data_ptr(), t._version
    except RuntimeError:
        return None


#: the attribute of a kernel-owned tensor that keeps float_bias's copy
_BIAS_ATTR = "_sparsa_float_bias"


def float_bias(bias: Tensor, length: int = 0, holder: Optional[Tensor] = None) -> Tensor:
    """``bias`` as the contiguous float32 vector the kernels add, zero-padded to ``length`` entries if longer.

    A float32 contiguous bias of its own length is returned as it is. Otherwise, with a ``holder`` (a tensor
    the kernels own, e.g. the weight's values: never the user's bias, whose attributes a checkpoint would
    save), the copy is kept on the holder while the bias's identity, data pointer and version are
    unchanged, so a bf16 layer does not convert its bias on every call. Inference tensors, which have no
    version, get a fresh copy."""
    n = max(length, bias.numel())
    if bias.dtype == torch.float32 and n == bias.numel() and bias.is_contiguous():
        return bias
    version = None if holder is None else version_key(bias)
    key = None if version is None else (id(bias), *version, n)
    hit = getattr(holder, _BIAS_ATTR, None) if key is not None else None
    if hit is not None and hit[0] == key:
        return hit[1]
    b = bias.detach().to(torch.float32).contiguous()
    if n > b.numel():
        b = torch.cat([b, b.new_zeros(n - b.numel())])
    if key is not None:
        setattr(holder, _BIAS_ATTR, (key, b))
    return b


def bitmask_rows_call(
    entry: Any, x2: Tensor, bits: Tensor, row_ptr: Tensor, values: Tensor, bias: Optional[Tensor], R: int, act: int = 0
) -> Tuple[int, Tensor]:
    """``(rc, y)`` of a many-token Bitmask kernel whose C signature is ``(x, T, K, bits, row_ptr, values, R,
    bias, y, nthreads, act)`` (the panel and AMX kernels): ``x2`` 2-D and contiguous, the components
    contiguous, the bias passed in float32, ``y`` a fresh ``(T, R)`` tensor of ``x2``'s dtype; ``act``: the
    epilogue's activation code (:func:`sparsa.kernels.epilogue.activation_code`)."""
    T, K = x2.shape
    y = torch.empty(T, R, dtype=x2.dtype)
    b = None if bias is None else float_bias(bias, holder=values)
    rc = entry(
        x2.data_ptr(),
        T,
        K,
        bits.data_ptr(),
        row_ptr.data_ptr(),
        values.data_ptr(),
        R,
        None if b is None else b.data_ptr(),
        y.data_ptr(),
        torch.get_num_threads(),
        act,
    )
    return rc, y
