"""``F.linear`` with a RowGroup or SlicedELL weight: native CPU kernels, forward and backward.

Registered with the dispatcher, so ``F.linear(x, sparse_weight, bias)`` runs the kernel::

    >>> import torch, sparsa
    >>> w = sparsa.to_sparse(torch.randn(64, 32), "row_group", sparsity=0.75)
    >>> x = torch.randn(3, 32)
    >>> torch.allclose(torch.nn.functional.linear(x, w), x @ w.to_dense().T, atol=1e-4)
    True

Forward calls the forward-only kernel ops ``sparsa::row_group_linear_kernel`` /
``sparsa::sliced_ell_linear_kernel``, eager and under ``torch.compile`` alike (low per-call cost:
:mod:`sparsa.kernels.opdef`); this class owns the backward: ``grad_x = grad_y @ W`` and ``grad_W`` on the
kept pattern only (a dense tensor of W's shape, zero elsewhere), each computed only when needed;
sparse formulations (gather + batched matmul) are used where they beat the dense matmul.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..kernels import row_group as _rg
from ..kernels import sliced_ell as _se
from ..layouts.dense import Dense
from ..layouts.row_group import RowGroup
from ..layouts.sliced_ell import SlicedELL
from ..crossovers import crossover
from .registry import implements

__all__ = ["RowGroupLinear", "SlicedELLLinear"]


def _check_input(x: Tensor, w, bias: Optional[Tensor]) -> None:
    R, K = w.shape
    if x.dim() == 0 or x.shape[-1] != K:
        raise ValueError(
            f"linear: input has shape {tuple(x.shape)} but the {type(w).__name__} weight of shape "
            f"{(R, K)} expects a last dimension of {K}"
        )
    if bias is not None and tuple(bias.shape) != (R,):
        raise ValueError(f"linear: bias must have shape ({R},), got {tuple(bias.shape)}")


def _grad_bias(g2: Tensor) -> Tensor:
    return g2.sum(0)


@implements("linear", (Dense, RowGroup, Dense))
class RowGroupLinear:
    """``y = x @ W.T + b`` for a :class:`~sparsa.layouts.RowGroup` weight."""

    @staticmethod
    def forward(ctx, x: Tensor, w: RowGroup, bias: Optional[Tensor] = None) -> Tensor:
        _check_input(x, w, bias)
        y = _rg.row_group_linear_kernel(x, w.columns, w.values, bias, w.shape[0], w.row_perm)
        ctx.save_for_backward(x, w.columns, w.values, w.row_perm)
        ctx.weight_shape = tuple(w.shape)
        return y

    @staticmethod
    def backward(ctx, gy: Tensor):
        x, columns, values, row_perm = ctx.saved_tensors
        nx, nw, nb = (tuple(ctx.needs_input_grad) + (False,) * 3)[:3]
        R, K = ctx.weight_shape
        ng, k, G = values.shape
        g2 = gy.reshape(-1, R)
        sparse = k / max(K, 1) <= crossover("row_group.backward")  # measured per CPU (sparsa cost --refit)
        w = RowGroup(columns, values, (R, K), row_perm, validate=False)
        gx = gw = gb = None
        if nx:
            gx = _rg_grad_input(g2, w, sparse).reshape(x.shape)
        if nw:
            gw = _rg_grad_weight(g2, x.reshape(-1, K).to(g2.dtype), w, sparse)
        if nb:
            gb = _grad_bias(g2)
        return gx, gw, gb


def _rg_grad_input(g2: Tensor, w: RowGroup, sparse: bool) -> Tensor:
    """``grad_y @ W`` (T, K)."""
    if not sparse:
        return g2 @ w.to_dense().to(g2.dtype)
    return _rg.row_group_grad_input(g2, w.columns, w.values, w.shape[1], w.row_perm)


def _rg_grad_weight(g2: Tensor, x2: Tensor, w: RowGroup, sparse: bool) -> Tensor:
    """``grad_y.T @ x`` on the kept pattern, as a dense (R, K) tensor zero elsewhere."""
    ng, k, G = w.values.shape
    if sparse:
        gv = _rg.row_group_grad_values(g2, x2, w.columns, w.values, w.row_perm)
    else:
        gs = g2 if ng * G == g2.shape[1] else torch.nn.functional.pad(g2, (0, ng * G - g2.shape[1]))
        full = gs[:, w.row_perm.long()].t() @ x2  # (ng*G, K), slot order
        cols = w.columns.long()
        gv = full.view(ng, G, -1).gather(2, cols[:, None, :].expand(ng, G, k)).transpose(1, 2)
    return RowGroup(w.columns, gv.contiguous(), w.shape, w.row_perm, validate=False).to_dense()


@implements("linear", (Dense, SlicedELL, Dense))
class SlicedELLLinear:
    """``y = x @ W.T + b`` for a :class:`~sparsa.layouts.SlicedELL` weight (75-99% sparse)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: SlicedELL, bias: Optional[Tensor] = None) -> Tensor:
        _check_input(x, w, bias)
        y = _se.sliced_ell_linear_kernel(x, w.slice_ptr, w.columns, w.values, bias, w.shape[0])
        ctx.save_for_backward(x, w.slice_ptr, w.columns, w.values, w.row_nnz)
        ctx.weight_shape = tuple(w.shape)
        return y

    @staticmethod
    def backward(ctx, gy: Tensor):
        x, slice_ptr, columns, values, row_nnz = ctx.saved_tensors
        nx, nw, nb = (tuple(ctx.needs_input_grad) + (False,) * 3)[:3]
        R, K = ctx.weight_shape
        w = SlicedELL(slice_ptr, columns, values, row_nnz, (R, K), validate=False)
        g2 = gy.reshape(-1, R)
        gx = gw = gb = None
        if nx:
            gx = _se_grad_input(g2, w).reshape(x.shape)
        if nw:
            gw = _se_grad_weight(g2, x.reshape(-1, K).to(g2.dtype), w)
        if nb:
            gb = _grad_bias(g2)
        return gx, gw, gb


def _se_grad_input(g2: Tensor, w: SlicedELL) -> Tensor:
    """``grad_y @ W``: the forward kernel on the transposed pattern when sparse enough, else dense."""
    dense = w.to_dense().to(g2.dtype)
    if w.density > crossover("sliced_ell.grad_input") or g2.dtype not in (torch.float32, torch.bfloat16):
        return g2 @ dense
    wt = SlicedELL.from_dense(dense.t(), mask=w.mask().t())
    return _se.sliced_ell_linear_kernel(g2, wt.slice_ptr, wt.columns, wt.values, None, w.shape[1])


def _se_grad_weight(g2: Tensor, x2: Tensor, w: SlicedELL, chunk: int = 1 << 22) -> Tensor:
    """``grad_y.T @ x`` on the kept entries only (sampled dense-dense product), dense (R, K) result."""
    rows, cols, _ = w._entries()
    T = g2.shape[0]
    R, K = w.shape
    if rows.numel() * 32 > R * K:  # the elementwise sampled product only pays off when very sparse
        return (g2.t() @ x2) * w.mask()
    out = g2.new_zeros(R, K)
    step = max(1, chunk // max(T, 1))
    for i in range(0, rows.numel(), step):
        r, c = rows[i : i + step], cols[i : i + step]
        out[r, c] = (g2[:, r] * x2[:, c]).sum(0)
    return out
