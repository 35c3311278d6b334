"""Elementwise ops with a sparse operand: ``add``, ``mul`` and ``relu`` on Masked and COO.

What each returns follows from treating unstored positions as *structural zeros*:

* ``sparse + dense`` (either order) is dense: adding a dense tensor fills every position.
  ``COO + COO`` of the same shape is COO on the union of the two patterns.
* ``sparse * dense`` (either order, or a scalar) keeps the sparse pattern and layout: a structural zero
  times anything is zero, so ``inf``/``nan`` in the dense operand at unstored positions do not leak.
  ``COO * COO`` is COO on the intersection of the patterns.
* ``relu(sparse)`` keeps the layout and narrows the pattern to the positive stored values (relu of a
  stored zero or negative value is a structural zero of the result).

Gradients w.r.t. a sparse operand are restricted to its stored pattern (dense tensors, zero
elsewhere); gradients w.r.t. dense operands are the usual ones (summed over broadcast dims).

>>> import torch, sparsa
>>> s = sparsa.to_sparse(torch.tensor([1.0, 0.0, -2.0]), "masked")
>>> torch.relu(s).pattern().tolist(), (s * torch.tensor([2.0, float("inf"), 1.0])).to_dense().tolist()
([True, False, False], [2.0, 0.0, -2.0])
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from ..layouts import COO, Layout, Masked
from .registry import register_impl

__all__ = ["SparseDenseAdd", "SparseDenseMul", "CooCooAdd", "CooCooMul", "SparseRelu"]


def _dense(x: Any) -> Any:
    """Dense value of an operand (layout -> tensor; tensors and scalars unchanged)."""
    if isinstance(x, Masked):
        return x.values
    if isinstance(x, Layout):
        return x.to_dense()
    return x


def _zero(like: Tensor) -> Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device)


def _grad_for(x: Any, g: Tensor, need: bool) -> Optional[Tensor]:
    """``g`` reduced to ``x``'s shape (and restricted to x's pattern if x is sparse); None for scalars."""
    if not need or not isinstance(x, (Tensor, Layout)):
        return None
    g = g.sum_to_size(tuple(x.shape)) if tuple(g.shape) != tuple(x.shape) else g
    if isinstance(x, Layout):
        g = x.restrict(g)
    return g


def _needs(ctx, k: int) -> Tuple[bool, ...]:
    return (tuple(ctx.needs_input_grad) + (False,) * k)[:k]


# ----------------------------------------------------------------------------- add
class SparseDenseAdd:
    """``a + alpha * b`` where one operand is Masked/COO and the other dense (or a scalar): dense out."""

    @staticmethod
    def forward(ctx, a: Any, b: Any, alpha=1) -> Tensor:
        ctx.a, ctx.b, ctx.alpha = a, b, alpha
        return torch.add(_dense(a), _dense(b), alpha=alpha)

    @staticmethod
    def backward(ctx, g: Tensor):
        need_a, need_b = _needs(ctx, 2)
        gb = _grad_for(ctx.b, g * ctx.alpha if ctx.alpha != 1 else g, need_b)
        return _grad_for(ctx.a, g, need_a), gb


def _coalesce(indices: Tensor, values: Tensor, shape: torch.Size) -> COO:
    """Sum duplicate coordinates and sort: a valid COO."""
    tmp = COO(indices, values, shape, validate=False)
    lin = tmp.linear_indices()
    uniq, inv = torch.unique(lin, sorted=True, return_inverse=True)
    vals = torch.zeros(uniq.numel(), dtype=values.dtype, device=values.device).index_add_(0, inv, values)
    idx = torch.zeros(len(shape), uniq.numel(), dtype=torch.int64, device=values.device)
    idx[:, inv] = indices
    return COO(idx, vals, shape, validate=False)


class CooCooAdd:
    """``a + alpha * b`` for two COO tensors: COO on the union pattern (dense if shapes differ)."""

    @staticmethod
    def forward(ctx, a: COO, b: COO, alpha=1) -> Any:
        ctx.a, ctx.b, ctx.alpha = a, b, alpha
        if a.shape != b.shape:
            return torch.add(a.to_dense(), b.to_dense(), alpha=alpha)
        bv = b.values * alpha if alpha != 1 else b.values
        return _coalesce(torch.cat([a.indices, b.indices], 1), torch.cat([a.values, bv]), a.shape)

    backward = SparseDenseAdd.backward


# ----------------------------------------------------------------------------- mul
def _masked_mul(s: Masked, other: Any) -> Masked:
    prod = s.values * other
    mask = s.mask() if prod.shape == s.shape else s.mask().expand(prod.shape).contiguous()
    return Masked(torch.where(mask, prod, _zero(prod)), mask, validate=False)


def _coo_mul(s: COO, other: Any) -> COO:
    if not isinstance(other, Tensor) or other.dim() == 0:
        return COO(s.indices, s.values * other, s.shape, validate=False)
    out_shape = torch.broadcast_shapes(s.shape, other.shape)
    if out_shape != s.shape:  # the dense operand widens the result: go through dense
        mask = s.mask().expand(out_shape)
        return COO.from_dense(s.to_dense() * other, mask=mask)
    return COO(s.indices, s.values * other.expand(s.shape)[tuple(s.indices)], s.shape, validate=False)


class SparseDenseMul:
    """``a * b`` where one operand is Masked/COO and the other dense (or a scalar): same layout, same
    pattern as the sparse operand."""

    @staticmethod
    def forward(ctx, a: Any, b: Any) -> Layout:
        ctx.a, ctx.b = a, b
        s, other = (a, b) if isinstance(a, Layout) else (b, a)
        return _masked_mul(s, other) if isinstance(s, Masked) else _coo_mul(s, other)

    @staticmethod
    def backward(ctx, g: Tensor):
        need_a, need_b = _needs(ctx, 2)
        a, b = _dense(ctx.a), _dense(ctx.b)
        # the sparse operand's dense value is zero off-pattern, so the other gradient is right as is
        ga = _grad_for(ctx.a, g * b, need_a) if need_a else None
        gb = _grad_for(ctx.b, g * a, need_b) if need_b else None
        return ga, gb


class CooCooMul:
    """``a * b`` for two COO tensors of one shape: COO on the intersection pattern."""

    @staticmethod
    def forward(ctx, a: COO, b: COO) -> Any:
        ctx.a, ctx.b = a, b
        if a.shape != b.shape:
            return a.to_dense() * b.to_dense()
        la, lb = a.linear_indices(), b.linear_indices()
        in_a = torch.isin(la, lb)
        pos_b = torch.searchsorted(lb, la[in_a])
        return COO(a.indices[:, in_a], a.values[in_a] * b.values[pos_b], a.shape, validate=False)

    backward = SparseDenseMul.backward


# ----------------------------------------------------------------------------- relu
class SparseRelu:
    """``relu`` of Masked/COO: same layout, pattern narrowed to the positive stored values."""

    @staticmethod
    def forward(ctx, x: Layout) -> Layout:
        ctx.x = x
        if isinstance(x, Masked):
            keep = x.mask() & (x.values > 0)
            return Masked(torch.where(keep, x.values, _zero(x.values)), keep, validate=False)
        keep = x.values > 0
        return COO(x.indices[:, keep], x.values[keep], x.shape, validate=False)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g * (_dense(ctx.x) > 0)


def _register() -> None:
    for lay in (Masked, COO):
        n = lay.name
        register_impl("add", (lay, None), SparseDenseAdd.forward, SparseDenseAdd.backward, name=f"SparseDenseAdd[{n}]")
        register_impl("add", (None, lay), SparseDenseAdd.forward, SparseDenseAdd.backward, name=f"DenseSparseAdd[{n}]")
        register_impl("mul", (lay, None), SparseDenseMul.forward, SparseDenseMul.backward, name=f"SparseDenseMul[{n}]")
        register_impl("mul", (None, lay), SparseDenseMul.forward, SparseDenseMul.backward, name=f"DenseSparseMul[{n}]")
        register_impl("relu", (lay,), SparseRelu.forward, SparseRelu.backward, name=f"SparseRelu[{n}]")
    register_impl("add", (COO, COO), CooCooAdd.forward, CooCooAdd.backward, name="CooCooAdd")
    register_impl("mul", (COO, COO), CooCooMul.forward, CooCooMul.backward, name="CooCooMul")


_register()
