"""The GPU implementations of ops: sparsa's Triton kernels (:mod:`sparsa.gpu`), chosen by device.

The kernels live in :mod:`sparsa.gpu`, which knows nothing of the dispatcher; this module, like every
other implementation file, sits in :mod:`sparsa.ops` above both.

Each implementation is a *device implementation* (:func:`sparsa.ops.registry.register_device_impl`):
it runs where its ``applies`` check holds -- all tensors on CUDA (or on the CPU while Triton's
interpreter is on, ``TRITON_INTERPRET=1``), Triton importable, supported dtype and structure -- and
otherwise the plain (CPU, pure-PyTorch) implementation for the same layouts runs. Importing this
module is cheap: Triton is only imported when a kernel first runs.

=============================  =========================================  ===========================
op(layouts)                    GPU implementation                          elsewhere
=============================  =========================================  ===========================
linear(Dense, NM 2:4, Dense)   PyTorch semi-structured (sm80+, fp16/bf16)  Triton N:M / CPU impl
linear(Dense, NM, Dense)       Triton N:M kernels (fwd + both grads)       CPU impl
linear(Dense, BSR, Dense)      Triton block-sparse kernels (blocks>=16)    CPU impl
linear(Masked, Dense, Dense)   activation-sparse Triton GEMMs              pure-torch reference
conv2d(Masked, Dense, Dense)   activation-sparse im2col + Triton GEMMs     pure-torch reference
=============================  =========================================  ===========================

A ``Masked`` activation (e.g. ``sparsa.to_sparse(torch.relu(z), "masked")``) marks the ReLU
output whose zeros the kernels skip; its gradient is returned on its pattern only.

Example::

    >>> import sparsa
    >>> from sparsa.layouts import BSR
    >>> sparsa.ops.explain("linear", None, BSR)         # doctest: +ELLIPSIS
    "linear('dense', 'bsr', 'dense'): TritonBSRLinear | ..."
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..layouts.bsr import BSR
from ..layouts.dense import Dense
from ..layouts.masked import Masked
from ..layouts.nm import NM
from ..gpu._launch import KERNEL_DTYPES
from ..gpu._triton import gpu_eligible
from .registry import register_device_impl

__all__ = ["register_gpu_impls"]


def _needs(ctx: Any, i: int) -> bool:
    n = getattr(ctx, "needs_input_grad", ())
    return len(n) > i and bool(n[i])


def _dtype_ok(x: Any, dtype: torch.dtype) -> bool:
    if not isinstance(x, Tensor) or x.dtype != dtype or dtype not in KERNEL_DTYPES:
        return False
    return not (x.is_cuda and dtype == torch.float64)  # keep float64 on the GPU with PyTorch


def _bias_ok(b: Any, n: int, dtype: torch.dtype) -> bool:
    return b is None or (isinstance(b, Tensor) and b.dim() == 1 and b.shape[0] == n and b.dtype == dtype)


# =============================================================================== weight-sparse linear
def _weight_applies(x: Any, w: Any, b: Any = None) -> bool:
    return (
        len(w.shape) == 2
        and _dtype_ok(x, w.dtype)
        and x.dim() >= 1
        and x.shape[-1] == w.shape[1]
        and _bias_ok(b, w.shape[0], w.dtype)
        and gpu_eligible(x, w.values, b)
    )


def _nm_applies(x: Any, w: Any, b: Any = None, **rest: Any) -> bool:
    return isinstance(w, NM) and _weight_applies(x, w, b)


def _bsr_applies(x: Any, w: Any, b: Any = None, **rest: Any) -> bool:
    if not (isinstance(w, BSR) and _weight_applies(x, w, b)):
        return False
    from ..gpu.weight_sparse import bsr_supported

    return bsr_supported(w)


def _semi_applies(x: Any, w: Any, b: Any = None, **rest: Any) -> bool:
    if not (
        isinstance(w, NM) and (w.n, w.m) == (2, 4) and isinstance(x, Tensor) and x.is_cuda and _weight_applies(x, w, b)
    ):
        return False
    from ..gpu.semi_structured import semi_structured_weight

    return semi_structured_weight(w) is not None


class _WeightSparseLinear:
    """Shared forward/backward; subclasses name the three kernels."""

    kind = ""

    @classmethod
    def _kernels(cls):
        from ..gpu import weight_sparse as ws

        return (
            getattr(ws, f"{cls.kind}_linear_forward"),
            getattr(ws, f"{cls.kind}_linear_grad_input"),
            getattr(ws, f"{cls.kind}_linear_grad_weight"),
        )

    @classmethod
    def forward(cls, ctx: Any, x: Tensor, w: Any, b: Optional[Tensor] = None) -> Tensor:
        fwd, _, _ = cls._kernels()
        x2 = x.reshape(-1, x.shape[-1])
        y = fwd(x2, w, b)
        ctx.layout, ctx.x_shape, ctx.has_bias = w, x.shape, b is not None
        ctx.save_for_backward(x2)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @classmethod
    def backward(cls, ctx: Any, g: Tensor):
        _, gin, gwt = cls._kernels()
        (x2,) = ctx.saved_tensors
        w = ctx.layout
        g2 = g.reshape(-1, g.shape[-1]).to(x2.dtype)
        gx = gin(g2, w).reshape(ctx.x_shape) if _needs(ctx, 0) else None
        gw = gwt(g2, x2, w) if _needs(ctx, 1) else None
        gb = g2.sum(0) if ctx.has_bias and _needs(ctx, 2) else None
        return gx, gw, gb


class TritonNMLinear(_WeightSparseLinear):
    """``linear`` with an N:M weight: Triton decompress-in-registers GEMMs."""

    kind = "nm"


class TritonBSRLinear(_WeightSparseLinear):
    """``linear`` with a BSR weight: Triton block-sparse GEMMs (work ~ stored blocks)."""

    kind = "bsr"


class SemiStructuredLinear:
    """``linear`` with a 2:4 weight on sparse tensor cores; gradients by the Triton N:M kernels."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Any, b: Optional[Tensor] = None) -> Tensor:
        from ..gpu.semi_structured import semi_structured_linear

        ctx.layout, ctx.x_shape, ctx.has_bias = w, x.shape, b is not None
        ctx.save_for_backward(x.reshape(-1, x.shape[-1]))
        return semi_structured_linear(x, w, b)

    @staticmethod
    def backward(ctx: Any, g: Tensor):
        return TritonNMLinear.backward(ctx, g)


# =============================================================================== activation-sparse ops
def _act_applies(x: Any, w: Any, b: Any = None, **rest: Any) -> bool:
    return (
        isinstance(x, Masked)
        and _dtype_ok(w, x.dtype)
        and _bias_ok(b, w.shape[0], w.dtype)
        and gpu_eligible(x.values, w, b)
    )


def _act_linear_applies(x: Any, w: Any, b: Any = None, **rest: Any) -> bool:
    return _act_applies(x, w, b) and w.dim() == 2 and x.shape[-1] == w.shape[1]


def _act_conv_applies(x: Any, w: Any, b: Any = None, stride=1, padding=0, dilation=1, groups=1, **rest) -> bool:
    return (
        _act_applies(x, w, b)
        and groups == 1
        and not isinstance(padding, str)
        and len(x.shape) == 4
        and w.dim() == 4
        and x.shape[1] == w.shape[1]
    )


class ActSparseLinear:
    """``linear`` with a Masked (ReLU-output) input: compaction + the three activation-sparse GEMMs.

    Off the GPU it runs the dense reference with the same semantics (gradient on the pattern)."""

    @staticmethod
    def forward(ctx: Any, x: Masked, w: Tensor, b: Optional[Tensor] = None) -> Tensor:
        a = x.to_dense()
        active = x.mask()
        a2, act2 = a.reshape(-1, a.shape[-1]), active.reshape(-1, a.shape[-1])
        ctx.fast = _act_linear_applies(x, w, b)
        ctx.x_shape, ctx.has_bias = a.shape, b is not None
        if ctx.fast:
            from ..gpu.act_sparse import _compact_panels, act_sparse_mm

            c = ctx.compacted = _compact_panels(act2, need_rows=_needs(ctx, 1))
            y = act_sparse_mm(a2, w, b, c)
        else:
            y = F.linear(a2, w, b)
        ctx.save_for_backward(a2, act2, w)
        return y.reshape(*a.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, g: Tensor):
        a2, act2, w = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1]).to(a2.dtype)
        ga = gw = gb = None
        if ctx.fast:
            from ..gpu.act_sparse import act_sparse_grad_input, act_sparse_grad_weight

            if _needs(ctx, 0):
                ga = act_sparse_grad_input(g2, w, act2, ctx.compacted)
            if _needs(ctx, 1):
                gw = act_sparse_grad_weight(g2, a2, ctx.compacted)
        else:
            if _needs(ctx, 0):
                ga = (g2 @ w) * act2.to(g2.dtype)
            if _needs(ctx, 1):
                gw = g2.t() @ a2
        if ga is not None:
            ga = ga.reshape(ctx.x_shape)
        if ctx.has_bias and _needs(ctx, 2):
            gb = g2.sum(0)
        return ga, gw, gb


class ActSparseConv2d:
    """``conv2d`` with a Masked (ReLU-output) input: im2col + the activation-sparse GEMMs; the
    gradients come from a small autograd graph built in forward (the dense reference off the GPU)."""

    @staticmethod
    def forward(
        ctx: Any, x: Masked, w: Tensor, b: Optional[Tensor] = None, stride=1, padding=0, dilation=1, groups=1
    ) -> Tensor:
        fast = _act_conv_applies(x, w, b, stride, padding, dilation, groups)
        want = tuple(_needs(ctx, i) for i in range(3))
        with torch.enable_grad():
            leaves = (
                x.to_dense().detach().requires_grad_(want[0]),
                w.detach().requires_grad_(want[1]),
                None if b is None else b.detach().requires_grad_(want[2]),
            )
            if fast:
                from ..gpu.act_sparse import act_sparse_conv2d

                out = act_sparse_conv2d(
                    leaves[0], leaves[1], leaves[2], stride, padding, dilation, groups, active=x.mask()
                )
            else:
                out = F.conv2d(leaves[0], leaves[1], leaves[2], stride, padding, dilation, groups)
        if any(want):
            ctx.graph, ctx.mask = (out, leaves), x.mask()
        return out.detach()

    @staticmethod
    def backward(ctx: Any, g: Tensor):
        out, leaves = ctx.graph
        idx = [i for i, t in enumerate(leaves) if t is not None and t.requires_grad]
        got = torch.autograd.grad(out, [leaves[i] for i in idx], g)
        grads: list = [None, None, None]
        for i, t in zip(idx, got):
            grads[i] = t
        if grads[0] is not None:
            grads[0] = grads[0] * ctx.mask.to(grads[0].dtype)
        del ctx.graph
        return tuple(grads)


# =============================================================================== registration
def register_gpu_impls() -> None:
    """(Re-)register all GPU implementations; idempotent. Called on import of this module."""
    reg = register_device_impl
    reg(
        "linear",
        (Dense, NM, Dense),
        SemiStructuredLinear.forward,
        SemiStructuredLinear.backward,
        applies=_semi_applies,
        name="SemiStructuredLinear",
    )
    reg(
        "linear",
        (Dense, NM, Dense),
        TritonNMLinear.forward,
        TritonNMLinear.backward,
        applies=_nm_applies,
        name="TritonNMLinear",
    )
    reg(
        "linear",
        (Dense, BSR, Dense),
        TritonBSRLinear.forward,
        TritonBSRLinear.backward,
        applies=_bsr_applies,
        name="TritonBSRLinear",
    )
    reg(
        "linear",
        (Masked, Dense, Dense),
        ActSparseLinear.forward,
        ActSparseLinear.backward,
        applies=_act_linear_applies,
        name="ActSparseLinear",
    )
    reg(
        "conv2d",
        (Masked, Dense, Dense),
        ActSparseConv2d.forward,
        ActSparseConv2d.backward,
        applies=_act_conv_applies,
        name="ActSparseConv2d",
    )


register_gpu_impls()
