"""``sparsa::row_group_linear``: Y = X W^T + b with W in the RowGroup layout.

A ``torch.library`` custom op (with a fake implementation, so it traces under ``torch.compile``)
around the native AVX2/FMA + OpenMP kernel in ``csrc/row_group_linear.cpp`` (with AVX-512 tiles
chosen at run time when the CPU has them; ``SPARSA_NO_AVX512=1`` keeps the AVX2 ones); when the
kernel cannot be built, or ``SPARSA_NO_NATIVE=1``, the same op runs :func:`row_group_linear_reference`
(gather + batched matmul).

Example::

    >>> import torch
    >>> from sparsa.layouts import RowGroup
    >>> from sparsa.kernels.row_group import row_group_linear
    >>> w = RowGroup.from_dense(torch.randn(20, 30), group=8, sparsity=0.5)
    >>> x = torch.randn(5, 30)
    >>> y = row_group_linear(x, w.columns, w.values, None, 20)
    >>> torch.allclose(y, x @ w.to_dense().T, atol=1e-4)
    True
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch
from torch import Tensor

from . import loader

__all__ = ["row_group_linear", "row_group_linear_impl", "row_group_linear_reference", "native_library"]

_SOURCES = ["row_group_linear.cpp"]


def native_library() -> Optional[ctypes.CDLL]:
    """The native kernel library, or None when the fallback must run."""
    lib = loader.load("row_group_linear", _SOURCES)
    if lib is not None and not getattr(lib, "_sparsa_typed", False):
        f = lib.sparsa_row_group_linear_f32
        i64, vp = ctypes.c_int64, ctypes.c_void_p
        f.argtypes = [vp, i64, i64, vp, vp, i64, i64, i64, vp, vp, i64, vp, ctypes.c_int]
        f.restype = ctypes.c_int
        lib._sparsa_typed = True
    return lib


def row_group_linear_reference(x: Tensor, columns: Tensor, values: Tensor, bias: Optional[Tensor],
                               out_features: int, row_perm: Optional[Tensor] = None) -> Tensor:
    """Pure-PyTorch semantics of the kernel: ``x[..., K] -> y[..., out_features]`` (slot ``s`` of the
    groups is output ``row_perm[s]``; None: consecutive rows)."""
    ng, k, G = values.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    xg = x2[:, columns.reshape(-1).long()].view(-1, ng, k).transpose(0, 1)  # (ng, T, k)
    y = torch.bmm(xg, values.to(x2.dtype)).transpose(0, 1).reshape(x2.shape[0], ng * G)
    if row_perm is not None:
        y = y.new_empty(y.shape).index_copy_(1, row_perm.long(), y)
    y = y[:, :out_features]
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, out_features)


def _native_forward(lib: ctypes.CDLL, x: Tensor, columns: Tensor, values: Tensor, bias: Optional[Tensor],
                    out_features: int, row_perm: Optional[Tensor]) -> Tensor:
    ng, k, G = values.shape
    K = x.shape[-1]
    x2 = x.reshape(-1, K).contiguous()
    T = x2.shape[0]
    y = torch.empty(T, out_features, dtype=torch.float32)
    if T == 0 or out_features == 0:
        return y.reshape(*x.shape[:-1], out_features)
    cols = columns.contiguous()
    vals = values.contiguous()
    b = None
    if bias is not None:
        b = bias.contiguous()
        if b.numel() != ng * G:
            b = torch.cat([b, b.new_zeros(ng * G - b.numel())])
    perm = None if row_perm is None else row_perm.to(torch.int32).contiguous()
    rc = lib.sparsa_row_group_linear_f32(
        x2.data_ptr(), T, K, cols.data_ptr(), vals.data_ptr(), ng, k, G,
        None if b is None else b.data_ptr(), y.data_ptr(), out_features,
        None if perm is None else perm.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"row_group_linear: unsupported group size {G}")
    return y.reshape(*x.shape[:-1], out_features)


def _use_native(x: Tensor, values: Tensor, bias: Optional[Tensor]) -> Optional[ctypes.CDLL]:
    if x.device.type != "cpu" or x.dtype != torch.float32 or values.dtype != torch.float32:
        return None
    if bias is not None and bias.dtype != torch.float32:
        return None
    return native_library()


def row_group_linear_impl(x: Tensor, columns: Tensor, values: Tensor, bias: Optional[Tensor],
                          out_features: int, row_perm: Optional[Tensor] = None) -> Tensor:
    """Eager implementation (what the custom op runs): native kernel for float32 CPU tensors when
    available, else the reference."""
    lib = _use_native(x, values, bias)
    if lib is None:
        return row_group_linear_reference(x, columns, values, bias, out_features, row_perm).contiguous()
    return _native_forward(lib, x, columns, values, bias, out_features, row_perm)


@torch.library.custom_op("sparsa::row_group_linear", mutates_args=())
def row_group_linear(x: Tensor, columns: Tensor, values: Tensor, bias: Optional[Tensor],
                     out_features: int, row_perm: Optional[Tensor] = None) -> Tensor:
    """``y[..., R] = x[..., K] @ W.T + bias`` for W given by RowGroup ``columns``/``values``/``row_perm``."""
    return row_group_linear_impl(x, columns, values, bias, out_features, row_perm)


@row_group_linear.register_fake
def _(x, columns, values, bias, out_features, row_perm=None):
    return x.new_empty(*x.shape[:-1], out_features)
