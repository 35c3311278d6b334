"""The dispatcher: route a torch call with sparse arguments to an implementation.

Order: exact registered implementation for the argument layouts; else the cheapest registered
conversion of the sparse arguments to layouts that have one; else dense fallback (convert, run the
dense op; gradients flow back to the sparse tensors). The fallback warns once per (op, layouts) and
is counted: :func:`fallback_counts`; in strict mode (:func:`sparsa.strict`) it raises instead. Plans
are cached per (op, layouts, needs-grad).
"""
from __future__ import annotations

import sys
import warnings
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..layouts.base import Layout, conversion_path
from ..layouts.dense import Dense
from .. import tensor as _tensor
from ..tensor import SparseTensor
from . import registry
from .strict import fallback_error, is_strict

__all__ = ["fallback_counts", "reset_fallback_counts", "SparseFallbackWarning", "dispatch", "explain"]


class SparseFallbackWarning(UserWarning):
    """An op on a sparse tensor ran densely because no sparse implementation matched."""


_COUNTS: Counter = Counter()
_WARNED: set = set()


def fallback_counts() -> Dict[Tuple[str, Tuple[str, ...]], int]:
    """How often each (op, argument layouts) ran through the dense fallback since the last reset."""
    return dict(_COUNTS)


def reset_fallback_counts() -> None:
    _COUNTS.clear()
    _WARNED.clear()


def record_fallback(op: str, layout_names: Tuple[str, ...], warn: bool = True) -> None:
    """Count (and warn once about) a dense fallback about to run; in strict mode raise instead, with
    the counters left unchanged."""
    if is_strict():
        raise fallback_error(op, layout_names, registrable=op in registry.OPS)
    key = (op, layout_names)
    _COUNTS[key] += 1
    if warn and key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"sparsa: no sparse implementation of {op!r} for layouts {layout_names}; running it "
                      "densely (see sparsa.fallback_counts(); register one with sparsa.ops.implements)",
                      SparseFallbackWarning, stacklevel=4)


# ----------------------------------------------------------------------------- argument normalisation
# Each normaliser maps (args, kwargs) -> (tensor_args list, rest) and a rebuild to call the dense op.
def _n_linear(a, k):
    x = a[0] if len(a) > 0 else k.get("input")
    w = a[1] if len(a) > 1 else k.get("weight")
    b = a[2] if len(a) > 2 else k.get("bias")
    return [x, w, b], {}


def _n_two(names):
    def n(a, k):
        t = list(a[:2]) + [k.get(nm) for nm in names[len(a):2]]
        rest = {kk: v for kk, v in k.items() if kk not in names}
        return t, rest
    return n


def _n_addmm(a, k):
    t = list(a[:3]) + [k.get(nm) for nm in ("input", "mat1", "mat2")[len(a):3]]
    rest = {"beta": k.get("beta", 1), "alpha": k.get("alpha", 1)}
    return t, rest


def _n_add(a, k):
    t = [a[0] if a else k.get("input"), a[1] if len(a) > 1 else k.get("other")]
    rest = {"alpha": a[2] if len(a) > 2 else k.get("alpha", 1)}
    return t, rest


def _n_mul(a, k):
    return [a[0] if a else k.get("input"), a[1] if len(a) > 1 else k.get("other")], {}


def _n_relu(a, k):
    if len(a) > 1 and a[1]:
        return None  # in-place relu: not dispatched
    if k.get("inplace"):
        return None
    return [a[0] if a else k.get("input")], {}


def _n_conv2d(a, k):
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    vals = list(a) + [k.get(nm, d) for nm, d in zip(names[len(a):], (None, None, None, 1, 0, 1, 1)[len(a):])]
    return vals[:3], dict(zip(names[3:], vals[3:]))


def _swap(n):
    def s(a, k):
        r = n(a, k)
        if r is None:
            return None
        t, rest = r
        return [t[1], t[0]] + t[2:], rest
    return s


class OpCall:
    __slots__ = ("name", "normalize", "dense")

    def __init__(self, name: str, normalize: Callable, dense: Callable):
        self.name, self.normalize, self.dense = name, normalize, dense


def _dense_linear(t, r):
    return F.linear(t[0], t[1], t[2])


def _dense_add(t, r):
    return torch.add(t[0], t[1], alpha=r.get("alpha", 1))


def _dense_conv2d(t, r):
    return F.conv2d(t[0], t[1], t[2], **r)


_CALLS = {
    "linear": OpCall("linear", _n_linear, _dense_linear),
    "matmul": OpCall("matmul", _n_two(("input", "other")), lambda t, r: torch.matmul(t[0], t[1])),
    "mm": OpCall("mm", _n_two(("input", "mat2")), lambda t, r: torch.mm(t[0], t[1])),
    "bmm": OpCall("bmm", _n_two(("input", "mat2")), lambda t, r: torch.bmm(t[0], t[1])),
    "addmm": OpCall("addmm", _n_addmm, lambda t, r: torch.addmm(t[0], t[1], t[2], **r)),
    "add": OpCall("add", _n_add, _dense_add),
    "mul": OpCall("mul", _n_mul, lambda t, r: torch.mul(t[0], t[1])),
    "relu": OpCall("relu", _n_relu, lambda t, r: torch.relu(t[0])),
    "conv2d": OpCall("conv2d", _n_conv2d, _dense_conv2d),
}

#: torch callable -> OpCall; the keys are what __torch_function__ receives
OP_TABLE: Dict[Callable, OpCall] = {
    F.linear: _CALLS["linear"],
    torch.matmul: _CALLS["matmul"], Tensor.matmul: _CALLS["matmul"], Tensor.__matmul__: _CALLS["matmul"],
    Tensor.__rmatmul__: OpCall("matmul", _swap(_n_two(("input", "other"))), _CALLS["matmul"].dense),
    torch.mm: _CALLS["mm"], Tensor.mm: _CALLS["mm"],
    torch.bmm: _CALLS["bmm"], Tensor.bmm: _CALLS["bmm"],
    torch.addmm: _CALLS["addmm"], Tensor.addmm: _CALLS["addmm"],
    torch.add: _CALLS["add"], Tensor.add: _CALLS["add"], Tensor.__add__: _CALLS["add"],
    Tensor.__radd__: OpCall("add", _swap(_n_mul), lambda t, r: torch.add(t[0], t[1])),
    torch.mul: _CALLS["mul"], Tensor.mul: _CALLS["mul"], Tensor.__mul__: _CALLS["mul"],
    Tensor.__rmul__: OpCall("mul", _swap(_n_mul), _CALLS["mul"].dense),
    torch.relu: _CALLS["relu"], F.relu: _CALLS["relu"], Tensor.relu: _CALLS["relu"],
    F.conv2d: _CALLS["conv2d"],
}


# ----------------------------------------------------------------------------- planning
def _layout_of(a: Any) -> type:
    return type(a._layout) if isinstance(a, SparseTensor) else Dense


class _Plan:
    __slots__ = ("impl", "conversions", "fallback", "version")

    def __init__(self, impl, conversions, fallback, version):
        self.impl, self.conversions, self.fallback, self.version = impl, conversions, fallback, version


_PLANS: Dict[Tuple[str, Tuple[type, ...], bool], _Plan] = {}


def _make_plan(op: str, layouts: Tuple[type, ...], needs_grad: bool) -> _Plan:
    ver = registry._VERSION[0]
    impl = registry.lookup(op, layouts)
    if impl is not None and (impl.has_backward or not needs_grad):
        return _Plan(impl, None, False, ver)
    best: Optional[Tuple[float, registry.Impl, List[Optional[Tuple[Callable, ...]]]]] = None
    for cand in registry.impls_for(op):
        if needs_grad and not cand.has_backward:
            continue
        total, convs, ok = 0.0, [], True
        for have, want in zip(layouts, cand.layouts):
            if have is want:
                convs.append(None)
                continue
            if have is Dense:  # never sparsify a dense argument implicitly
                ok = False
                break
            p = conversion_path(have, want)
            if p is None:
                ok = False
                break
            total += p[0]
            convs.append(p[1])
        if ok and (best is None or total < best[0]):
            best = (total, cand, convs)
    if best is not None:
        return _Plan(best[1], best[2], False, ver)
    return _Plan(None, None, True, ver)


def explain(op: str, *layouts: type, needs_grad: bool = False) -> str:
    """Describe what the dispatcher does for ``op`` on ``layouts`` (for debugging)."""
    lay = registry._norm_layouts(op, layouts)
    p = _make_plan(op, lay, needs_grad)
    if p.fallback:
        return f"{op}{tuple(l.name for l in lay)}: dense fallback"
    via = "" if p.conversions is None else " after conversion"
    return f"{op}{tuple(l.name for l in lay)}: {p.impl.name}{via}"


# ----------------------------------------------------------------------------- execution
class _Ctx:
    """Context passed to forward when no gradient is recorded."""
    needs_input_grad: Tuple[bool, ...] = ()

    def save_for_backward(self, *t: Any) -> None:
        pass

    def mark_non_differentiable(self, *t: Any) -> None:
        pass


def _unwrap(a: Any, conv: Optional[Tuple[Callable, ...]]) -> Any:
    if isinstance(a, SparseTensor):
        lay = a._layout
        if conv:
            for fn in conv:
                lay = fn(lay)
        if isinstance(lay, Dense):
            return lay.values
        return lay
    return a


def _wrap(out: Any) -> Any:
    if isinstance(out, Layout):
        return out.values if isinstance(out, Dense) else SparseTensor(out)
    if isinstance(out, tuple):
        return tuple(_wrap(o) for o in out)
    return out


class _Run(torch.autograd.Function):
    @staticmethod
    def forward(ctx, impl, convs, rest, *targs):  # type: ignore[override]
        ctx.impl = impl
        ctx.needs_input_grad = ctx.needs_input_grad[3:]  # per tensor argument, what implementations read
        args = [_unwrap(a, convs[i] if convs else None) for i, a in enumerate(targs)]
        return _wrap(impl.forward(ctx, *args, **rest))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        grads = tuple(g._layout.to_dense() if isinstance(g, SparseTensor) else g for g in grads)
        gin = ctx.impl.backward(ctx, *grads)
        if not isinstance(gin, tuple):
            gin = (gin,)
        return (None, None, None) + tuple(gin)


def dispatch(call: OpCall, func: Callable, args: tuple, kwargs: dict) -> Any:
    norm = call.normalize(args, kwargs)
    if norm is None:  # an in-place variant (relu(inplace=True)): computed on a dense copy
        lays = tuple(a.layout_name for a in args if isinstance(a, SparseTensor))
        if lays:
            record_fallback(f"{call.name} (in-place)", lays)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*_densify(args), **_densify(kwargs))
    targs, rest = norm
    # property reads on a SparseTensor would re-enter __torch_function__: a few microseconds each, on
    # every call of a decode loop
    with torch._C.DisableTorchFunctionSubclass():
        if call.name in _SAME_DTYPE:
            _check_dtypes(call.name, targs)
        needs_grad = torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in targs)
        empty = any(isinstance(a, SparseTensor) and a.numel() == 0 for a in targs)
    if empty:  # nothing to compute (and not a fallback to count): the dense op handles zero-size shapes
        return call.dense([a.to_dense() if isinstance(a, SparseTensor) else a for a in targs], rest)
    layouts = tuple(_layout_of(a) for a in targs)
    key = (call.name, layouts, needs_grad)
    plan = _PLANS.get(key)
    if plan is None or plan.version != registry._VERSION[0]:
        plan = _PLANS[key] = _make_plan(call.name, layouts, needs_grad)
    if plan.fallback:
        record_fallback(call.name, tuple(l.name for l in layouts))
        dense = [a.to_dense() if isinstance(a, SparseTensor) else a for a in targs]
        return call.dense(dense, rest)
    if needs_grad:
        return _Run.apply(plan.impl, plan.conversions, rest, *targs)
    convs = plan.conversions
    uargs = [_unwrap(a, convs[i] if convs else None) for i, a in enumerate(targs)]
    return _wrap(plan.impl.forward(_Ctx(), *uargs, **rest))


_SAME_DTYPE = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "conv2d"})
_ARG_NAMES = {"linear": ("input", "weight", "bias"), "addmm": ("input", "mat1", "mat2"),
              "conv2d": ("input", "weight", "bias")}


def _check_dtypes(op: str, targs: List[Any]) -> None:
    dts = [a.dtype for a in targs if isinstance(a, Tensor)]
    if len(set(dts)) > 1:
        names = _ARG_NAMES.get(op, ("input", "other"))
        desc = ", ".join(f"{n}={a.dtype}" for n, a in zip(names, targs) if isinstance(a, Tensor))
        raise TypeError(f"{op}: all tensor arguments must have the same dtype, got {desc}; convert one of them "
                        f"(e.g. x.to(weight.dtype))")


def _densify(x: Any) -> Any:
    if isinstance(x, SparseTensor):
        return x.to_dense()
    if isinstance(x, (list, tuple)):
        return type(x)(_densify(v) for v in x)
    if isinstance(x, dict):
        return {k: _densify(v) for k, v in x.items()}
    return x


_tensor._DISPATCH[:] = [sys.modules[__name__]]  # SparseTensor.__torch_function__ calls dispatch() here
