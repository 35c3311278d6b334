"""ATen-level handling of SparseTensor (``__torch_dispatch__``), below autograd.

- structural ops (detach, alias, clone, ``_to_copy``/``to``) keep the layout;
- ops with a registered implementation (``sparsa.implements``: one registration serves this level and
  the torch-function level) run it, forward only, as autograd has already recorded the op above;
- registered rules (:func:`register_rule`) come next; the built-in one, ``"refill"``: in-place ops on a
  SparseTensor (optimizer steps: ``add_``, ``addcdiv_``, ``mul_``, ``lerp_``, ``copy_``, ``zero_``...)
  compute densely and *refill* the stored pattern, so the sparsity pattern survives training exactly
  (or is recomputed by the tensor's ``inline_sparsifier``); not a fallback, so strict mode allows it;
- every other op runs on dense copies of its sparse arguments, warns once and is counted as a fallback
  (in strict mode, :func:`sparsa.strict`, it raises instead). Ops that do not read the stored values
  (``zeros_like``...) are not fallbacks; comparisons that read them (``equal``, ``allclose``, ``item``)
  are not counted, but raise in strict mode like any other dense computation.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.utils._pytree import tree_map

from ..tensor_base import SparseTensorBase as SparseTensor
from ..tensor_base import outside_inference_mode
from . import dispatch as _d
from .op_table import ATEN_OPS
from .strict import fallback_error, is_strict

aten = torch.ops.aten

# ops that read shape and dtype only, not the stored values: not a fallback, even in strict mode
_NO_VALUES = {
    "zeros_like",
    "empty_like",
    "ones_like",
    "full_like",
    "is_same_size",
    "_has_compatible_shallow_copy_type",
    "lift_fresh",
}
# comparisons and scalar reads compute on the dense values: not counted (tests and asserts use them),
# but strict mode asks for no dense computation at all
_UNCOUNTED = {"_local_scalar_dense", "equal", "allclose", "isclose"}


def _dense(x: Any) -> Any:
    return tree_map(lambda a: a._layout.to_dense() if isinstance(a, SparseTensor) else a, x)


def _same(src: SparseTensor, lay) -> SparseTensor:
    out = type(src)(lay, requires_grad=False)
    out.inline_sparsifier = src.inline_sparsifier
    return out


def _detach(func, args, kwargs):
    src = args[0]
    # a view shares its source's version counter, which an inference tensor lacks: the view of a normal
    # tensor is made as a normal tensor, as PyTorch's own views are
    with nullcontext() if src.is_inference() else outside_inference_mode():
        return _same(src, src._layout)


def _clone(func, args, kwargs):
    with outside_inference_mode():  # copies and conversions may be weights: kept normal (outside_inference_mode)
        return _same(args[0], args[0]._layout.map_tensors(lambda t: t.clone()))


def _to_copy(func, args, kwargs):
    src = args[0]
    dtype = kwargs.get("dtype")
    device = kwargs.get("device")
    lay = src._layout
    if dtype is not None and dtype != lay.dtype and not dtype.is_floating_point:
        return func(lay.to_dense(), **kwargs)  # integer/bool copies are dense

    def conv(t):
        if t.is_floating_point() and dtype is not None:
            t = t.to(dtype=dtype)
        if device is not None:
            t = t.to(device=device)
        return t.clone() if t.data_ptr() or t.is_inference() else t

    with outside_inference_mode():
        return _same(src, lay.map_tensors(conv))


def _to(func, args, kwargs):
    """``aten.to`` overloads, which reach the layout undecomposed where autograd is off (inference mode):
    the source itself when nothing changes and no copy is asked for, else what ``_to_copy`` makes."""
    src, rest = args[0], args[1:]
    kw = dict(kwargs)
    if func is aten.to.dtype:
        names = ("dtype", "non_blocking", "copy", "memory_format")
    elif func is aten.to.device:
        names = ("device", "dtype", "non_blocking", "copy", "memory_format")
    elif func is aten.to.other:
        names = ("other", "non_blocking", "copy", "memory_format")
    else:  # to.dtype_layout: keyword-only
        names = ()
    kw.update(zip(names, rest))
    other = kw.pop("other", None)
    if other is not None:
        kw.setdefault("dtype", other.dtype)
        kw.setdefault("device", other.device)
    copy = bool(kw.pop("copy", False))
    kw.pop("non_blocking", None)
    kw.pop("memory_format", None)  # a layout has no memory format
    kw.pop("layout", None)
    kw.pop("pin_memory", None)
    dtype, device = kw.get("dtype"), kw.get("device")
    device = None if device is None else torch.device(device)
    same = (dtype is None or dtype == src.dtype) and (
        device is None or (device.type == src.device.type and device.index in (None, src.device.index))
    )
    if same and not copy:
        return src
    return _to_copy(aten._to_copy.default, (src,), {"dtype": dtype, "device": device})


def _type_as(func, args, kwargs):
    """``aten.type_as`` (undecomposed under inference mode): ``to`` the other tensor's dtype and device."""
    return _to(aten.to.other, (args[0], args[1]), {})


def _refill(dst: SparseTensor, dense_new: torch.Tensor) -> SparseTensor:
    sp = dst.inline_sparsifier
    lay = dst._layout
    if sp is not None:
        dst._layout = type(lay).from_dense(dense_new, mask=sp.mask(dense_new), **lay.params())
    else:
        dst._layout = lay.refill(dense_new)
    return dst


_HANDLERS: Dict[Any, Callable] = {
    aten.detach.default: _detach,
    aten.alias.default: _detach,
    aten.clone.default: _clone,
    aten._to_copy.default: _to_copy,
    aten.to.dtype: _to,
    aten.to.device: _to,
    aten.to.other: _to,
    aten.to.dtype_layout: _to,
    aten.type_as.default: _type_as,
}


# ----------------------------------------------------------------------------- rules
@dataclass(frozen=True)
class AtenRule:
    """An aten-level rule: ``handler(func, args, kwargs)`` runs every aten op where
    ``applies(func, args, kwargs)`` is true (tried in registration order, before the dense fallback)."""

    name: str
    applies: Callable[[Any, tuple, dict], bool]
    handler: Callable[[Any, tuple, dict], Any]


_RULES: List[AtenRule] = []


class RuleHandle:
    """What :func:`register_rule` returns: the decorator that registers the handler (returning it unchanged)
    and then the handle of that registration, as :func:`sparsa.implements` is. ``remove()`` unregisters the
    rule (putting back the rule it replaced, if any; a later replacement stays), and as a context manager
    the rule is removed at the end of the ``with`` block::

        with register_rule("mine", applies) as rule:
            rule(handler)
            ...                              # the rule applies here
    """

    __slots__ = ("name", "applies", "replace", "rule", "_replaced", "removed")

    def __init__(self, name: str, applies: Callable[[Any, tuple, dict], bool], replace: bool):
        self.name, self.applies, self.replace = name, applies, replace
        self.rule: Optional[AtenRule] = None
        self._replaced: Optional[AtenRule] = None
        self.removed = False

    def __call__(self, handler: Callable[[Any, tuple, dict], Any]) -> Callable[[Any, tuple, dict], Any]:
        if self.rule is not None and not self.removed:
            raise ValueError(
                f"this register_rule({self.name!r}, ...) already registered a handler; call .remove() "
                "first or make a new one"
            )
        rule = AtenRule(self.name, self.applies, handler)
        for i, r in enumerate(_RULES):
            if r.name == self.name:
                if not self.replace:
                    raise ValueError(
                        f"an aten rule named {self.name!r} is already registered; pass replace=True to replace it"
                    )
                self._replaced, _RULES[i] = r, rule
                break
        else:
            self._replaced = None
            _RULES.append(rule)
        self.rule, self.removed = rule, False
        return handler

    def remove(self) -> None:
        """Unregister the rule (again: nothing happens)."""
        if self.rule is None:
            raise ValueError(f"nothing to remove: register_rule({self.name!r}, ...) has not decorated a handler yet")
        if self.removed:
            return
        self.removed = True
        for i, r in enumerate(_RULES):
            if r is self.rule:
                if self._replaced is not None:
                    _RULES[i] = self._replaced
                else:
                    del _RULES[i]
                return

    def __enter__(self) -> "RuleHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.rule is not None:
            self.remove()

    def __repr__(self) -> str:
        state = "not registered" if self.rule is None else "removed" if self.removed else "active"
        return f"RuleHandle({self.name!r}, {state})"


def register_rule(name: str, applies: Callable[[Any, tuple, dict], bool], *, replace: bool = False) -> RuleHandle:
    """Decorator: register ``handler(func, args, kwargs)`` as the aten rule ``name``, tried where
    ``applies(func, args, kwargs)`` holds. Returns a :class:`RuleHandle`: after decorating,
    ``.remove()`` (or the end of its ``with`` block) unregisters the rule.

    A second rule of the same name is an error unless ``replace=True`` (it then takes the old one's
    place until removed); :func:`unregister_rule` removes one by name."""
    return RuleHandle(name, applies, replace)


def unregister_rule(name: str) -> None:
    """Remove the aten rule ``name`` (a ``KeyError`` if there is none)."""
    for i, r in enumerate(_RULES):
        if r.name == name:
            del _RULES[i]
            return
    raise KeyError(f"no aten rule named {name!r}; registered: {[r.name for r in _RULES]}")


def registered_rules() -> List[str]:
    """Names of the aten rules, in the order they are tried."""
    return [r.name for r in _RULES]


def _in_place_on_sparse(func, args, kwargs) -> bool:
    return bool(func._schema.is_mutable and args and isinstance(args[0], SparseTensor))


@register_rule("refill", _in_place_on_sparse)
def _refill_in_place(func, args, kwargs):
    """In-place update of a sparse tensor (an optimizer step): compute densely, keep (or re-derive) the
    stored pattern."""
    target = args[0]
    base = target._layout.to_dense().clone()
    func(base, *_dense(args[1:]), **_dense(kwargs))
    return _refill(target, base)


def _sparse_layouts(args: tuple, kwargs: dict) -> tuple:
    found: list = []
    tree_map(lambda a: found.append(a.layout_name) if isinstance(a, SparseTensor) else None, (args, kwargs))
    return tuple(found)


def handle(cls: type, func, args, kwargs):
    """What ``SparseTensor.__torch_dispatch__`` runs for the aten op ``func``; sparse outputs are built
    as ``cls``."""
    h = _HANDLERS.get(func)
    if h is not None:
        return h(func, args, kwargs)
    call = ATEN_OPS.get(func)
    if call is not None:
        out = _d.dispatch_aten(cls, call, args, kwargs)
        if out is not _d.NO_IMPL:
            return out
    for rule in _RULES:
        if rule.applies(func, args, kwargs):
            return rule.handler(func, args, kwargs)
    name = func._schema.name.split("::")[-1]
    if name in _UNCOUNTED:
        if is_strict():
            raise fallback_error(f"aten.{name}", _sparse_layouts(args, kwargs), registrable=False)
    elif name not in _NO_VALUES:
        _d.record_fallback(f"aten.{name}", _sparse_layouts(args, kwargs))
    return func(*_dense(args), **_dense(kwargs))
