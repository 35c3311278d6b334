"""``F.linear(x, W, b)`` with a sparse weight ``W`` (out, in): forward and backward in pure PyTorch.

``y = x @ W^T + b`` for ``x`` of any leading dims (non-contiguous is fine). Backward computes only what
``ctx.needs_input_grad`` asks for: ``grad_x = grad @ W``, ``grad_W = grad^T @ x`` restricted to the
stored pattern (a dense tensor of W's shape, zero elsewhere), ``grad_b = grad.sum()``. The products use
the primitives of :mod:`sparsa.ops.matmul` (torch.sparse for CSR/COO, BLAS on the materialised weight
for the structured layouts).

>>> import torch, sparsa
>>> w = sparsa.to_sparse(torch.randn(8, 16), sparsa.layouts.NM, n=2, m=4)
>>> x = torch.randn(3, 16)
>>> torch.allclose(torch.nn.functional.linear(x, w), x @ w.to_dense().t(), atol=1e-6)
True
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from ..layouts import Layout
from .matmul import MATRIX_LAYOUTS, masked_mm, mm_w, mm_wt
from .registry import register_impl

__all__ = ["SparseWeightLinear"]


class SparseWeightLinear:
    """The dispatcher implementation of ``linear`` for a dense input and a sparse 2-D weight."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Layout, b: Optional[Tensor]) -> Tensor:
        if len(w.shape) != 2:
            raise ValueError(f"linear: weight must be 2-D (out, in), got shape {tuple(w.shape)}")
        out_f, in_f = w.shape
        if x.dim() < 1 or x.shape[-1] != in_f:
            raise ValueError(
                f"linear: input's last dim must equal the weight's in_features {in_f}, got input shape {tuple(x.shape)}"
            )
        flat = x.dim() != 2  # a 2-D input needs no reshape (a view costs a few microseconds per call)
        y2 = mm_wt(x.reshape(-1, in_f) if flat else x, w)
        if b is not None:
            y2 = y2 + b
        ctx.w = w
        ctx.save_for_backward(x)
        return y2.reshape(tuple(x.shape[:-1]) + (out_f,)) if flat else y2

    @staticmethod
    def backward(ctx, g: Tensor):
        (x,) = ctx.saved_tensors
        w = ctx.w
        out_f, in_f = w.shape
        need_x, need_w, need_b = (tuple(ctx.needs_input_grad) + (False,) * 3)[:3]
        g2 = g.reshape(-1, out_f)
        gx = mm_w(g2, w).reshape(x.shape) if need_x else None
        gw = masked_mm(w, g2.t(), x.reshape(-1, in_f)) if need_w else None
        gb = g2.sum(0) if need_b else None
        return gx, gw, gb


for _lay in MATRIX_LAYOUTS:
    register_impl(
        "linear",
        (None, _lay, None),
        SparseWeightLinear.forward,
        SparseWeightLinear.backward,
        name=f"SparseWeightLinear[{_lay.name}]",
    )
