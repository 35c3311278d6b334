"""``F.conv2d`` / ``F.linear`` whose input is a compacted ReLU activation (the ``relu_compact`` layout).

The input is ``relu(x)`` stored as :class:`~sparsa.layouts.ReluCompact`; weight and bias are dense.
On the CPU the call runs the activation-sparse training kernels of :mod:`sparsa.adaptive`
(:func:`~sparsa.adaptive.relu_conv2d` / :func:`~sparsa.adaptive.relu_linear`): forward and weight
gradient over the nonzeros of ``relu(x)``, input gradient only on its pattern. Shapes those kernels
do not take (grouped or string-padded convolutions, dtypes other than float32/float64), and a ``relu(x)``
denser than the op's crossover on this CPU (``relu_compact.linear`` / ``relu_compact.conv2d`` in
:mod:`sparsa.crossovers`, measured by ``sparsa cost --refit``), run the dense op on ``relu(x)``:
the same result.

On a GPU the same user call maps onto the ``Masked`` route: the layout converts to
:class:`~sparsa.layouts.Masked` and :class:`~sparsa.ops.gpu_impls.ActSparseLinear` /
:class:`~sparsa.ops.gpu_impls.ActSparseConv2d` run (sparsa's Triton kernels where they apply, else
their PyTorch reference). Building the layout on a GPU compacts on the CPU, so on CUDA pass
``"masked"`` directly (``sparsa.to_sparse(torch.relu(z), "masked")``).

Example::

    >>> import torch, torch.nn.functional as F, sparsa
    >>> z = torch.randn(2, 8, 6, 6); w = torch.randn(16, 8, 3, 3)
    >>> a = sparsa.to_sparse(z, "relu_compact")                  # relu(z), compacted
    >>> with sparsa.strict():                                      # no dense fallback
    ...     y = F.conv2d(a, w, padding=1)
    >>> torch.allclose(y, F.conv2d(z.relu(), w, padding=1), atol=1e-4)
    True
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..adaptive.conv import (
    _pair,
    compacted_conv_backward,
    compacted_conv_forward,
    compacted_path_supported,
    conv_supported,
    relu_conv2d,
)
from ..adaptive.linear import (
    compacted_linear_backward,
    compacted_linear_forward,
    compacted_linear_supported,
    relu_linear,
)
from ..kernels.adaptive import safe_dilation
from ..layouts.base import mark_restricted
from ..layouts.dense import Dense
from ..layouts.relu_compact import ReluCompact, relu_compact_to_masked
from .gpu_impls import ActSparseConv2d, ActSparseLinear
from ..crossovers import crossover
from .registry import register_impl

__all__ = ["ReluCompactLinear", "ReluCompactConv2d"]

_KERNEL_DTYPES = (torch.float32, torch.float64)


def _on_gpu(x: ReluCompact) -> bool:
    """Whether the call takes the GPU route (the Masked implementations)."""
    return x.val.device.type != "cpu"


def _needs(ctx: Any, i: int) -> bool:
    n = getattr(ctx, "needs_input_grad", ())
    return len(n) > i and bool(n[i])


def _kernel_dtypes(*ts: Optional[Tensor]) -> bool:
    return all(t is None or (t.dtype in _KERNEL_DTYPES and t.device.type == "cpu") for t in ts)


def _dense_wins(x: ReluCompact, name: str) -> bool:
    """Whether relu(x) is too dense for the sparse kernels to beat the dense op on this CPU: its density
    above the crossover ``name`` (a default until ``sparsa cost --refit`` measures it here)."""
    n = x.numel
    return n > 0 and x.nnz / n > crossover(name)


def _run(ctx: Any, a: Tensor, w: Tensor, b: Optional[Tensor], fn) -> Tensor:
    """``fn(a, w, b)`` with gradients for the arguments ``ctx`` asks for: a small autograd graph built
    here (the kernels' own autograd Functions), differentiated in :func:`_backward`."""
    want = tuple(_needs(ctx, i) for i in range(3))
    if not any(want):
        with torch.no_grad():
            return fn(a, w.detach(), None if b is None else b.detach())
    with torch.enable_grad():
        leaves = (
            a.detach().requires_grad_(want[0]),
            w.detach().requires_grad_(want[1]),
            None if b is None else b.detach().requires_grad_(want[2]),
        )
        out = fn(*leaves)
    ctx.graph = (out, leaves)
    return out.detach()


def _backward(ctx: Any, g: Tensor):
    delegate = getattr(ctx, "sparsa_delegate", None)
    if delegate is not None:
        return delegate.backward(ctx, g)
    out, leaves = ctx.graph
    idx = [i for i, t in enumerate(leaves) if t is not None and t.requires_grad]
    # retained: a second backward through the outer graph (retain_graph, gradcheck) runs this again
    got = torch.autograd.grad(out, [leaves[i] for i in idx], g, retain_graph=True)
    grads: list = [None, None, None]
    for i, t in zip(idx, got):
        grads[i] = t
    return tuple(grads)


def _on_pattern(ctx: Any, grads: tuple) -> tuple:
    """The kernels' input gradient is zero off relu(x)'s pattern (they apply the ReLU derivative): marked
    so, ``to_sparse``'s backward does not mask it a second time."""
    if grads and grads[0] is not None:
        mark_restricted(grads[0], ctx.sparsa_input)
    return grads


class _CompactedLinear:
    """Backward of the compacted forward (no inner autograd graph: the kernels' state is on ``ctx``)."""

    @staticmethod
    def backward(ctx: Any, g: Tensor):
        return _on_pattern(ctx, compacted_linear_backward(ctx, g))


class _CompactedConv2d:
    @staticmethod
    def backward(ctx: Any, g: Tensor):
        return _on_pattern(ctx, compacted_conv_backward(ctx, g))


class ReluCompactLinear:
    """``linear(relu(x), W, b)`` for a ReluCompact ``x``: :func:`~sparsa.adaptive.relu_linear` on the CPU."""

    @staticmethod
    def forward(ctx: Any, x: ReluCompact, w: Tensor, b: Optional[Tensor] = None) -> Tensor:
        if _on_gpu(x):
            ctx.sparsa_delegate = ActSparseLinear
            return ActSparseLinear.forward(ctx, relu_compact_to_masked(x), w, b)
        if len(x.shape) == 2 and w.dim() == 2 and w.shape[1] == x.shape[1] and _kernel_dtypes(x.val, w, b):
            if _dense_wins(x, "relu_compact.linear"):
                return _run(ctx, x.to_dense(), w, b, F.linear)
            if compacted_linear_supported(x.val.dtype, x.val.device, w, b):
                ctx.sparsa_delegate, ctx.sparsa_input = _CompactedLinear, x
                return compacted_linear_forward(ctx, x.shape[0], x.cnt, x.idx, x.val, w, b, x.slice)
        a = x.to_dense()
        if not _kernel_dtypes(a, w, b) or w.dim() != 2:
            return _run(ctx, a, w, b, F.linear)
        return _run(ctx, a, w, b, lambda a, w, b: relu_linear(a, w, b, slice=x.slice))

    backward = staticmethod(_backward)


class ReluCompactConv2d:
    """``conv2d(relu(x), W, b, ...)`` for a ReluCompact ``x``: :func:`~sparsa.adaptive.relu_conv2d` on the CPU."""

    @staticmethod
    def forward(
        ctx: Any, x: ReluCompact, w: Tensor, b: Optional[Tensor] = None, stride=1, padding=0, dilation=1, groups=1
    ) -> Tensor:
        if _on_gpu(x):
            ctx.sparsa_delegate = ActSparseConv2d
            return ActSparseConv2d.forward(ctx, relu_compact_to_masked(x), w, b, stride, padding, dilation, groups)
        supported = (
            len(x.shape) == 4
            and _kernel_dtypes(x.val, w, b)
            and conv_supported(w, groups, "zeros", padding)
            and w.shape[1] == x.shape[1]
        )
        dense = not supported or _dense_wins(x, "relu_compact.conv2d")
        if not dense and compacted_path_supported(x.val.dtype, x.val.device, w, b):
            ctx.sparsa_delegate, ctx.sparsa_input = _CompactedConv2d, x
            return compacted_conv_forward(ctx, x.shape, x.cnt, x.idx, x.val, w, b, stride, padding, dilation, x.slice)
        a = x.to_dense()
        if dense:
            dil = safe_dilation(*w.shape[-2:], *_pair(dilation, "dilation")) if w.dim() == 4 else dilation
            return _run(ctx, a, w, b, lambda a, w, b: F.conv2d(a, w, b, stride, padding, dil, groups))
        return _run(
            ctx,
            a,
            w,
            b,
            lambda a, w, b: relu_conv2d(a, w, b, stride, padding, dilation, slice=x.slice, nonnegative=True),
        )

    backward = staticmethod(_backward)


register_impl(
    "linear",
    (ReluCompact, Dense, Dense),
    ReluCompactLinear.forward,
    ReluCompactLinear.backward,
    name="ReluCompactLinear",
)
register_impl(
    "conv2d",
    (ReluCompact, Dense, Dense),
    ReluCompactConv2d.forward,
    ReluCompactConv2d.backward,
    name="ReluCompactConv2d",
)
