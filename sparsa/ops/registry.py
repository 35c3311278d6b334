"""Operator registry: which implementation runs an op for given input layouts.

An *implementation* is a class (or function) with ``forward(ctx, *args)`` and optionally
``backward(ctx, *grad_outputs)``, registered for an op name and one layout per tensor argument
(``None`` or :class:`~sparsa.layouts.Dense` for plain tensors, absent optionals and scalars). In
``forward``, sparse arguments arrive as :class:`~sparsa.layouts.base.Layout` instances and dense ones
as tensors; it may return a tensor or a layout (wrapped into a :class:`~sparsa.SparseTensor`).
``backward`` returns one gradient per tensor argument (dense tensors; ``None`` where not needed; read
``ctx.needs_input_grad``). An implementation without ``backward`` is only used when no gradient is
required; otherwise the dispatcher looks further (conversion, then dense fallback).

One registration makes an implementation reachable from both levels the dispatcher sees (torch
functions and aten ops, see :mod:`.op_table`). ``op`` is a name from :data:`OPS` or a torch function;
a torch function that is not an op yet becomes one (``implements(torch.sin, (Masked,))``). Every
registration returns a :class:`Registration` handle: ``.remove()`` (or leaving its ``with`` block)
unregisters it and puts back what it replaced.

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
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from ..layouts.base import Layout
from ..layouts.dense import Dense
from . import op_table
from .op_table import OPS

__all__ = ["Impl", "Registration", "implements", "register_impl", "register_device_impl", "registered_impls", "OPS"]

OpName = Union[str, Callable[..., Any]]


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
_DEVICE_IMPLS: Dict[Tuple[str, Tuple[type, ...]], list] = {}
_VERSION = [0]  # bumped on every change of the tables above; invalidates dispatch caches


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


def _op_name(op: OpName) -> Tuple[str, bool]:
    """(op name, whether this call defined the op) for an op name or a torch function."""
    if isinstance(op, str):
        if op not in OPS:
            raise ValueError(
                f"unknown op {op!r}; dispatchable ops: {sorted(OPS)}. To make another torch "
                "function dispatchable, pass the function itself, e.g. "
                "sparsa.implements(torch.sin, (MyLayout,))"
            )
        return op, False
    if not callable(op):
        raise TypeError(f"op must be an op name or a torch function, got {op!r}")
    return op_table.op_for(op)


class Registration:
    """Handle of one registered implementation. ``remove()`` unregisters it (putting back the
    implementation it replaced, if any) and invalidates the dispatch caches; as a context manager it
    removes itself on exit. Reads through to its :class:`Impl` (``op``, ``layouts``, ``name``...)."""

    __slots__ = ("impl", "_key", "_replaced", "_device", "_defined_op", "removed")

    def __init__(self, impl: Impl, replaced: Optional[Impl], device: bool, defined_op: bool):
        self.impl, self._key, self._replaced = impl, (impl.op, impl.layouts), replaced
        self._device, self._defined_op, self.removed = device, defined_op, False

    def __getattr__(self, name: str) -> Any:
        if name == "impl":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.impl, name)

    @property
    def has_backward(self) -> bool:
        return self.impl.has_backward

    def remove(self) -> None:
        if self.removed:
            return
        self.removed = True
        if self._device:
            routes = _DEVICE_IMPLS.get(self._key, [])
            routes[:] = [r for r in routes if r[1] is not self.impl]
            if not routes:
                _DEVICE_IMPLS.pop(self._key, None)
        elif _IMPLS.get(self._key) is self.impl:  # a later replacement stays where it is
            if self._replaced is not None:
                _IMPLS[self._key] = self._replaced
            else:
                del _IMPLS[self._key]
        op = self._key[0]
        if self._defined_op and not any(k[0] == op for k in [*_IMPLS, *_DEVICE_IMPLS]):
            op_table.undefine_op(op)
        _VERSION[0] += 1

    def __enter__(self) -> "Registration":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self.removed else "active"
        return f"Registration({self.impl.op}{tuple(l.name for l in self.impl.layouts)}: {self.impl.name}, {state})"


def register_impl(
    op: OpName,
    layouts: Sequence[Optional[type]],
    forward: Callable,
    backward: Optional[Callable] = None,
    *,
    replace: bool = False,
    name: Optional[str] = None,
) -> Registration:
    """Register ``forward``/``backward`` for ``op`` (a name in :data:`OPS` or a torch function) on
    ``layouts``, at the torch-function and aten levels; duplicates are an error unless ``replace``.
    Returns the :class:`Registration` (``.remove()`` undoes it)."""
    op_name, defined = _op_name(op)
    try:
        key = (op_name, _norm_layouts(op_name, layouts))
        if key in _IMPLS and not replace:
            raise ValueError(
                f"an implementation of {op_name!r} for layouts {[l.name for l in key[1]]} is "
                f"already registered ({_IMPLS[key].name}); pass replace=True to replace it"
            )
    except Exception:
        if defined:
            op_table.undefine_op(op_name)
        raise
    impl = Impl(op_name, key[1], forward, backward, name or getattr(forward, "__qualname__", str(forward)))
    reg = Registration(impl, _IMPLS.get(key), device=False, defined_op=defined)
    _IMPLS[key] = impl
    _VERSION[0] += 1
    return reg


class implements:
    """Decorator form of :func:`register_impl` for a class with ``forward``/``backward`` static methods
    (or a plain forward function); returns the decorated object unchanged. The decorator itself is the
    handle: after decorating, ``.registration`` is the :class:`Registration` and ``.remove()`` (or the
    end of its ``with`` block) unregisters it::

        reg = sparsa.implements(torch.sin, (MyLayout,))
        reg(MySin)           # or @reg above the class
        ...
        reg.remove()
    """

    def __init__(self, op: OpName, layouts: Sequence[Optional[type]], *, replace: bool = False):
        self.op, self.layouts, self.replace = op, layouts, replace
        self.registration: Optional[Registration] = None

    def __call__(self, obj: Any) -> Any:
        if self.registration is not None and not self.registration.removed:
            raise ValueError(
                f"this implements({self.op!r}, ...) already registered "
                f"{self.registration.impl.name}; call .remove() first or make a new one"
            )
        if isinstance(obj, type):
            fwd = getattr(obj, "forward")
            bwd = getattr(obj, "backward", None)
            name = obj.__qualname__
        else:
            fwd, bwd, name = obj, None, getattr(obj, "__qualname__", str(obj))
        self.registration = register_impl(self.op, self.layouts, fwd, bwd, replace=self.replace, name=name)
        return obj

    def remove(self) -> None:
        if self.registration is None:
            raise ValueError("nothing to remove: this implements(...) has not decorated anything yet")
        self.registration.remove()

    def __enter__(self) -> "implements":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.registration is not None:
            self.registration.remove()


def register_device_impl(
    op: OpName,
    layouts: Sequence[Optional[type]],
    forward: Callable,
    backward: Optional[Callable] = None,
    *,
    applies: Callable[..., bool],
    name: Optional[str] = None,
) -> Registration:
    """Register an implementation preferred wherever ``applies(*args, **rest)`` is true (e.g. tensors on
    a GPU). Elsewhere the plain implementation for the same layouts runs (this one if there is none, so
    it must be correct on every device). Tried in registration order; the same name replaces itself."""
    op_name, defined = _op_name(op)
    key = (op_name, _norm_layouts(op_name, layouts))
    impl = Impl(op_name, key[1], forward, backward, name or getattr(forward, "__qualname__", str(forward)))
    routes = _DEVICE_IMPLS.setdefault(key, [])
    routes[:] = [r for r in routes if r[1].name != impl.name] + [(applies, impl)]
    _VERSION[0] += 1
    return Registration(impl, None, device=True, defined_op=defined)


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


def registered_impls(op: Optional[OpName] = None) -> Dict[Tuple[str, Tuple[str, ...]], str]:
    """Readable table of registered implementations: (op, layout names) -> implementation name."""
    if op is not None and not isinstance(op, str):
        call = op_table.TORCH_FNS.get(op)
        op = call.name if call is not None else getattr(op, "__name__", op)
    return {(k[0], tuple(l.name for l in k[1])): v.name for k, v in _IMPLS.items() if op in (None, k[0])}


def lookup(op: str, layouts: Tuple[type, ...]) -> Optional[Impl]:
    base = _IMPLS.get((op, layouts))
    return _routed((op, layouts), base) if (op, layouts) in _DEVICE_IMPLS else base


def impls_for(op: str) -> List[Impl]:
    keys = dict.fromkeys(k for k in [*_IMPLS, *_DEVICE_IMPLS] if k[0] == op)
    return [lookup(*k) for k in keys]
