"""``relu_linear``: ``linear(relu(x), W, b)`` with all three training GEMMs exploiting relu(x)'s zeros.

A Linear layer is the 1x1 convolution of a ``[P, K]`` matrix seen as one ``P x 1`` image with ``K``
channels, so it runs the same kernels as :func:`~sparsa.adaptive.relu_conv2d` (the union kernels
where supported, else the list kernels): forward and weight gradient from the sparse ``relu(x)``,
input gradient only where ``relu(x) != 0``.

Example::

    >>> import torch
    >>> from sparsa.adaptive import relu_linear
    >>> x = torch.randn(4, 32, requires_grad=True); w = torch.randn(16, 32)
    >>> torch.allclose(relu_linear(x, w), x.relu() @ w.T, atol=1e-4)
    True
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import Tensor

from ..kernels import adaptive as _k
from ..kernels.geometry import ConvGeometry
from .compaction import DEFAULT_SLICE
from .conv_union import UnionReluConv2d, union_path_supported, union_path_supported_for

__all__ = ["relu_linear", "linear_supported"]


def linear_supported(weight: Tensor) -> bool:
    """Whether the native sparse path handles this Linear (else the layer stays dense)."""
    return weight.dim() == 2 and weight.shape[0] % 8 == 0


def _geo(P: int, K: int, O: int, slice: int) -> ConvGeometry:
    """A linear layer as a 1x1 conv of the input ``[1, K, P, 1]``."""
    return ConvGeometry(
        N=1, C=K, H=P, W=1, O=O, KH=1, KW=1, Ho=P, Wo=1, sh=1, sw=1, ph=0, pw=0, dh=1, dw=1, slice=slice
    )


def _linear_forward(ctx, cnt, idx, val, P, weight, bias, slice):
    """``linear`` of the compacted ``relu(x)`` (``x`` ``[P, K]`` compacted as the image ``[1, K, P, 1]``);
    fills ``ctx`` for :func:`_linear_backward`."""
    O, K = weight.shape
    geo = _geo(P, K, O, slice)
    wt = weight.detach().t().contiguous().view(1, 1, K, O)
    y = _k.conv_fwd(cnt, idx, val, wt, None if bias is None else bias.detach(), geo, 2)
    ctx.geo = geo
    ctx.has_bias = bias is not None
    ctx.save_for_backward(cnt, idx, val, wt)
    return y


def _linear_backward(ctx, gy):
    """``(dx, dw, db)`` of :func:`_linear_forward` for the arguments ``ctx.needs_input_grad`` asks for."""
    cnt, idx, val, wt = ctx.saved_tensors
    P, K, O = ctx.geo.H, ctx.geo.C, ctx.geo.O
    g = gy.contiguous().view(1, P, 1, O)
    dx = dw = db = None
    if ctx.needs_input_grad[0] and ctx.needs_input_grad[1]:
        dxa, dwt = _k.conv_bwd(cnt, idx, val, g, wt, ctx.geo, True)
        dx, dw = dxa.permute(0, 2, 3, 1).reshape(P, K), dwt.view(K, O).t()
    elif ctx.needs_input_grad[0]:
        dx = _k.conv_igrad(cnt, idx, val, g, wt, ctx.geo, True).permute(0, 2, 3, 1).reshape(P, K)
    elif ctx.needs_input_grad[1]:
        dw = _k.conv_wgrad(cnt, idx, val, g, ctx.geo).view(K, O).t()
    if ctx.has_bias and ctx.needs_input_grad[2]:
        db = gy.sum(0)
    return dx, dw, db


class _ReluLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, slice, stats):
        cnt, idx, val = _k.compact(x2.detach().t().unsqueeze(0).unsqueeze(-1), slice)
        if stats is not None:
            stats["nnz"] = cnt
        return _linear_forward(ctx, cnt, idx, val, x2.shape[0], weight, bias, slice)

    @staticmethod
    def backward(ctx, gy):
        return _linear_backward(ctx, gy) + (None, None)


# id(parameter) -> (weakref, key, a detached [O, K, 1, 1] view of it): the view keys the union kernels'
# weight-pack caches (the view handed to autograd is new each call); rebuilt when the parameter changes
_PACK_VIEWS: Dict[int, tuple] = {}


def _pack_view(weight: Tensor) -> Tensor:
    return _k._cached_pack(_PACK_VIEWS, weight, lambda w: w.unsqueeze(-1).unsqueeze(-1))


def _union_linear(x2: Tensor, weight: Tensor, bias: Optional[Tensor], slice: int, stats: Optional[dict]) -> Tensor:
    """The Linear as the 1x1 conv of the ``[1, K, P, 1]`` image ``x2.t()`` on the union kernels."""
    P, K = x2.shape
    O = weight.shape[0]
    x4 = x2.t().unsqueeze(0).unsqueeze(-1)  # channels-last: every row's features contiguous
    w4 = weight.unsqueeze(-1).unsqueeze(-1)
    y4 = UnionReluConv2d.apply(x4, w4, bias, _geo(P, K, O, slice), stats, _pack_view(weight))
    return y4.squeeze(-1).squeeze(0).t()  # [P, O], contiguous


def relu_linear(
    x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, slice: int = DEFAULT_SLICE, stats: Optional[dict] = None
) -> Tensor:
    """``F.linear(relu(x), weight, bias)`` through the sparse kernels; ``x`` is ``[..., K]``.

    Runs the union kernels of :mod:`sparsa.adaptive.conv_union` (as a 1x1 conv) where they are
    supported, else the list kernels."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [O, K], got shape {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features but weight expects {weight.shape[1]}; pass matching shapes")
    lead = x.shape[:-1]
    y = _step(x.reshape(-1, x.shape[-1]), weight, bias, int(slice), stats)
    return y.reshape(*lead, weight.shape[0])


# As relu_conv2d's step: the kernel family is picked by a native probe and the union kernels key weight packs by
# tensor identity and version (not traceable), so under torch.compile the step runs as in eager, behind a graph break.
@torch.compiler.disable
def _step(x2: Tensor, weight: Tensor, bias: Optional[Tensor], slice: int, stats: Optional[dict]) -> Tensor:
    if x2.shape[0] and union_path_supported(x2.unsqueeze(0).unsqueeze(0), weight.unsqueeze(-1).unsqueeze(-1), bias):
        return _union_linear(x2.contiguous(), weight, bias, slice, stats)
    return _ReluLinear.apply(x2, weight, bias, slice, stats)


@torch.compiler.disable
def compacted_linear_forward(
    ctx,
    P: int,
    cnt: Tensor,
    idx: Tensor,
    val: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    slice: int = DEFAULT_SLICE,
) -> Tensor:
    """``linear(relu(x), weight, bias)`` (``[P, O]``) for a ``[P, K]`` ``relu(x)`` given compacted as the image
    ``[1, K, P, 1]`` (the ReluCompact layout's components); ``ctx`` is filled for
    :func:`compacted_linear_backward`. Callers check :func:`compacted_linear_supported` first."""
    return _linear_forward(ctx, cnt, idx, val, P, weight, bias, slice)


compacted_linear_backward = torch.compiler.disable(_linear_backward)


def compacted_linear_supported(
    dtype: torch.dtype, device: torch.device, weight: Tensor, bias: Optional[Tensor]
) -> bool:
    """Whether :func:`compacted_linear_forward` runs: the union kernels (they read x densely) do not take the shape."""
    return not union_path_supported_for(dtype, device, weight.unsqueeze(-1).unsqueeze(-1), bias)
