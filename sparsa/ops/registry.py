"""Operator registry: which implementation runs an op for given input layouts.

An *implementation* is a class (or function) with ``forward(ctx, *args)`` and optionally
``backward(ctx, *grad_outputs)``, registered for an op name and one layout per tensor argument
(``None`` or :class:`~sparsa.layouts.Dense` for plain tensors, absent optionals and scalars). In
``forward``, sparse arguments arrive as :class:`~sparsa.layouts.base.Layout` instances and dense ones
as tensors; it may return a tensor or a layout (wrapped into a :class:`~sparsa.SparseTensor`).
``backward`` returns one gradient per tensor argument (dense tensors; ``None`` where not needed; read
``ctx.needs_input_grad``). An implementation without ``backward`` is only used when no gradient is
required; otherwise the dispatcher looks further (conversion, then dense fallback).

Example (a relu for a layout of your own; built-in registrations are left alone)::

    >>> import torch, sparsa
    >>> from sparsa.layouts import Masked, register_layout
    >>> @register_layout
    ... class MyMasked(Masked):
    ...     name = "doc_my_masked"
    >>> @sparsa.ops.implements("relu", (MyMasked,), replace=True)
    ... class MyMaskedRelu:
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         ctx.save_for_backward(x.values)
    ...         return MyMasked(torch.relu(x.values), x.mask() & (x.values > 0), validate=False)
    ...     @staticmethod
    ...     def backward(ctx, g):
    ...         (v,) = ctx.saved_tensors
    ...         return g * (v > 0)
    >>> torch.relu(sparsa.to_sparse(torch.tensor([-1.0, 2.0]), MyMasked)).layout_name
    'doc_my_masked'
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Tuple

from ..layouts.base import Layout
from ..layouts.dense import Dense

__all__ = ["Impl", "implements", "register_impl", "register_device_impl", "registered_impls", "OPS"]

#: op name -> number of tensor arguments it dispatches on
OPS: Dict[str, int] = {
    "linear": 3, "matmul": 2, "mm": 2, "bmm": 2, "addmm": 3,
    "add": 2, "mul": 2, "relu": 1, "conv2d": 3,
}


@dataclass(frozen=True)
class Impl:
    op: str
    layouts: Tuple[type, ...]
    forward: Callable[..., Any]
    backward: Optional[Callable[..., Any]]
    name: str

    @property
    def has_backward(self) -> bool:
        return self.backward is not None


_IMPLS: Dict[Tuple[str, Tuple[type, ...]], Impl] = {}
_VERSION = [0]  # bumped on every registration; invalidates dispatch caches


def _norm_layouts(op: str, layouts: Iterable[Optional[type]]) -> Tuple[type, ...]:
    out = []
    for lay in layouts:
        if lay is None:
            lay = Dense
        if not (isinstance(lay, type) and issubclass(lay, Layout)):
            raise TypeError(f"layouts for op {op!r} must be Layout classes or None, got {lay!r}")
        out.append(lay)
    n = OPS[op]
    if len(out) > n:
        raise ValueError(f"op {op!r} takes {n} tensor arguments, got {len(out)} layouts")
    out += [Dense] * (n - len(out))
    return tuple(out)


def register_impl(op: str, layouts: Sequence[Optional[type]], forward: Callable, backward: Optional[Callable] = None,
                  *, replace: bool = False, name: Optional[str] = None) -> Impl:
    """Register ``forward``/``backward`` for ``op`` on ``layouts``; duplicates are an error unless ``replace``."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; dispatchable ops: {sorted(OPS)}")
    key = (op, _norm_layouts(op, layouts))
    if key in _IMPLS and not replace:
        raise ValueError(f"an implementation of {op!r} for layouts {[l.name for l in key[1]]} is already "
                         f"registered ({_IMPLS[key].name}); pass replace=True to replace it")
    impl = Impl(op, key[1], forward, backward, name or getattr(forward, "__qualname__", str(forward)))
    _IMPLS[key] = impl
    _VERSION[0] += 1
    return impl


def implements(op: str, layouts: Sequence[Optional[type]], *, replace: bool = False):
    """Decorator form of :func:`register_impl` for a class with ``forward``/``backward`` static methods
    (or a plain forward function)."""
    def deco(obj: Any) -> Any:
        if isinstance(obj, type):
            fwd = getattr(obj, "forward")
            bwd = getattr(obj, "backward", None)
            name = obj.__qualname__
        else:
            fwd, bwd, name = obj, None, getattr(obj, "__qualname__", str(obj))
        register_impl(op, layouts, fwd, bwd, replace=replace, name=name)
        return obj
    return deco


_DEVICE_IMPLS: Dict[Tuple[str, Tuple[type, ...]], list] = {}


def register_device_impl(op: str, layouts: Sequence[Optional[type]], forward: Callable,
                         backward: Optional[Callable] = None, *, applies: Callable[..., bool],
                         name: Optional[str] = None) -> Impl:
    """Register an implementation preferred wherever ``applies(*args, **rest)`` is true (e.g. tensors on
    a GPU). Elsewhere the plain implementation for the same layouts runs (this one if there is none, so
    it must be correct on every device). Tried in registration order; the same name replaces itself."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; dispatchable ops: {sorted(OPS)}")
    key = (op, _norm_layouts(op, layouts))
    impl = Impl(op, key[1], forward, backward, name or getattr(forward, "__qualname__", str(forward)))
    routes = _DEVICE_IMPLS.setdefault(key, [])
    routes[:] = [r for r in routes if r[1].name != impl.name] + [(applies, impl)]
    _VERSION[0] += 1
    return impl


def _routed(key: Tuple[str, Tuple[type, ...]], base: Optional[Impl]) -> Impl:
    routes = tuple(_DEVICE_IMPLS[key])
    last = base or routes[-1][1]

    def forward(ctx: Any, *args: Any, **rest: Any) -> Any:
        ctx.sparsa_impl = next((i for ok, i in routes if ok(*args, **rest)), last)
        return ctx.sparsa_impl.forward(ctx, *args, **rest)

    def backward(ctx: Any, *grads: Any) -> Any:
        return ctx.sparsa_impl.backward(ctx, *grads)

    bwd = backward if last.has_backward and all(i.has_backward for _, i in routes) else None
    return Impl(key[0], key[1], forward, bwd, " | ".join([i.name for _, i in routes] + [last.name]))


def registered_impls(op: Optional[str] = None) -> Dict[Tuple[str, Tuple[str, ...]], str]:
    """Readable table of registered implementations: (op, layout names) -> implementation name."""
    return {(k[0], tuple(l.name for l in k[1])): v.name for k, v in _IMPLS.items() if op in (None, k[0])}


def lookup(op: str, layouts: Tuple[type, ...]) -> Optional[Impl]:
    base = _IMPLS.get((op, layouts))
    return _routed((op, layouts), base) if (op, layouts) in _DEVICE_IMPLS else base


def impls_for(op: str) -> Iterable[Impl]:
    keys = dict.fromkeys(k for k in [*_IMPLS, *_DEVICE_IMPLS] if k[0] == op)
    return [lookup(*k) for k in keys]
