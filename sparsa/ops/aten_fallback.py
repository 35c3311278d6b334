"""ATen-level handling of SparseTensor (``__torch_dispatch__``), below autograd.

- structural ops (detach, alias, clone, ``_to_copy``/``to``) keep the layout;
- in-place ops on a SparseTensor (optimizer steps: ``add_``, ``addcdiv_``, ``mul_``, ``lerp_``,
  ``copy_``, ``zero_``...) compute densely and *refill* the stored pattern, so the sparsity pattern
  survives training exactly (or is recomputed by the tensor's ``inline_sparsifier``);
- every other op runs on dense copies of its sparse arguments and is counted as a fallback.
"""
from __future__ import annotations

from typing import Any, Callable, Dict

import torch
from torch.utils._pytree import tree_map

from ..tensor import SparseTensor
from . import dispatch as _d

aten = torch.ops.aten

# ops that are bookkeeping, not compute: never warned about
_QUIET = {"zeros_like", "empty_like", "ones_like", "full_like", "is_same_size", "_has_compatible_shallow_copy_type",
          "lift_fresh", "_local_scalar_dense", "equal", "allclose", "isclose"}


def _dense(x: Any) -> Any:
    return tree_map(lambda a: a._layout.to_dense() if isinstance(a, SparseTensor) else a, x)


def _same(src: SparseTensor, lay) -> SparseTensor:
    out = SparseTensor(lay, requires_grad=False)
    out.inline_sparsifier = src.inline_sparsifier
    return out


def _detach(func, args, kwargs):
    return _same(args[0], args[0]._layout)


def _clone(func, args, kwargs):
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
        return t.clone() if t.data_ptr() else t
    return _same(src, lay.map_tensors(conv))


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
}


def handle(func, args, kwargs):
    h = _HANDLERS.get(func)
    if h is not None:
        return h(func, args, kwargs)
    schema = func._schema
    name = schema.name.split("::")[-1]
    if schema.is_mutable and args and isinstance(args[0], SparseTensor):
        # in-place update of a sparse tensor: compute densely, keep (or re-derive) the pattern
        target = args[0]
        base = target._layout.to_dense().clone()
        rest = _dense(args[1:])
        func(base, *rest, **_dense(kwargs))
        _d.record_fallback(f"aten.{name}", (target.layout_name,), warn=False)
        return _refill(target, base)
    if name not in _QUIET:
        layouts = tuple(a.layout_name for a in args if isinstance(a, SparseTensor))
        _d.record_fallback(f"aten.{name}", layouts)
    return func(*_dense(args), **_dense(kwargs))
