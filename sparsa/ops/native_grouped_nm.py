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


def _twin_rows(w: GroupedNM) -> bool:
    # the sliced_ell VDPBF16PS rows beat the grouped pieces (fp32 FMAs) on every grouped pattern measured
    return w.values.dtype == torch.bfloat16 and _se.has_dpbf16()


def _path(x: Tensor, w: GroupedNM) -> str:
    """The forward an eager call runs: ``twin`` (the SlicedELL twin's bf16 rows, from two tokens up),
    ``forward_widened`` (a bf16 input widened to run the fp32 block-pair plan) or ``forward``."""
    if x.dtype == torch.bfloat16 and _twin_rows(w) and x.numel() > x.shape[-1]:
        return "twin"
    if x.dtype == torch.bfloat16 and _k.pairs_when_widened(w.values, w.n, w.m):
        return "forward_widened"
    return "forward"


def _run(path: str, x: Tensor, w: GroupedNM, bias: Optional[Tensor], twin: tuple, plan) -> Tensor:
    """The forward of ``path`` on the twin's ``(slice_ptr, columns, values)`` or on the plan."""
    R = w.shape[0]
    if path == "twin":
        return _se.sliced_ell_linear_kernel(x, *twin, bias, R)
    if path == "forward_widened":
        b = None if bias is None else bias.float()
        return _k.spmm(x.float(), plan, b, R).to(torch.bfloat16)
    return _k.spmm(x, plan, bias, R)


def _forward(x: Tensor, w: GroupedNM, bias: Optional[Tensor]) -> Tensor:
    path = _path(x, w)
    if path == "twin":
        s = _sliced_ell_twin(w)
        return _run(path, x, w, bias, (s.slice_ptr, s.columns, s.values), None)
    return _run(path, x, w, bias, (), _plan(w, path))


# ------------------------------------------------------------------------------ under torch.compile
# A compiled graph sees the weight's components as fakes, from which no plan can be built. The forward's
# plan tensors (or its SlicedELL twin's) therefore travel beside the components as derived tensors
# (Layout.derived_components): the graph takes them as inputs and calls the kernel ops on them, the
# plan's integer fields recomputed from the values' shape. One forward per weight dtype: a bf16 weight
# runs the twin's rows (where the CPU has them) for every token count, single tokens included. A graph that
# may train also takes the backward's plans (input gradient, and the pattern plan of the weight gradient).
_DERIVED = "compiled_forward"  # the _cache key of derived tensors a layout adopted


def _compiled_path(w: GroupedNM) -> str:
    if _twin_rows(w):
        return "twin"
    return "forward_widened" if _k.pairs_when_widened(w.values, w.n, w.m) else "forward"


class _Derivation:
    """``GroupedNM.derivation``: the compiled forward's tensors of a weight, and their adoption."""

    TWIN = ("twin_slice_ptr", "twin_columns", "twin_values")
    PLAN = ("plan_idx", "plan_vals", "plan_out_rows")
    INPUT_GRAD = ("igrad_idx", "igrad_vals", "igrad_out_rows")
    PATTERN = ("pattern_idx", "pattern_out_rows")

    @staticmethod
    def derive(w: GroupedNM) -> dict:
        adopted = w._cache.get(_DERIVED)
        if adopted is not None:  # a layout rebuilt from a graph's inputs (fakes: nothing can be built)
            return adopted
        path = _compiled_path(w)
        if path == "twin":
            s = _sliced_ell_twin(w)
            out = dict(zip(_Derivation.TWIN, (s.slice_ptr, s.columns, s.values)))
        else:
            p = _plan(w, path)
            out = dict(zip(_Derivation.PLAN, (p.idx, p.vals, p.out_rows)))
            if p.offsets is not None:
                out["plan_offsets"] = p.offsets
        # a graph traced with grad on may differentiate the layer: the backward's plans travel too, from then on
        # for these values (the compiled forward unwraps its inputs again with grad off)
        if torch.is_grad_enabled() or "input_grad" in _plans(w):
            p = _plan(w, "input_grad")
            out.update(zip(_Derivation.INPUT_GRAD, (p.idx, p.vals, p.out_rows)))
            if _sparse_grad_weight(w):
                p = _plan(w, "pattern")
                out.update(zip(_Derivation.PATTERN, (p.idx, p.out_rows)))
        return out

    @staticmethod
    def adopt(w: GroupedNM, derived: dict) -> None:
        names = set(derived) - set(_Derivation.INPUT_GRAD) - set(_Derivation.PATTERN)
        if names not in (set(_Derivation.TWIN), set(_Derivation.PLAN), set(_Derivation.PLAN) | {"plan_offsets"}):
            raise TypeError(
                f"GroupedNM derives {list(_Derivation.TWIN)} or {list(_Derivation.PLAN)} (+ plan_offsets), "
                f"got {sorted(names)}"
            )
        w._cache[_DERIVED] = dict(derived)


GroupedNM.derivation = _Derivation


def _forward_traced(x: Tensor, w: GroupedNM, bias: Optional[Tensor], needs_grad: bool) -> Tensor:
    """The forward on fakes (torch.compile) from the adopted derived tensors. Where they are missing (or,
    in training, the backward's are), a graph break (dynamo's answer to a data-dependent op) runs the layer
    eagerly instead."""
    d = w._cache.get(_DERIVED)
    path = _compiled_path(w)
    if d is None or (needs_grad and _Derivation.INPUT_GRAD[0] not in d):
        raise DataDependentOutputException(torch.ops.aten.linear.default)
    if path == "twin":
        return _run(path, x, w, bias, tuple(d[n] for n in _Derivation.TWIN), None)
    pairs = _k._use_pairs(w.values, w.n, w.m, widened=path == "forward_widened")
    fields = _k.forward_plan_fields(tuple(w.values.shape), w.n, w.m, pairs)
    plan = _k.Plan(*(d[n] for n in _Derivation.PLAN), *fields, d.get("plan_offsets"))
    return _run(path, x, w, bias, (), plan)


def _backward_plan(w: GroupedNM, kind: str) -> _k.Plan:
    """The backward's plan ``kind`` (``input_grad`` or ``pattern``); on fakes, from the adopted derived tensors
    (the forward broke the graph where they are missing)."""
    if not is_fake(w.values):
        return _plan(w, kind)
    d = w._cache[_DERIVED]
    shape = tuple(w.values.shape)
    if kind == "input_grad":
        fields = _k.input_grad_plan_fields(shape, w.n, w.m)
        return _k.Plan(*(d[n] for n in _Derivation.INPUT_GRAD), *fields)
    idx, rows = (d[n] for n in _Derivation.PATTERN)
    # the sddmm reads the pattern plan's indices and rows only; its values stay unbuilt
    return _k.Plan(idx, idx.new_empty(0), rows, *_k.pattern_plan_fields(shape, w.m))


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
            y = _forward_traced(x, w, bias, any(getattr(ctx, "needs_input_grad", ())))
        else:
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
            gx = _k.spmm(g2, _backward_plan(w, "input_grad"), None, K).reshape(x.shape)
        if nw:
            gw = _grad_weight(w, g2, x.reshape(-1, K))
        if nb:
            gb = g2.sum(0)
        return gx, gw, gb


def _sparse_grad_weight(w: GroupedNM) -> bool:
    """Whether the weight gradient runs the sddmm kernel: at or below the crossover density (n/m); above it
    dense BLAS then masking is faster."""
    return w.n / w.m <= crossover("grouped_nm.grad_weight")


def _grad_weight(w: GroupedNM, g2: Tensor, x2: Tensor) -> Tensor:
    """``grad_y.T @ x`` on the stored entries only, as a dense ``(R, K)`` tensor zero elsewhere."""
    # a graph traced before the crossover moved has no pattern plan: the dense route then, same result
    traced_without = is_fake(w.values) and _Derivation.PATTERN[0] not in w._cache[_DERIVED]
    if _sparse_grad_weight(w) and not traced_without:
        return _grad_weight_sparse(w, g2, x2)
    return _grad_weight_dense(w, g2, x2)


def _grad_weight_dense(w: GroupedNM, g2: Tensor, x2: Tensor) -> Tensor:
    dtype = torch.promote_types(g2.dtype, x2.dtype)
    return (g2.to(dtype).t() @ x2.to(dtype)) * w.mask()


def _grad_weight_sparse(w: GroupedNM, g2: Tensor, x2: Tensor) -> Tensor:
    B, C, P, g, n = w.values.shape
    dtype = torch.promote_types(g2.dtype, x2.dtype)
    gv = _k.sddmm(x2.to(dtype), g2.to(dtype), _backward_plan(w, "pattern"))  # (B*P, C*g, n)
    gv = gv.view(B, P, C, g, n).permute(0, 2, 1, 3, 4).contiguous()
    return w._scatter(gv)
