"""``F.linear`` with an N:M weight on the CPU: the Bitmask kernels on the layout's own values.

An N:M weight's stored values, row by row, are already packed in ascending column order, which is what the
Bitmask layout stores; only its bit rows are missing. They are built once from ``indices`` and cached on
the layout (``ceil(K / 8)`` bytes a row), so ``F.linear(x, nm_weight, bias)`` runs
:func:`sparsa.kernels.bitmask.linear_forward`: the stream kernel for a few tokens (decode), the
expand or bf16 panel kernel for many (prefill, encoders), instead of materialising the dense weight on
every call (a 2:4 weight with many bfloat16 tokens: the 2:4 kernel, the ``"nm24"`` strategy)::

    >>> import torch, sparsa
    >>> w = sparsa.to_sparse(torch.randn(64, 32), "nm", n=2, m=4)
    >>> x = torch.randn(3, 32)
    >>> torch.allclose(torch.nn.functional.linear(x, w), x @ w.to_dense().T, atol=1e-4)
    True

Replaces the pure-PyTorch registration of :mod:`sparsa.ops.linear` for this layout (CUDA inputs still take
the GPU implementations first). Backward as for Bitmask: dense products, ``grad_W`` on the stored pattern.
"""

from __future__ import annotations

from typing import Optional, Tuple

from torch import Tensor

from ..kernels import bitmask as _bm
from ..layouts.dense import Dense
from ..layouts.nm import NM
from .bitmask_linear import BitmaskLinear
from .native_linear import _check_input
from .registry import implements

__all__ = ["NMLinear", "nm_bitmask_components"]


def nm_bitmask_components(w: NM) -> Tuple[Tensor, Tensor, Tensor]:
    """``(bits, row_ptr, values)`` of a 2-D N:M weight in the Bitmask layout's terms. ``values`` is a view
    of ``w.values`` (in-place updates reach the kernels) unless the last group is padded past ``K``, whose
    stored padding positions are dropped by a copy per call; the bits and row offsets depend on
    ``indices`` only and are cached on the layout (:meth:`~sparsa.layouts.NM.bitmask_rows`)."""
    bits, row_ptr = w.bitmask_rows()
    R, K = w.shape
    values = w.values.reshape(R, -1)
    if K % w.m:
        real = w._positions().reshape(R, -1) < K
        values = values[real].reshape(R, -1)  # every row drops the same padding positions (see NM)
    return bits, row_ptr, values.reshape(-1)


@implements("linear", (Dense, NM, Dense), replace=True)
class NMLinear:
    """``y = x @ W.T + b`` for an :class:`~sparsa.layouts.NM` weight, by the Bitmask kernels."""

    @staticmethod
    def forward(ctx, x: Tensor, w: NM, bias: Optional[Tensor] = None) -> Tensor:
        bits, row_ptr, values = nm_bitmask_components(w)
        _check_input(x, w, bias)
        y = _bm.linear_forward(x, bits, row_ptr, values, bias, w.shape[0])
        ctx.save_for_backward(x, bits, row_ptr, values)
        ctx.weight_shape = tuple(w.shape)
        return y

    backward = staticmethod(BitmaskLinear.backward)
