"""The :class:`SparseTensor` subclass: a tensor whose storage is a sparsa layout.

It behaves like a tensor of its logical shape (``shape``, ``dtype``, ``device``, ``requires_grad``,
printing, ``copy.deepcopy``, ``nn.Parameter``). High-level ops (``F.linear``, ``matmul``, ``add``...)
go through sparsa's dispatcher (``__torch_function__``); any other op reaches ``__torch_dispatch__``,
where structural ops (detach, clone, to) keep the layout, in-place updates (optimizer steps) refill
the stored pattern, and everything else runs densely (counted, see :func:`sparsa.fallback_counts`).

Example::

    >>> import torch, sparsa
    >>> w = sparsa.to_sparse(torch.randn(4, 8), sparsa.layouts.NM, n=2, m=4)
    >>> w.shape, w.layout_name, round(w.density, 2)
    (torch.Size([4, 8]), 'nm', 0.5)
    >>> y = torch.nn.functional.linear(torch.randn(3, 8), w)   # dispatched to the N:M implementation
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any, Optional, Type, Union

import torch
from torch import Tensor

from .layouts.base import Layout, get_layout, is_restricted
from .sparsifiers.base import check_sparsifier

# the dispatcher imports only tensor_base (below both), never this module: no import cycle
from .ops.aten_fallback import handle as _aten_handle
from .ops.dispatch import dispatch as _dispatch
from .ops.op_table import TORCH_FNS as _TORCH_FNS
from .tensor_base import (  # noqa: F401  (unwrap_dense: kept importable here)
    SparseTensorBase,
    inner_properties,
    normal_layout,
    outside_inference_mode,
    unwrap_dense,
)

__all__ = ["SparseTensor", "to_sparse", "to_dense"]


class SparseTensor(SparseTensorBase):
    """A tensor stored in a sparsa :class:`~sparsa.layouts.base.Layout`.

    Build one with :func:`sparsa.to_sparse` (differentiable w.r.t. the dense input) or directly
    from a layout instance: ``SparseTensor(layout, requires_grad=False)``.

    Attributes:
        inline_sparsifier: optional sparsifier re-applied after every in-place update
            (e.g. an optimizer step); by default the stored pattern is kept exactly.
    """

    def to_layout(self, layout: Union[str, Type[Layout]], **params: Any) -> "SparseTensor":
        """Convert to another layout (through the conversion graph); keeps ``requires_grad``."""
        from .layouts.base import convert

        dst = get_layout(layout) if isinstance(layout, str) else layout
        out = SparseTensor(convert(self._layout, dst, **params), requires_grad=self.requires_grad)
        out.inline_sparsifier = self.inline_sparsifier
        return out

    # ---------------------------------------------------------------- copy / compile support
    def __deepcopy__(self, memo: dict) -> "SparseTensor":
        if id(self) in memo:
            return memo[id(self)]
        lay = self._layout.map_tensors(lambda t: t.detach().clone())
        out = SparseTensor(lay, requires_grad=self.requires_grad)
        out.inline_sparsifier = copy.deepcopy(self.inline_sparsifier, memo)
        if getattr(self, "_is_param", False):
            out._is_param = True
        for hook in (getattr(self, "_post_accumulate_grad_hooks", None) or {}).values():  # e.g. grad layouts
            out.register_post_accumulate_grad_hook(copy.deepcopy(hook, memo))
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, proto: int):
        # plain pickling (torch.save / multiprocessing) rebuilds from components
        lay = self._layout
        comps = {k: v.detach() for k, v in lay.components().items()}
        return (_rebuild, (type(lay).name, comps, tuple(lay.shape), lay.params(), self.requires_grad))

    def __tensor_flatten__(self):
        # on every call of a compiled graph (its guards, then its inputs): the names and context are made once
        # per layout instance (whose components and parameters are fixed) and set of derived names
        lay = self._layout
        derived = tuple(lay.derived_components())
        hit = lay.__dict__.get(_FLATTEN)
        if hit is None or hit[0] != derived:
            names = tuple(lay.components())
            ctx = (type(lay), tuple(lay.shape), lay.params(), names, derived)
            inner = [f"_c_{n}" for n in names] + [f"_d_{n}" for n in derived]
            inner_properties(type(self), inner)
            hit = lay.__dict__[_FLATTEN] = (derived, inner, ctx)
        return list(hit[1]), hit[2]

    def _stable_hash_for_caching(self) -> str:
        """The key ``torch.compile``'s AOT autograd cache files this tensor under: its layout, shape, dtype,
        parameters and the metadata (not the values) of its components and derived tensors (both are graph
        inputs), the same in every process."""
        lay = self._layout
        inner = [(n, t) for n, t in lay.components().items()]
        inner += [("derived:" + n, t) for n, t in lay.derived_components().items()]
        comps = sorted((n, tuple(t.shape), tuple(t.stride()), str(t.dtype), t.device.type) for n, t in inner)
        params = sorted((k, repr(v)) for k, v in lay.params().items())
        key = (
            type(lay).__module__,
            type(lay).__qualname__,
            tuple(lay.shape),
            str(self.dtype),
            self.requires_grad,
            params,
            comps,
        )
        return hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest()

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        cls, shape, params, names, derived = ctx
        from .layouts.base import unchecked

        comps = {n: inner[f"_c_{n}"] for n in names}
        with unchecked():
            lay = cls.from_components(comps, shape, **params)
        lay.adopt_derived({n: inner[f"_d_{n}"] for n in derived})
        return SparseTensor(lay)

    # ---------------------------------------------------------------- dispatch
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = _TORCH_FNS.get(func)
        if op is not None:
            return _dispatch(cls, op, func, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _aten_handle(cls, func, args, kwargs or {})


#: the attribute of a layout that keeps what __tensor_flatten__ returns for it
_FLATTEN = "_sparsa_flatten"


def _rebuild(name, comps, shape, params, requires_grad):
    lay = get_layout(name).from_components(comps, shape, **params)
    return SparseTensor(lay, requires_grad=requires_grad)


class _FromDense(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dense: Tensor, layout: Layout) -> SparseTensor:  # type: ignore[override]
        ctx.layout = layout
        return SparseTensor(layout)

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        if isinstance(g, SparseTensor):
            g = g._layout.to_dense()
        if is_restricted(g, ctx.layout):  # the op's kernels computed it on the pattern only
            return g, None
        return ctx.layout.restrict(g), None


def to_sparse(
    dense: Tensor,
    layout: Union[str, Type[Layout]] = "masked",
    *,
    mask: Optional[Tensor] = None,
    sparsifier: Any = None,
    requires_grad: Optional[bool] = None,
    **params: Any,
) -> SparseTensor:
    """Store ``dense`` in ``layout`` (a class or registered name).

    ``mask`` (bool, same shape) or ``sparsifier`` (a :class:`sparsa.sparsifiers.Sparsifier`) choose the
    kept positions; otherwise the layout keeps the nonzeros (structured layouts keep the largest
    magnitudes that fit). The result is differentiable w.r.t. ``dense`` (gradient restricted to the kept
    pattern). ``params`` go to the layout (e.g. ``n=2, m=4``).

    >>> import torch, sparsa
    >>> s = sparsa.to_sparse(torch.tensor([[0.0, 1.0], [2.0, 0.0]]), "csr")
    >>> s.nnz
    2
    """
    from .layouts.base import check_float

    if isinstance(dense, SparseTensor):
        dense = dense.to_dense()
    check_float(dense, "dense")
    cls = get_layout(layout) if isinstance(layout, str) else layout
    check_sparsifier(sparsifier)
    if mask is None and sparsifier is not None:
        mask = sparsifier.mask(dense.detach())
    track = dense.requires_grad and torch.is_grad_enabled()  # read first: leaving inference mode enables grad
    with outside_inference_mode():  # a weight sparsified under inference mode is kept as normal tensors
        lay = normal_layout(cls.from_dense(dense.detach(), mask=mask, **params))
        out = _FromDense.apply(dense, lay) if track else SparseTensor(lay, requires_grad=bool(requires_grad))
    if requires_grad is not None and out.is_leaf:
        out.requires_grad_(requires_grad)
    return out


def to_dense(t: Tensor) -> Tensor:
    """A plain tensor for any tensor (identity for dense ones); differentiable."""
    return t.to_dense() if isinstance(t, SparseTensor) else t
