"""bf16 operands for the union kernels: the forward and the input gradients under bf16 autocast.

Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` a conv takes bf16 activations and the bf16-rounded
weight, accumulates in fp32 and returns bf16. The union path does the same where the CPU has AVX512-BF16
(``csrc/adaptive_union_bf16.cpp``): the operand of relu(x) (or of dY) is kept in bf16 with its bitmask, the
weight is rounded to bf16 and packed as :func:`~sparsa.kernels.adaptive_union.union_packs` packs it, with
adjacent input channels paired, and one ``VDPBF16PS`` multiplies 16 output channels by a pixel's pair of
channels. A pair runs when either of its channels is nonzero somewhere in the group of 4 pixels.

Elsewhere the same functions run their PyTorch fallback with the same semantics (the fp32 conv of the
bf16 values and the bf16-rounded weight, rounded once). The input gradient at relu(x)'s nonzeros
(:func:`union_conv_igrad_x_bf16`) pairs adjacent output channels of dY and of the weight rows instead, and the
weight gradient over relu(x)'s mask (:func:`union_conv_wgrad_bf16`) pairs the pixels of a group. The other
weight-gradient kernels are fp32: :func:`widened` gives them the operand in fp32.

Example::

    >>> import torch
    >>> from sparsa.kernels import adaptive_union as U, adaptive_union_bf16 as B
    >>> x = torch.randn(2, 16, 6, 6).bfloat16(); w = torch.randn(32, 16, 3, 3)
    >>> geo = U.geometry(x.shape, w.shape, (1, 1), (1, 1), (1, 1))
    >>> y = B.union_conv_fwd_bf16(B.union_operand_bf16(x), w, None, geo)
    >>> ref = torch.nn.functional.conv2d(x.float().relu(), w.bfloat16().float(), padding=1)
    >>> y.dtype, torch.allclose(y.float(), ref, rtol=2**-7, atol=1e-2)
    (torch.bfloat16, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from . import adaptive_union_ops as _ops
from .adaptive import _cached_pack, _conv_args, conv_backward, igrad_dy_geometry
from .adaptive_union import (
    UnionOperand,
    _check_group,
    _wgrad_reference,
    igrad_x_lists,
    union_dpbf16,
    union_operand,
    union_supported,
)
from .geometry import ConvGeometry

__all__ = [
    "union_dpbf16",
    "union_supported_bf16",
    "union_operand_bf16",
    "union_pair_packs",
    "PairPacks",
    "union_conv_fwd_bf16",
    "union_conv_igrad_bf16",
    "union_conv_igrad_x_bf16",
    "widened",
    "union_conv_wgrad_bf16",
]

BF16 = torch.bfloat16


def union_supported_bf16(C: int, O: int) -> bool:
    """Whether the native bf16 kernels take a conv with ``C`` input and ``O`` output channels."""
    return union_dpbf16() and union_supported(C, O)


def union_operand_bf16(x: Tensor, relu: bool = True, native: Optional[bool] = None) -> UnionOperand:
    """The bf16 operand of ``x`` (logical ``[N, C, H, W]`` bfloat16, any strides):
    :func:`~sparsa.kernels.adaptive_union.union_operand` with ``dtype=torch.bfloat16``."""
    return union_operand(x, relu, native, dtype=BF16)


def widened(op: UnionOperand) -> UnionOperand:
    """``op`` with float32 values (same mask and counts), for the fp32 union kernels."""
    if op.values.dtype == torch.float32:
        return op
    return UnionOperand(op.values.float(), op.mask, op.nnz, op.union4)


# id(weight) -> (weakref, key, PairPacks): the packs of the bf16-rounded weight, once per weight version
_PAIR_PACKS: dict = {}


@dataclass
class PairPacks:
    """The packs of a float32 weight ``[O, C, KH, KW]`` rounded to bf16: ``wc``, the bf16 ``[C, KH, KW, O]`` rows
    of :func:`union_conv_igrad_x_bf16`; ``wf2`` and ``wfl2``, the forward and flipped packs in bf16 with adjacent
    input channels paired (``wfl2`` None until asked for). Made in one native pass from the weight
    (``adaptive_union_pair_packs``), no fp32 pack in between."""

    wc: Tensor
    wf2: Tensor
    wfl2: Optional[Tensor]


def union_pair_packs(weight: Tensor, flipped: bool = True) -> PairPacks:
    """The :class:`PairPacks` of ``weight``, cached per tensor and version like
    :func:`~sparsa.kernels.adaptive_union.union_packs`; ``flipped=False`` leaves ``wfl2`` out unless cached
    already."""

    def build(w: Tensor) -> PairPacks:
        wf2, wfl2, wc = _ops.union_pair_packs(w.detach().float(), True, flipped)
        return PairPacks(wc, wf2, wfl2 if flipped else None)

    packs = _cached_pack(_PAIR_PACKS, weight, build)
    if flipped and packs.wfl2 is None:  # asked for later: the flipped pack alone
        packs.wfl2 = _ops.union_pair_packs(weight.detach().float(), False, True)[1]
    return packs


def _native_for(op: UnionOperand, C: int, O: int) -> bool:
    return op.mask is not None and op.values.dtype == BF16 and union_supported_bf16(C, O)


def _rounded(weight: Tensor) -> Tensor:
    return weight.detach().to(BF16).float()


def union_conv_fwd_bf16(
    op: UnionOperand,
    weight: Tensor,
    bias: Optional[Tensor],
    geo: Sequence[int],
    group: int = 4,
    wf2: Optional[Tensor] = None,
) -> Tensor:
    """``conv2d`` of the bf16 operand ``op`` with the float32 ``weight`` rounded to bf16 (and the float32
    ``bias``), accumulated in fp32 and rounded to bf16 once: ``[N, O, Ho, Wo]`` bf16, channels-last strides.
    ``wf2``: the weight's paired pack (:func:`union_pair_packs`) when at hand. ``group``: as
    :func:`~sparsa.kernels.adaptive_union.union_conv_fwd`."""
    _check_group(group)
    G = ConvGeometry.of(geo)
    if not _native_for(op, G.C, G.O):
        b = None if bias is None else bias.detach().float()
        y = F.conv2d(op.nchw().float(), _rounded(weight), b, **_conv_args(G))
        return y.to(BF16).contiguous(memory_format=torch.channels_last)
    wf2 = union_pair_packs(weight, flipped=False).wf2 if wf2 is None else wf2
    return _ops.union_conv_fwd(op.values, op.mask, wf2, None if bias is None else bias.detach(), G, None, 1, group)


def union_conv_igrad_bf16(
    gop: UnionOperand,
    weight: Optional[Tensor],
    xop: UnionOperand,
    geo: Sequence[int],
    wfl2: Optional[Tensor] = None,
    group: int = 4,
) -> Tensor:
    """The input gradient of the stride-1 ``conv2d(relu(x), weight)`` from the bf16 operand of dY (``gop``,
    ``relu=False``), kept where relu(x) (``xop``) is nonzero: ``[N, C, H, W]`` bf16, channels-last strides.
    ``wfl2``: the weight's paired flipped pack (:func:`union_pair_packs`) when at hand (then ``weight`` may be
    None)."""
    _check_group(group)
    G = ConvGeometry.of(geo)
    if not G.stride1:
        raise ValueError(f"union_conv_igrad_bf16 needs a stride-1 geometry, got {G}")
    if weight is None and wfl2 is None:
        raise ValueError("union_conv_igrad_bf16 needs weight or wfl2")
    if not (_native_for(gop, G.O, G.C) and xop.mask is not None):
        if weight is None:
            raise ValueError("union_conv_igrad_bf16: the PyTorch fallback needs weight (wfl2 is the native pack)")
        xs = xop.nchw()
        dx = conv_backward(gop.nchw().float(), xs.float(), _rounded(weight), G, [True, False, False])[0]
        dx = torch.where(xs != 0, dx, torch.zeros(()))
        return dx.to(BF16).contiguous(memory_format=torch.channels_last)
    wfl2 = union_pair_packs(weight, flipped=True).wfl2 if wfl2 is None else wfl2
    return _ops.union_conv_fwd(gop.values, gop.mask, wfl2, None, igrad_dy_geometry(G), xop.mask, 0, group)


def union_conv_igrad_x_bf16(
    xop: UnionOperand,
    dy_nhwc: Tensor,
    geo: Sequence[int],
    weight: Optional[Tensor] = None,
    wc: Optional[Tensor] = None,
    lists: Optional[bool] = None,
) -> Tensor:
    """The input gradient of ``conv2d(relu(x), W)`` (any stride) at relu(x)'s nonzeros (``xop``'s mask) from the
    bf16 output gradient ``dy_nhwc`` (``[N, Ho, Wo, O]``): ``[N, C, H, W]`` bf16, channels-last strides. ``wc``:
    the bf16 ``[C, KH, KW, O]`` rows of the bf16-rounded weight (from :class:`PairPacks`' ``wf`` by
    :func:`~sparsa.kernels.adaptive_union.union_wc`); built from ``weight`` when not given. ``lists``: as
    :func:`~sparsa.kernels.adaptive_union.union_conv_igrad_x`."""
    G = ConvGeometry.of(geo)
    if wc is None and weight is None:
        raise ValueError("union_conv_igrad_x_bf16 needs weight or wc")
    if not (xop.mask is not None and dy_nhwc.dtype == BF16 and union_supported_bf16(G.C, G.O)):
        if weight is None:
            raise ValueError("union_conv_igrad_x_bf16: the PyTorch fallback needs weight (wc is the native pack)")
        xs = xop.nchw()
        dx = conv_backward(dy_nhwc.permute(0, 3, 1, 2).float(), xs.float(), _rounded(weight), G, [True, False, False])[
            0
        ]
        return torch.where(xs != 0, dx, torch.zeros(())).to(BF16).contiguous(memory_format=torch.channels_last)
    if wc is None:
        wc = union_pair_packs(weight, flipped=False).wc
    lists = igrad_x_lists(xop.union_ratio()) if lists is None else bool(lists)
    return _ops.union_conv_igrad_x(xop.mask, dy_nhwc, wc, G, lists)


def union_conv_wgrad_bf16(
    xop: UnionOperand, dy_nhwc: Tensor, geo: Sequence[int], w_stride: Optional[Sequence[int]] = None
) -> Tensor:
    """``dW [O, C, KH, KW]`` (float32) of ``conv2d(relu(x), W)`` (any stride) over the bf16 operand ``xop``'s mask
    and the bf16 output gradient ``dy_nhwc`` (``[N, Ho, Wo, O]``), accumulated in fp32. ``w_stride``: strides to
    give ``dW``."""
    G = ConvGeometry.of(geo)
    if not (xop.mask is not None and xop.values.dtype == BF16 and union_supported_bf16(G.C, G.O)):
        return _wgrad_reference(xop.nchw().float(), dy_nhwc.float(), G, w_stride)
    return _ops.union_conv_wgrad(
        xop.values, xop.mask, dy_nhwc.to(BF16), G, None if w_stride is None else list(w_stride), False
    )
