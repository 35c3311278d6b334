"""The dispatcher: route a torch call with sparse arguments to an implementation.

Order: exact registered implementation for the argument layouts; else the cheapest registered
conversion of the sparse arguments to layouts that have one; else dense fallback (convert, run the
dense op; gradients flow back to the sparse tensors). The fallback warns once per (op, layouts) and
is counted: :func:`fallback_counts`; in strict mode (:func:`sparsa.strict`) it raises instead. Plans
are cached per (op, layouts, needs-grad). Under ``torch.autocast`` the operands of autocast's ops are
cast first (:mod:`sparsa.ops.autocast`).
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..layouts.base import Layout, conversion_path
from ..layouts.dense import Dense
from ..tensor_base import SparseTensorBase
from . import registry
from .autocast import AUTOCAST_OPS, FLOAT32_LAYOUTS, autocast_dtype, run_under_autocast
from .op_table import OpCall, TORCH_FNS
from .strict import fallback_error, is_strict

__all__ = ["fallback_counts", "reset_fallback_counts", "SparseFallbackWarning", "dispatch", "dispatch_aten", "explain"]


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
        raise fallback_error(op, layout_names, registrable=op in registry.OPS, torch_fn=_torch_name(op))
    key = (op, layout_names)
    _COUNTS[key] += 1
    if warn and key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(
            f"sparsa: no sparse implementation of {op!r} for layouts {layout_names}; running it "
            "densely (see sparsa.fallback_counts(); register one with sparsa.ops.implements)",
            SparseFallbackWarning,
            stacklevel=4,
        )


#: torch callable -> OpCall (defined in :mod:`.op_table`); kept under its old name
OP_TABLE = TORCH_FNS


def _torch_name(op: str) -> Optional[str]:
    """``"torch.sin"`` for ``"aten.sin"`` where that torch function exists (to name in errors)."""
    name = op[5:] if op.startswith("aten.") else None
    return f"torch.{name}" if name and callable(getattr(torch, name, None)) else None


# ----------------------------------------------------------------------------- planning
def _layout_of(a: Any) -> type:
    return type(a._layout) if isinstance(a, SparseTensorBase) else Dense


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


def explain(op: Any, *layouts: type, needs_grad: bool = False) -> str:
    """Describe what the dispatcher does for ``op`` (a name or a torch function) on ``layouts``."""
    if not isinstance(op, str):
        call = TORCH_FNS.get(op)
        op = call.name if call is not None else getattr(op, "__name__", repr(op))
    if op not in registry.OPS:
        return f"{op}: not a dispatchable op; runs densely (dense fallback at the aten level)"
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


#: layout class -> whether it is Dense: a dict lookup is much cheaper than ``isinstance`` on the
#: ``Layout`` ABC, which every dispatched call would pay per argument
_IS_DENSE: Dict[type, bool] = {}


def _is_dense(lay: Layout) -> bool:
    t = type(lay)
    d = _IS_DENSE.get(t)
    if d is None:
        d = _IS_DENSE[t] = issubclass(t, Dense)
    return d


def _unwrap(a: Any, conv: Optional[Tuple[Callable, ...]]) -> Any:
    if isinstance(a, SparseTensorBase):
        lay = a._layout
        if conv:
            for fn in conv:
                lay = fn(lay)
        return lay.values if _is_dense(lay) else lay
    return a


def _unwrap_all(targs: Sequence[Any], convs: Optional[Tuple[Tuple[Callable, ...], ...]]) -> list:
    """The arguments an implementation receives: layouts (converted per ``convs``) and plain values."""
    return [_unwrap(a, convs[i] if convs else None) for i, a in enumerate(targs)]


def _wrap(cls: type, out: Any) -> Any:
    if isinstance(out, Tensor):  # the common case, checked before the Layout ABC
        return out
    if isinstance(out, Layout):
        return out.values if _is_dense(out) else cls(out)
    if isinstance(out, tuple):
        return tuple(_wrap(cls, o) for o in out)
    return out


class _Run(torch.autograd.Function):
    # ``spec`` = (cls, impl, conversions, rest, uargs) in one argument: autograd inspects each argument of
    # apply. ``uargs``: the implementation's arguments when the dispatcher already unwrapped them, else None.
    @staticmethod
    def forward(ctx, spec, *targs):  # type: ignore[override]
        cls, impl, convs, rest, uargs = spec
        ctx.impl = impl
        ctx.needs_input_grad = ctx.needs_input_grad[1:]  # per tensor argument, what implementations read
        out = impl.forward(ctx, *(uargs if uargs is not None else _unwrap_all(targs, convs)), **rest)
        return out if type(out) is Tensor else _wrap(cls, out)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        grads = tuple(g._layout.to_dense() if isinstance(g, SparseTensorBase) else g for g in grads)
        gin = ctx.impl.backward(ctx, *grads)
        if not isinstance(gin, tuple):
            gin = (gin,)
        return (None,) + tuple(gin)


# ``_Run.apply`` is ``Function.apply``: a Python wrapper (signature binding checks, functorch hand-off) around
# this C entry point. Outside functorch transforms and tracing, the wrapper only unwraps dead functorch wrappers, which
# :func:`dispatch` does itself; skipping the wrapper is a large part of a training call's dispatch cost.
_run_apply_c = super(torch.autograd.Function, _Run).apply
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
_functorch_active = torch._C._are_functorch_transforms_active


def _plan(op: str, layouts: Tuple[type, ...], needs_grad: bool) -> _Plan:
    key = (op, layouts, needs_grad)
    plan = _PLANS.get(key)
    if plan is None or plan.version != registry._VERSION[0]:
        plan = _PLANS[key] = _make_plan(op, layouts, needs_grad)
    return plan


def dispatch(cls: type, call: OpCall, func: Callable, args: tuple, kwargs: dict) -> Any:
    """Run ``func(*args, **kwargs)`` (a torch-function call with a sparse argument) through the
    dispatcher; sparse outputs are built as ``cls`` (the SparseTensor class the call came through)."""
    norm = call.normalize(args, kwargs)
    if norm is None:  # an in-place variant (relu(inplace=True)): computed on a dense copy
        lays = tuple(a.layout_name for a in args if isinstance(a, SparseTensorBase))
        if lays:
            record_fallback(f"{call.name} (in-place)", lays)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*_densify(args), **_densify(kwargs))
    targs, rest = norm
    # One pass over the arguments. Property reads on a SparseTensor would re-enter __torch_function__:
    # a few microseconds each, on every call of a decode loop.
    grad = torch.is_grad_enabled()
    needs_grad = empty = False
    dtype = None
    mixed = False
    device_type = None
    layouts = []
    # in the same pass: what an implementation that converts nothing receives (``uargs``), and what
    # autograd's apply receives (``aargs``: dead functorch wrappers unwrapped, as Function.apply does)
    uargs, aargs = [], []
    with torch._C.DisableTorchFunctionSubclass():
        for a in targs:
            if isinstance(a, Tensor):
                if grad and a.requires_grad:
                    needs_grad = True
                if isinstance(a, SparseTensorBase):
                    lay = a._layout
                    t = type(lay)
                    layouts.append(t)
                    d = _IS_DENSE.get(t)
                    uargs.append(lay.values if (d if d is not None else _is_dense(lay)) else lay)
                    aargs.append(a)
                    if a.numel() == 0:
                        empty = True
                else:
                    layouts.append(Dense)
                    a = _unwrap_if_dead(a)
                    uargs.append(a)
                    aargs.append(a)
                if dtype is None:
                    dtype = a.dtype
                    device_type = "cpu" if a.is_cpu else a.device.type
                elif a.dtype != dtype:
                    mixed = True
            else:
                layouts.append(Dense)
                uargs.append(a)
                aargs.append(a)
    if device_type is not None and call.name in AUTOCAST_OPS:
        ac = autocast_dtype(device_type)
        # cast when a float32 operand is there to cast, or a layout computes in float32 only
        if ac is not None and (mixed or dtype == torch.float32 or any(t.name in FLOAT32_LAYOUTS for t in layouts)):
            return run_under_autocast(func, args, kwargs, device_type, ac)
    if mixed and call.same_dtype:
        with torch._C.DisableTorchFunctionSubclass():
            _check_dtypes(call, targs)
    if empty:  # nothing to compute (and not a fallback to count): the dense op handles zero-size shapes
        return _dense_call(call, func, args, kwargs, targs, rest)
    layouts = tuple(layouts)
    plan = _PLANS.get((call.name, layouts, needs_grad))
    if plan is None or plan.version != registry._VERSION[0]:
        plan = _plan(call.name, layouts, needs_grad)
    if plan.fallback:
        record_fallback(call.name, tuple(l.name for l in layouts))
        return _dense_call(call, func, args, kwargs, targs, rest)
    convs = plan.conversions
    if convs is not None:
        uargs = None  # the implementation's arguments are converted layouts: built where it runs
    if needs_grad:
        if _functorch_active() or torch.compiler.is_compiling():
            return _Run.apply((cls, plan.impl, convs, rest, None), *targs)  # what functorch and dynamo handle
        return _run_apply_c((cls, plan.impl, convs, rest, uargs), *aargs)
    out = plan.impl.forward(_Ctx(), *(uargs if uargs is not None else _unwrap_all(targs, convs)), **rest)
    return out if type(out) is Tensor else _wrap(cls, out)


def _dense_call(call: OpCall, func: Callable, args: tuple, kwargs: dict, targs: list, rest: dict) -> Any:
    if call.dense is None:  # an op derived from a torch function: that function is its dense form
        with torch._C.DisableTorchFunctionSubclass():
            return func(*_densify(args), **_densify(kwargs))
    return call.dense([a.to_dense() if isinstance(a, SparseTensorBase) else a for a in targs], rest)


#: what :func:`dispatch_aten` returns when no implementation applies (the caller falls back)
NO_IMPL = object()


def dispatch_aten(cls: type, call: OpCall, args: tuple, kwargs: dict) -> Any:
    """Run an aten op that reached ``__torch_dispatch__`` with a registered implementation, forward
    only (autograd is above this level); :data:`NO_IMPL` if none applies."""
    targs, rest = call.normalize(args, kwargs)
    if any(isinstance(a, SparseTensorBase) and a.numel() == 0 for a in targs):
        return NO_IMPL
    plan = _plan(call.name, tuple(_layout_of(a) for a in targs), False)
    if plan.fallback:
        return NO_IMPL
    if call.same_dtype:
        _check_dtypes(call, targs)
    uargs = _unwrap_all(targs, plan.conversions)
    with torch.no_grad():
        return _wrap(cls, plan.impl.forward(_Ctx(), *uargs, **rest))


def _check_dtypes(call: OpCall, targs: List[Any]) -> None:
    dts = [a.dtype for a in targs if isinstance(a, Tensor)]
    if len(set(dts)) > 1:
        desc = ", ".join(f"{n}={a.dtype}" for n, a in zip(call.arg_names, targs) if isinstance(a, Tensor))
        raise TypeError(
            f"{call.name}: all tensor arguments must have the same dtype, got {desc}; convert one of "
            f"them (e.g. x.to(weight.dtype))"
        )


def _densify(x: Any) -> Any:
    if isinstance(x, SparseTensorBase):
        return x.to_dense()
    if isinstance(x, (list, tuple)):
        return type(x)(_densify(v) for v in x)
    if isinstance(x, dict):
        return {k: _densify(v) for k, v in x.items()}
    return x
