"""``relu_conv2d``: ``conv2d(relu(x), W, b)`` with all three training GEMMs exploiting relu(x)'s zeros.

Forward compacts ``relu(x)`` once (fused ReLU + compaction) and runs the gather kernel; backward
reuses the same compacted operand for the weight gradient and computes the input gradient only
where ``relu(x) != 0`` (elsewhere the ReLU's derivative is zero anyway), so the result is the exact
gradient of ``conv2d(relu(x), W, b)``. When ``x`` already is a ReLU output, ``relu(x) == x``.

Example::

    >>> import torch
    >>> from sparsa.adaptive import relu_conv2d
    >>> x = torch.randn(2, 8, 6, 6, requires_grad=True); w = torch.randn(16, 8, 3, 3)
    >>> y = relu_conv2d(x, w, None, padding=1)
    >>> torch.allclose(y, torch.nn.functional.conv2d(x.relu(), w, padding=1), atol=1e-4)
    True
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from ..kernels import adaptive as _k
from .compaction import DEFAULT_SLICE

__all__ = ["relu_conv2d", "conv_supported"]

IntOr2 = Union[int, Sequence[int]]


def _pair(v: IntOr2, name: str):
    if isinstance(v, int):
        return (v, v)
    t = tuple(int(i) for i in v)
    if len(t) != 2:
        raise ValueError(f"{name} must be an int or a pair, got {v!r}")
    return t


def conv_supported(weight: Tensor, groups: int = 1, padding_mode: str = "zeros",
                   padding: object = 0) -> bool:
    """Whether the native sparse path handles this conv (else the layer stays dense)."""
    return (groups == 1 and padding_mode == "zeros" and not isinstance(padding, str)
            and weight.dim() == 4 and weight.shape[0] % 8 == 0)


class _ReluConv2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, geo, stats):
        cnt, idx, val = _k.compact(x.detach(), geo[15])
        b = None if bias is None else bias.detach()
        # native fast path: the weight packed once per parameter version (cached), dY padding and the
        # weight gradient's [O, C, KH, KW] layout inside the stride-1 backward kernel
        packed = _k.packed_supported(x, weight, bias) and geo[4] % 8 == 0
        if packed:
            wf, wc = _k.packed_weight(weight)
            y = _k.conv_fwd_packed(cnt, idx, val, wf, b, geo, 1)
            wsave = wc if _k._stride1(geo) else weight.detach()
        else:
            wsave = weight.detach().permute(2, 3, 1, 0).contiguous()
            y = _k.conv_fwd(cnt, idx, val, wsave, b, geo, 1)
        if stats is not None:
            stats["nnz"] = cnt
        ctx.geo = geo
        ctx.channels_last = x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) \
            and not x.is_contiguous()
        ctx.has_bias = bias is not None
        ctx.packed = packed
        ctx.w_stride = tuple(weight.stride())
        ctx.save_for_backward(cnt, idx, val, wsave)
        return y

    @staticmethod
    def backward(ctx, gy):
        cnt, idx, val, w = ctx.saved_tensors
        g = gy.permute(0, 2, 3, 1).contiguous()
        dx = dw = db = None
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if ctx.packed and _k._stride1(ctx.geo):
            if need_dx or need_dw:
                dx, dw = _k.conv_bwd_packed(cnt, idx, val, g, w, ctx.geo, ctx.channels_last, need_dx, need_dw,
                                            ctx.w_stride)
        else:
            wt = w.permute(2, 3, 1, 0).contiguous() if ctx.packed else w
            if need_dx and need_dw:
                dx, dwt = _k.conv_bwd(cnt, idx, val, g, wt, ctx.geo, ctx.channels_last)
                dw = dwt.permute(3, 2, 0, 1)
            elif need_dx:
                dx = _k.conv_igrad(cnt, idx, val, g, wt, ctx.geo, ctx.channels_last)
            elif need_dw:
                dw = _k.conv_wgrad(cnt, idx, val, g, ctx.geo).permute(3, 2, 0, 1)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.sum((0, 1, 2))
        return dx, dw, db, None, None


def relu_conv2d(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, stride: IntOr2 = 1,
                padding: IntOr2 = 0, dilation: IntOr2 = 1, slice: int = DEFAULT_SLICE,
                stats: Optional[dict] = None) -> Tensor:
    """``F.conv2d(relu(x), weight, bias, stride, padding, dilation)`` through the sparse kernels.

    ``stats``, if given, receives ``"nnz"``: the per-(pixel, slice) nonzero counts of ``relu(x)``.
    The result is ``[N, O, Ho, Wo]`` with channels-last strides.
    """
    if x.dim() != 4:
        raise ValueError(f"x must be 4-D [N, C, H, W], got shape {tuple(x.shape)}")
    if weight.dim() != 4:
        raise ValueError(f"weight must be 4-D [O, C, KH, KW], got shape {tuple(weight.shape)}")
    geo = _k.geometry(x.shape, weight.shape, _pair(stride, "stride"), _pair(padding, "padding"),
                      _pair(dilation, "dilation"), slice)
    return _ReluConv2d.apply(x, weight, bias, geo, stats)
