"""``F.linear`` with a Bitmask weight: the decode (stream) and prefill (expand) kernels, forward and backward.

Registered with the dispatcher, so ``F.linear(x, sparse_weight, bias)`` (and every ``nn.Linear`` of a
model sparsified into the ``"bitmask"`` layout, e.g. a decoder LLM under ``model.generate()``) runs the
kernels of :mod:`sparsa.kernels.bitmask`::

    >>> import torch, sparsa
    >>> w = sparsa.to_sparse(torch.randn(64, 32), "bitmask", sparsity=0.5)
    >>> x = torch.randn(1, 32)
    >>> torch.allclose(torch.nn.functional.linear(x, w), x @ w.to_dense().T, atol=1e-4)
    True

Backward: ``grad_x = grad_y @ W`` and ``grad_W`` on the kept pattern (a dense tensor of W's shape, zero
elsewhere), dense products: the layout is built for inference, training runs correctly but not fast.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from ..kernels import bitmask as _bm
from ..layouts.bitmask import Bitmask
from ..layouts.dense import Dense
from .native_linear import _check_input
from .registry import implements

__all__ = ["BitmaskLinear"]


@implements("linear", (Dense, Bitmask, Dense))
class BitmaskLinear:
    """``y = x @ W.T + b`` for a :class:`~sparsa.layouts.Bitmask` weight."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Bitmask, bias: Optional[Tensor] = None) -> Tensor:
        _check_input(x, w, bias)
        y = _bm.linear_forward(x, w.bits, w.row_ptr, w.values, bias, w.shape[0])
        ctx.save_for_backward(x, w.bits, w.row_ptr, w.values)
        ctx.weight_shape = tuple(w.shape)
        return y

    @staticmethod
    def backward(ctx, gy: Tensor):
        x, bits, row_ptr, values = ctx.saved_tensors
        nx, nw, nb = (tuple(ctx.needs_input_grad) + (False,) * 3)[:3]
        R, K = ctx.weight_shape
        g2 = gy.reshape(-1, R)
        w = Bitmask(bits, row_ptr, values, (R, K), validate=False)
        gx = gw = gb = None
        if nx:
            gx = (g2 @ w.to_dense().to(g2.dtype)).reshape(x.shape)
        if nw:
            gw = (g2.t() @ x.reshape(-1, K).to(g2.dtype)) * w.mask()
        if nb:
            gb = g2.sum(0)
        return gx, gw, gb
