"""``F.linear`` with a GroupedNM weight (STen's grouped N:M format): native CPU kernels, forward and backward.

Replaces the pure-PyTorch registration of :mod:`sparsa.ops.linear` for this layout, so
``F.linear(x, sparse_weight, bias)`` runs the kernels of :mod:`sparsa.kernels.grouped_nm`::

    >>> import torch, sparsa
    >>> w = sparsa.to_sparse(torch.randn(64, 48), "grouped_nm", n=1, m=4, g=4)
    >>> x = torch.randn(3, 48)
    >>> torch.allclose(torch.nn.functional.linear(x, w), x @ w.to_dense().T, atol=1e-4)
    True

Forward: the spmm kernel on the layout's components reordered into a plan (cached on the layout, rebuilt when
its values change; for ``1:m`` on AVX-512 CPUs a block-pair plan, where each loaded input vector feeds the
rows of two row blocks; a bf16 ``1:m`` weight with a bf16 input gets that fp32 plan too, and its input is
widened, because the pair pieces are fp32-only). A bf16 weight with a bf16 input of two tokens or more, on CPUs
with AVX512-BF16, runs the ``sliced_ell`` kernel's ``VDPBF16PS`` rows instead, on a SlicedELL twin of the weight
(the same pattern and values, built once and cached with the plans). Backward, each part only when
``ctx.needs_input_grad`` asks for it: ``grad_x = grad_y @ W`` (the spmm kernel on W's entries grouped by
column), ``grad_W`` on the kept pattern only (up to 15% density the sddmm kernel, one dot product over tokens
per stored value; above, BLAS ``grad_y.T @ x`` masked, which is faster there), returned as a dense tensor of W's
shape that is zero elsewhere, ``grad_b = grad_y.sum``. The spmm kernel runs natively for float32 and for
bfloat16 (``x`` and the weight both bfloat16: fp32 accumulation, output rounded to bfloat16 once; grad_x
likewise); without the native library, or for other dtype combinations, the same plans run in pure PyTorch.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import DataDependentOutputException, is_fake

from ..kernels import grouped_nm as _k
from ..kernels import sliced_ell as _se
from ..layouts.dense import Dense
from ..layouts.grouped_nm import GroupedNM
from ..layouts.sliced_ell import SlicedELL
from ..crossovers import crossover
from .registry import implements

__all__ = ["GroupedNMLinear"]

_CACHE_KEY = "native_linear_plans"


def _plans(w: GroupedNM) -> dict:
    """The kernel plans of ``w`` (built lazily, cached on the layout while its tensors are unchanged)."""
    key = (w.values.data_ptr(), w.values._version, w.columns.data_ptr(), w.columns._version, w.values.dtype)
    hit = w._cache.get(_CACHE_KEY)
    if hit is None or hit[0] != key:
        hit = w._cache[_CACHE_KEY] = (key, {})
    return hit[1]


def _plan(w: GroupedNM, kind: str) -> _k.Plan:
    plans = _plans(w)
    if kind not in plans:
        values = w.values.detach()
        if kind == "forward_widened":
            kind_of, values = "forward", values.float()
        else:
            kind_of = kind
        build = {"forward": _k.forward_plan, "pattern": _k.pattern_plan, "input_grad": _k.input_grad_plan}[kind_of]
        plans[kind] = build(values, w.columns, w.n, w.m)
    return plans[kind]


def _sliced_ell_twin(w: GroupedNM) -> SlicedELL:
    """``w``'s pattern and values as a SlicedELL (built once, cached with the plans)."""
    plans = _plans(w)
    if "sliced_ell" not in plans:
        plans["sliced_ell"] = SlicedELL.from_dense(w.to_dense().detach(), mask=w.mask())
    return plans["sliced_ell"]


def _forward(x: Tensor, w: GroupedNM, bias: Optional[Tensor]) -> Tensor:
    R = w.shape[0]
    if x.dtype == w.values.dtype == torch.bfloat16 and x.numel() > x.shape[-1] and _se.has_dpbf16():
        # the sliced_ell VDPBF16PS rows beat the grouped pieces (fp32 FMAs) on every grouped pattern measured
        s = _sliced_ell_twin(w)
        return _se.sliced_ell_linear_impl(x, s.slice_ptr, s.columns, s.values, bias, R)
    if x.dtype == torch.bfloat16 and _k.pairs_when_widened(w.values, w.n, w.m):
        b = None if bias is None else bias.float()
        return _k.spmm(x.float(), _plan(w, "forward_widened"), b, R).to(torch.bfloat16)
    return _k.spmm(x, _plan(w, "forward"), bias, R)


def _check_input(x: Tensor, w: GroupedNM, bias: Optional[Tensor]) -> None:
    R, K = w.shape
    if x.dim() == 0 or x.shape[-1] != K:
        raise ValueError(
            f"linear: input has shape {tuple(x.shape)} but the GroupedNM weight of shape {(R, K)} "
            f"expects a last dimension of {K}"
        )
    if bias is not None and tuple(bias.shape) != (R,):
        raise ValueError(f"linear: bias must have shape ({R},), got {tuple(bias.shape)}")


@implements("linear", (Dense, GroupedNM, Dense), replace=True)
class GroupedNMLinear:
    """``y = x @ W.T + b`` for a :class:`~sparsa.layouts.GroupedNM` weight."""

    @staticmethod
    def forward(ctx, x: Tensor, w: GroupedNM, bias: Optional[Tensor] = None) -> Tensor:
        _check_input(x, w, bias)
        if is_fake(w.values) or is_fake(x):
            # the kernel plans are built from the weight's tensors, which torch.compile traces as fakes:
            # a graph break (dynamo's answer to a data-dependent op) runs this layer eagerly instead
            raise DataDependentOutputException(torch.ops.aten.linear.default)
        y = _forward(x, w, bias)
        ctx.save_for_backward(x)
        ctx.w = w
        return y

    @staticmethod
    def backward(ctx, gy: Tensor):
        (x,) = ctx.saved_tensors
        w: GroupedNM = ctx.w
        nx, nw, nb = (tuple(ctx.needs_input_grad) + (False,) * 3)[:3]
        R, K = w.shape
        g2 = gy.reshape(-1, R)
        gx = gw = gb = None
        if nx:
            gx = _k.spmm(g2, _plan(w, "input_grad"), None, K).reshape(x.shape)
        if nw:
            gw = _grad_weight(w, g2, x.reshape(-1, K))
        if nb:
            gb = g2.sum(0)
        return gx, gw, gb


def _grad_weight(w: GroupedNM, g2: Tensor, x2: Tensor) -> Tensor:
    """``grad_y.T @ x`` on the stored entries only, as a dense ``(R, K)`` tensor zero elsewhere."""
    # above the crossover density (n/m) dense BLAS then masking beats the sddmm kernel
    if w.n / w.m > crossover("grouped_nm.grad_weight"):
        return _grad_weight_dense(w, g2, x2)
    return _grad_weight_sparse(w, g2, x2)


def _grad_weight_dense(w: GroupedNM, g2: Tensor, x2: Tensor) -> Tensor:
    dtype = torch.promote_types(g2.dtype, x2.dtype)
    return (g2.to(dtype).t() @ x2.to(dtype)) * w.mask()


def _grad_weight_sparse(w: GroupedNM, g2: Tensor, x2: Tensor) -> Tensor:
    B, C, P, g, n = w.values.shape
    dtype = torch.promote_types(g2.dtype, x2.dtype)
    gv = _k.sddmm(x2.to(dtype), g2.to(dtype), _plan(w, "pattern"))  # (B*P, C*g, n)
    gv = gv.view(B, P, C, g, n).permute(0, 2, 1, 3, 4).contiguous()
    return w._scatter(gv)
