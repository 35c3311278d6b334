"""``sparsa::sliced_ell_linear``: Y = X W^T + b with W in the SlicedELL layout (very sparse weights).

A ``torch.library`` custom op (with a fake implementation for ``torch.compile``) around the native
kernel in ``csrc/sliced_ell_linear.cpp`` (tokens vectorised over a transposed X panel, two rows at a
time); when the kernel cannot be built, or ``SPARSA_NO_NATIVE=1``, the op runs
:func:`sliced_ell_linear_reference` (rebuild the dense weight, then one matmul).

The native kernel runs for CPU tensors with ``x`` and ``values`` both float32 (bias float32 or None), or both
bfloat16 (bias bfloat16, float32 or None): then products accumulate in float32 and the bfloat16 output is
rounded once (nearest even). Other combinations run the reference, which for bfloat16/float16 inputs also
computes in float32 and rounds once. The output has ``x``'s dtype.

Example::

    >>> import torch
    >>> from sparsa.layouts import SlicedELL
    >>> from sparsa.kernels.sliced_ell import sliced_ell_linear
    >>> w = SlicedELL.from_dense(torch.randn(20, 30), sparsity=0.9)
    >>> x = torch.randn(5, 30)
    >>> y = sliced_ell_linear(x, w.slice_ptr, w.columns, w.values, None, 20)
    >>> torch.allclose(y, x @ w.to_dense().T, atol=1e-4)
    True
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch
from torch import Tensor

from . import loader

__all__ = ["sliced_ell_linear", "sliced_ell_linear_reference", "native_library", "native_kind"]

_SOURCES = ["sliced_ell_linear.cpp"]


def native_library() -> Optional[ctypes.CDLL]:
    """The native kernel library, or None when the fallback must run."""
    lib = loader.load("sliced_ell_linear", _SOURCES)
    if lib is not None and not getattr(lib, "_sparsa_typed", False):
        f = lib.sparsa_sliced_ell_linear_f32
        i64, vp = ctypes.c_int64, ctypes.c_void_p
        f.argtypes = [vp, i64, i64, vp, vp, vp, i64, vp, vp, ctypes.c_int]
        f.restype = ctypes.c_int
        f = lib.sparsa_sliced_ell_linear_bf16
        f.argtypes = [vp, i64, i64, vp, vp, vp, i64, vp, ctypes.c_int, vp, ctypes.c_int]
        f.restype = ctypes.c_int
        lib._sparsa_typed = True
    return lib


def _dense_weight(slice_ptr: Tensor, columns: Tensor, values: Tensor, out_features: int, in_features: int,
                  dtype: torch.dtype) -> Tensor:
    """The logical weight (padding entries are zeros, so they add nothing)."""
    ns = slice_ptr.numel() - 1
    # slice of every entry (searchsorted: repeat_interleave is slow on small CPU tensors)
    slice_id = torch.searchsorted(slice_ptr[1:], torch.arange(columns.numel(), device=columns.device), right=True)
    pos = torch.arange(columns.numel(), device=columns.device) - slice_ptr[slice_id]
    rows = 2 * slice_id + pos % 2
    w = torch.zeros(2 * ns, in_features, dtype=dtype, device=values.device)
    w.index_put_((rows, columns.long()), values.to(dtype), accumulate=True)
    return w[:out_features]


_REDUCED = (torch.bfloat16, torch.float16)


def sliced_ell_linear_reference(x: Tensor, slice_ptr: Tensor, columns: Tensor, values: Tensor,
                                bias: Optional[Tensor], out_features: int) -> Tensor:
    """Pure-PyTorch semantics of the kernel: ``x[..., K] -> y[..., out_features]`` in ``x``'s dtype. For
    bfloat16/float16 ``x`` it computes in float32 (weights and bias widened, not rounded to ``x``'s dtype)
    and rounds the result once."""
    if x.dtype in _REDUCED:
        w = _dense_weight(slice_ptr, columns, values, out_features, x.shape[-1], torch.float32)
        b = None if bias is None else bias.to(torch.float32)
        return torch.nn.functional.linear(x.to(torch.float32), w, b).to(x.dtype)
    w = _dense_weight(slice_ptr, columns, values, out_features, x.shape[-1], x.dtype)
    return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))


def _native_forward(lib: ctypes.CDLL, kind: str, x: Tensor, slice_ptr: Tensor, columns: Tensor, values: Tensor,
                    bias: Optional[Tensor], out_features: int) -> Tensor:
    K = x.shape[-1]
    x2 = x.reshape(-1, K).contiguous()
    T = x2.shape[0]
    y = torch.empty(T, out_features, dtype=x.dtype)
    if T > 0 and out_features > 0:
        sp, c, v = slice_ptr.contiguous(), columns.contiguous(), values.contiguous()
        b = None if bias is None else bias.contiguous()
        bp = None if b is None else b.data_ptr()
        if kind == "bf16":
            lib.sparsa_sliced_ell_linear_bf16(x2.data_ptr(), T, K, sp.data_ptr(), c.data_ptr(), v.data_ptr(),
                                              out_features, bp, int(b is not None and b.dtype == torch.bfloat16),
                                              y.data_ptr(), torch.get_num_threads())
        else:
            lib.sparsa_sliced_ell_linear_f32(x2.data_ptr(), T, K, sp.data_ptr(), c.data_ptr(), v.data_ptr(),
                                             out_features, bp, y.data_ptr(), torch.get_num_threads())
    return y.reshape(*x.shape[:-1], out_features)


def native_kind(x: Tensor, values: Tensor, bias: Optional[Tensor]) -> Optional[str]:
    """Which native kernel these operands can run: ``"f32"``, ``"bf16"``, or None (the reference runs). Says
    nothing about whether the library is built (see :func:`native_library`)."""
    if x.device.type != "cpu" or values.device.type != "cpu" or (bias is not None and bias.device.type != "cpu"):
        return None
    if x.dtype == values.dtype == torch.float32:
        return "f32" if bias is None or bias.dtype == torch.float32 else None
    if x.dtype == values.dtype == torch.bfloat16:
        return "bf16" if bias is None or bias.dtype in (torch.bfloat16, torch.float32) else None
    return None


def sliced_ell_linear_impl(x: Tensor, slice_ptr: Tensor, columns: Tensor, values: Tensor, bias: Optional[Tensor],
                           out_features: int) -> Tensor:
    """Eager implementation (what the custom op runs): native kernel if possible, else the reference."""
    kind = native_kind(x, values, bias)
    lib = None if kind is None else native_library()
    if lib is None:
        return sliced_ell_linear_reference(x, slice_ptr, columns, values, bias, out_features).contiguous()
    return _native_forward(lib, kind, x, slice_ptr, columns, values, bias, out_features)


@torch.library.custom_op("sparsa::sliced_ell_linear", mutates_args=())
def sliced_ell_linear(x: Tensor, slice_ptr: Tensor, columns: Tensor, values: Tensor, bias: Optional[Tensor],
                      out_features: int) -> Tensor:
    """``y[..., R] = x[..., K] @ W.T + bias`` for W given by SlicedELL components."""
    return sliced_ell_linear_impl(x, slice_ptr, columns, values, bias, out_features)


@sliced_ell_linear.register_fake
def _(x, slice_ptr, columns, values, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)
