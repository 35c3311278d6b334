"""Matrix products with a sparse operand: ``matmul``/``mm`` (sparse first or second), ``addmm``
(sparse ``mat2``) and ``bmm`` (dense 3-D @ Masked/COO 3-D), forward and backward.

Every implementation is written with a few primitives on a 2-D sparse ``W`` (R, K):

* :func:`w_mm` ``W @ D``, :func:`wt_mm` ``W^T @ D``, :func:`mm_w` ``X @ W``, :func:`mm_wt` ``X @ W^T``
  -- torch.sparse kernels for CSR/COO (cached on the layout), a dense BLAS product on the materialised
  weight for the other layouts (on a CPU this beats torch.sparse at the densities structured layouts
  have; native kernels live in ``sparsa.kernels``);
* :func:`masked_mm` ``(A @ B)`` restricted to W's stored pattern (the weight gradient; zero elsewhere,
  because a position that is not stored is a structural zero, not a parameter).

>>> import torch, sparsa
>>> w = sparsa.to_sparse(torch.randn(6, 4), "csr")
>>> x = torch.randn(4, 3)
>>> torch.allclose(torch.mm(w, x), w.to_dense() @ x, atol=1e-6)
True
"""

from __future__ import annotations

from typing import Callable, Tuple

import torch
from torch import Tensor

from ..layouts import BSR, COO, CSR, GroupedNM, Layout, Masked, NM
from .registry import register_impl

__all__ = ["w_mm", "wt_mm", "mm_w", "mm_wt", "masked_mm", "dense_weight", "MATRIX_LAYOUTS"]

#: layouts accepted as a 2-D sparse matrix operand
MATRIX_LAYOUTS = (CSR, COO, Masked, NM, GroupedNM, BSR)


def dense_weight(w: Layout) -> Tensor:
    """The logical dense tensor of ``w`` (no copy for Masked)."""
    return w.values if isinstance(w, Masked) else w.to_dense()


_TORCH_SPARSE_DTYPES = (torch.float32, torch.float64)


def _torch_sparse(w: Layout, transpose: bool):
    """A cached torch.sparse form of ``w`` (or its transpose) when that is the route taken, else None.

    Under ``torch.compile`` the dense route is taken (torch.sparse tensors cannot be traced)."""
    if torch.compiler.is_compiling():  # stays: torch.sparse tensors cannot be traced (no native kernel here)
        return None
    if w.dtype not in _TORCH_SPARSE_DTYPES:  # torch's CPU sparse CSR product has no bf16/fp16 kernel
        return None
    if isinstance(w, CSR) and w.values.numel():
        return w.torch_csr_t() if transpose else w.torch_csr()
    if isinstance(w, COO) and len(w.shape) == 2 and w.values.numel():
        t = w.torch_coo()
        return t.t() if transpose else t
    return None


def w_mm(w: Layout, d: Tensor) -> Tensor:
    """``W @ d`` for a 2-D sparse ``W`` (R, K) and a dense ``d`` (K, M)."""
    s = _torch_sparse(w, False) if d.numel() else None
    return torch.sparse.mm(s, d) if s is not None else dense_weight(w) @ d


def wt_mm(w: Layout, d: Tensor) -> Tensor:
    """``W^T @ d`` for a 2-D sparse ``W`` (R, K) and a dense ``d`` (R, M)."""
    s = _torch_sparse(w, True) if d.numel() else None
    return torch.sparse.mm(s, d) if s is not None else dense_weight(w).t() @ d


def mm_wt(x: Tensor, w: Layout) -> Tensor:
    """``x @ W^T`` for a dense ``x`` (N, K) (the linear forward)."""
    s = _torch_sparse(w, False) if x.numel() else None
    return torch.sparse.mm(s, x.t()).t() if s is not None else x @ dense_weight(w).t()


def mm_w(x: Tensor, w: Layout) -> Tensor:
    """``x @ W`` for a dense ``x`` (N, R)."""
    s = _torch_sparse(w, True) if x.numel() else None
    return torch.sparse.mm(s, x.t()).t() if s is not None else x @ dense_weight(w)


def masked_mm(w: Layout, a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` (R, N) @ (N, K) kept only on the stored pattern of ``w``; a dense (R, K) tensor."""
    # stays: torch.sparse CSR tensors cannot be traced, so under torch.compile the dense route runs
    if isinstance(w, CSR) and w.values.numel() and a.numel() and b.numel() and not torch.compiler.is_compiling():
        return torch.sparse.sampled_addmm(w.torch_csr(), a, b, beta=0.0).to_dense()
    if isinstance(w, COO) and a.shape[1] and w.values.numel() * a.shape[1] <= (1 << 24):
        rows, cols = w.indices[0], w.indices[1]
        out = torch.zeros(w.shape, dtype=a.dtype, device=a.device)
        out[rows, cols] = (a.index_select(0, rows) * b.t().index_select(0, cols)).sum(1)
        return out
    return (a @ b).mul_(w.mask())


def _dense_matmul_grads(ctx, a: Tensor, b: Tensor, g: Tensor, sparse_pos: int):
    """Gradients of ``torch.matmul(a, b)`` (broadcasting, any rank) by autograd on the dense operands;
    the sparse operand's gradient is restricted to its pattern. Used for non-2-D sparse operands."""
    with torch.enable_grad():
        ad, bd = a.detach().requires_grad_(), b.detach().requires_grad_()
        ga, gb = torch.autograd.grad(torch.matmul(ad, bd), (ad, bd), g)
    grads = [ga, gb]
    grads[sparse_pos] = grads[sparse_pos].mul_(ctx.w.mask())
    return tuple(gr if need else None for gr, need in zip(grads, ctx.needs_input_grad[:2]))


def _as_rows(x: Tensor, k: int, op: str) -> Tuple[Tensor, Callable[[Tensor], Tensor]]:
    """View ``x`` (..., k) as (rows, k); also return the inverse reshape for (rows, n) results."""
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"{op}: the dense operand's last dim must be {k}, got shape {tuple(x.shape)}")
    lead = tuple(x.shape[:-1])
    return x.reshape(-1, k), (lambda y: y.reshape(lead + (y.shape[-1],)))


def _as_cols(x: Tensor, k: int, op: str) -> Tuple[Tensor, Callable[[Tensor], Tensor]]:
    """View ``x`` (k,) or (..., k, M) as (k, cols); also return the inverse for (r, cols) results."""
    if x.dim() == 1:
        if x.shape[0] != k:
            raise ValueError(f"{op}: the dense operand must have {k} rows, got shape {tuple(x.shape)}")
        return x.reshape(k, 1), (lambda y: y.reshape(y.shape[0]))
    if x.shape[-2] != k:
        raise ValueError(f"{op}: the dense operand's dim -2 must be {k}, got shape {tuple(x.shape)}")
    batch, mcols = tuple(x.shape[:-2]), x.shape[-1]
    xt = x.movedim(-2, 0).reshape(k, -1) if x.numel() else x.new_zeros(k, 0)

    def inv(y: Tensor) -> Tensor:
        return y.reshape((y.shape[0],) + batch + (mcols,)).movedim(0, -2)

    return xt, inv


# ----------------------------------------------------------------------------- dense @ sparse
class DenseSparseMatmul:
    """``x @ W``: dense ``x`` (..., K), sparse 2-D ``W`` (K, N) -> (..., N). A sparse ``W`` of another rank
    runs torch's broadcasting matmul on its dense values (gradient still restricted to the pattern)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Layout) -> Tensor:
        ctx.w, ctx.x_shape = w, x.shape
        ctx.save_for_backward(x)
        if len(w.shape) != 2:  # batched sparse operand: broadcasting matmul on the dense values
            return torch.matmul(x, dense_weight(w))
        x2, inv = _as_rows(x, w.shape[0], "matmul")
        return inv(mm_w(x2, w))

    @staticmethod
    def backward(ctx, g: Tensor):
        (x,) = ctx.saved_tensors
        w = ctx.w
        if len(w.shape) != 2:
            return _dense_matmul_grads(ctx, x, dense_weight(w), g, 1)
        x2, _ = _as_rows(x, w.shape[0], "matmul")
        g2 = g.reshape(-1, w.shape[1])
        need_x, need_w = ctx.needs_input_grad[:2]
        gx = mm_wt(g2, w).reshape(ctx.x_shape) if need_x else None
        gw = masked_mm(w, x2.t(), g2) if need_w else None
        return gx, gw


class SparseDenseMatmul:
    """``W @ x``: sparse 2-D ``W`` (R, K), dense ``x`` (K,) or (..., K, M) -> (R,) or (..., R, M); other
    ranks as in :class:`DenseSparseMatmul`."""

    @staticmethod
    def forward(ctx, w: Layout, x: Tensor) -> Tensor:
        ctx.w = w
        ctx.save_for_backward(x)
        if len(w.shape) != 2 or x.dim() == 0:
            return torch.matmul(dense_weight(w), x)
        xt, inv = _as_cols(x, w.shape[1], "matmul")
        return inv(w_mm(w, xt))

    @staticmethod
    def backward(ctx, g: Tensor):
        (x,) = ctx.saved_tensors
        w = ctx.w
        if len(w.shape) != 2 or x.dim() == 0:
            return _dense_matmul_grads(ctx, dense_weight(w), x, g, 0)
        xt, inv_x = _as_cols(x, w.shape[1], "matmul")
        g2, _ = _as_cols(g, w.shape[0], "matmul")
        need_w, need_x = ctx.needs_input_grad[:2]
        gw = masked_mm(w, g2, xt.t()) if need_w else None
        gx = inv_x(wt_mm(w, g2)) if need_x else None
        return gw, gx


class _MM2D:
    """``mm`` insists on 2-D operands like torch.mm, then reuses the matmul implementations."""

    @staticmethod
    def check(a, b) -> None:
        for name, t in (("input", a), ("mat2", b)):
            if len(t.shape) != 2:
                raise ValueError(f"mm: {name} must be 2-D, got shape {tuple(t.shape)}; use matmul for other ranks")


class DenseSparseMM(DenseSparseMatmul):
    """``torch.mm(x, W)`` with a sparse second operand."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Layout) -> Tensor:
        _MM2D.check(x, w)
        return DenseSparseMatmul.forward(ctx, x, w)


class SparseDenseMM(SparseDenseMatmul):
    """``torch.mm(W, x)`` with a sparse first operand."""

    @staticmethod
    def forward(ctx, w: Layout, x: Tensor) -> Tensor:
        _MM2D.check(w, x)
        return SparseDenseMatmul.forward(ctx, w, x)


class DenseSparseAddmm:
    """``beta * input + alpha * (mat1 @ W)`` with a sparse 2-D ``mat2 = W``."""

    @staticmethod
    def forward(ctx, inp: Tensor, x: Tensor, w: Layout, beta=1, alpha=1) -> Tensor:
        _MM2D.check(x, w)
        ctx.w, ctx.beta, ctx.alpha = w, beta, alpha
        ctx.inp_shape = inp.shape
        ctx.save_for_backward(x)
        prod = mm_w(x, w)
        if alpha != 1:
            prod = prod * alpha
        if beta == 0:  # like torch: input is ignored (nan/inf in it do not propagate)
            return prod + torch.zeros_like(inp)
        return prod + (inp if beta == 1 else inp * beta)

    @staticmethod
    def backward(ctx, g: Tensor):
        (x,) = ctx.saved_tensors
        w = ctx.w
        need_i, need_x, need_w = ctx.needs_input_grad[:3]
        gi = (g * ctx.beta).sum_to_size(ctx.inp_shape) if need_i else None
        ga = g * ctx.alpha if ctx.alpha != 1 else g
        gx = mm_wt(ga, w) if need_x else None
        gw = masked_mm(w, x.t(), ga) if need_w else None
        return gi, gx, gw


class DenseSparseBmm:
    """``torch.bmm(x, W)`` for dense ``x`` (B, N, K) and a 3-D Masked/COO ``W`` (B, K, M); computed on the
    materialised ``W`` (the batch of small products gains nothing from a sparse kernel)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Layout) -> Tensor:
        if x.dim() != 3 or len(w.shape) != 3:
            raise ValueError(f"bmm: both operands must be 3-D, got {tuple(x.shape)} and {tuple(w.shape)}")
        wd = dense_weight(w)
        ctx.w = w
        ctx.save_for_backward(x)
        return torch.bmm(x, wd)

    @staticmethod
    def backward(ctx, g: Tensor):
        (x,) = ctx.saved_tensors
        w = ctx.w
        need_x, need_w = ctx.needs_input_grad[:2]
        gx = torch.bmm(g, dense_weight(w).transpose(1, 2)) if need_x else None
        gw = torch.bmm(x.transpose(1, 2), g).mul_(w.mask()) if need_w else None
        return gx, gw


def _register() -> None:
    for lay in MATRIX_LAYOUTS:
        tag = f"[{lay.name}]"
        register_impl(
            "matmul", (None, lay), DenseSparseMatmul.forward, DenseSparseMatmul.backward, name="DenseSparseMatmul" + tag
        )
        register_impl(
            "matmul", (lay, None), SparseDenseMatmul.forward, SparseDenseMatmul.backward, name="SparseDenseMatmul" + tag
        )
        register_impl("mm", (None, lay), DenseSparseMM.forward, DenseSparseMM.backward, name="DenseSparseMM" + tag)
        register_impl("mm", (lay, None), SparseDenseMM.forward, SparseDenseMM.backward, name="SparseDenseMM" + tag)
        register_impl(
            "addmm",
            (None, None, lay),
            DenseSparseAddmm.forward,
            DenseSparseAddmm.backward,
            name="DenseSparseAddmm" + tag,
        )
    for lay in (Masked, COO):
        register_impl(
            "bmm", (None, lay), DenseSparseBmm.forward, DenseSparseBmm.backward, name=f"DenseSparseBmm[{lay.name}]"
        )


_register()
