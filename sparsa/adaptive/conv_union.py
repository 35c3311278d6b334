"""The bitmask-operand ("union") training path of :func:`~sparsa.adaptive.relu_conv2d`.

Forward: relu(x) is kept dense in NHWC with a per-element nonzero bitmask (one fused pass), and the
union forward kernel runs over groups of 4 output pixels (see :mod:`sparsa.kernels.adaptive_union`).
Backward, from the same operand and dY's bitmask (dY is read in place, only its mask is built):

- input gradient: only where relu(x) != 0, either as the forward of the flipped conv over dY's mask
  (stride 1) or as dot products of dY patches with the weight rows at relu(x)'s nonzeros, taken 4
  pixels at a time over the union of their channels (any stride; for a dense dY), whichever
  ``_dx_side`` estimates cheapest (strided convs: that or the dense input gradient, masked);
- weight gradient: over relu(x)'s mask or, for stride 1, over dY's (the flipped conv's weight
  gradient), or over per-channel lists of relu(x)'s or of dY's nonzeros (accumulators in registers, work
  exactly nnz; ``csrc/adaptive_wgrad_lists.cpp``), whichever ``_dw_side`` estimates cheapest from the two
  densities and the clustering of relu(x)'s zeros (the lists when either side is sparse enough: behind a
  max-pool dY keeps one pixel of each 2x2 window, so its 4-pixel unions hold several times its nonzeros).

Weight packs: the forward pack and the flipped pack come from one native pass per weight version
(:func:`~sparsa.kernels.adaptive_union.union_packs`). The flipped one is skipped when relu(x) is so
sparse that its side of the input gradient wins for any dY, and for channels-last weights, which the
dY side reads in place. Backward reads the forward's weight: the saved packs (the relu(x) side's weight
rows are rebuilt from the forward pack by row copies), or the weight in place after checking its version;
when an optimizer step came in between, the relu(x) side runs from the forward pack.

A bf16 input (under autocast, where the CPU has AVX512-BF16) takes the same path with bf16 operands
(:mod:`sparsa.kernels.adaptive_union_bf16`): the weight rounded to bf16 as autocast rounds it, bf16 outputs,
each backward GEMM priced against the dense bf16 one (``conv_union_bf16.*``), whose gradients are options too.

The path needs the native kernels with AVX-512 and channel counts whose 16-wide output blocks fit
(:func:`~sparsa.kernels.adaptive_union.union_supported`); elsewhere ``relu_conv2d`` runs the list
kernels of :mod:`sparsa.adaptive.conv`. ``SPARSA_ADAPTIVE_KERNELS=list`` (or ``KERNELS = "list"``
here) forces those everywhere, ``union`` asks for this path wherever it is supported.

Example::

    >>> import torch
    >>> from sparsa.adaptive import relu_conv2d
    >>> x = torch.randn(2, 16, 6, 6, requires_grad=True); w = torch.randn(32, 16, 3, 3)
    >>> relu_conv2d(x, w, None, padding=1).sum().backward()
    >>> x.grad.shape
    torch.Size([2, 16, 6, 6])
"""

from __future__ import annotations

import os
from collections import Counter
import weakref
from typing import Optional

import torch
from torch import Tensor

from ..kernels import adaptive_union as _u
from ..kernels import adaptive_union_bf16 as _b
from ..kernels import adaptive_union_ops as _ops
from ..kernels.adaptive import conv_backward, igrad_dy_geometry
from ..kernels.geometry import ConvGeometry
from . import cost_fits as _fits
from ..crossovers import crossover

__all__ = ["union_path_supported", "kernel_family", "kernels_setting", "union_paths", "KERNELS"]

#: "auto" (union where supported, else lists), "union" (same; named for clarity in tests), "list"
KERNELS = os.environ.get("SPARSA_ADAPTIVE_KERNELS", "auto")

#: which backward GEMMs ran how: "dx_dy" (input gradient over dY's mask), "dx_x" (at relu(x)'s nonzeros,
#: dot products over 4-pixel unions), "dx_dense" (strided: dense input gradient, masked), "dw_x" / "dw_dy"
#: (weight gradient over relu(x)'s / dY's mask), "dw_lists" / "dw_dy_lists" (over per-channel lists of relu(x)'s /
#: dY's nonzeros),
#: "fwd_g4" / "fwd_g2" (forwards on 4- / 2-pixel groups); "bf16_fwd" / "bf16_dx_x" / "bf16_dx_dy" / "bf16_dw_x" /
#: "bf16_dw_lists" / "bf16_dw_dy_lists":
#: those that ran on bf16 operands (bf16 x, under autocast)
union_paths: Counter = Counter()


# Which kernel computes each backward GEMM: the linear cost models ``conv_union.*`` of
# :mod:`sparsa.adaptive.cost_fits` in d_x, d_g (the densities of relu(x) and dY), relative to the dense
# (oneDNN) GEMM; defaults until ``sparsa cost --refit`` refits them on this CPU (fit conditions in
# docs/benchmarks.md). Input gradient: "x" at relu(x)'s nonzeros (dot products over 4-pixel unions, any
# stride; includes rebuilding the weight rows from the forward pack, dearer for the largest weights); "dy"
# over dY's mask (stride 1, the flipped conv's forward, stored where relu(x) != 0); "dense" for strided
# convs (then masked). In bf16 mode (``bf16=True``: a bf16 input under autocast) the ``conv_union_bf16.*`` models
# price the same choices relative to the dense bf16 GEMM, and the dense bf16 gradient (masked, for dX) is an
# option at any stride.
# ``fits``: the models' coefficients (``cost_fits.table()``), read once per decision by the callers below.
def _family(bf16: bool) -> str:
    return "conv_union_bf16." if bf16 else "conv_union."


def _dx_costs(d_x: float, d_g: Optional[float], C: int, O: int, stride1: bool, fits=None, bf16: bool = False) -> dict:
    fits = _fits.table() if fits is None else fits
    fam = _family(bf16)
    fx = fits[fam + "dx.x"]
    cost = {"x": fx["base"] + fx["per_dx"] * d_x + (fx["big_weight"] if C * O >= _fits.BIG_WEIGHT else 0.0)}
    if not stride1 or bf16:
        cost["dense"] = fits["conv_union.dx.dense"]["base"]
    if stride1 and d_g is not None:
        fy = fits[fam + "dx.dy"]
        cost["dy"] = fy["base"] + fy["per_dg"] * d_g
    return cost


def _dy_floor(name: str, fits=None) -> float:
    """The least a dY-driven kernel (``conv_union.dx.dy`` / ``dw.dy``, or the bf16 ones) costs at any dY
    density."""
    f = (_fits.table() if fits is None else fits)[name]
    return f["base"] + min(0.0, f["per_dg"])


def _dx_side(d_x: float, d_g: Optional[float], C: int, O: int, stride1: bool, fits=None, bf16: bool = False) -> str:
    cost = _dx_costs(d_x, d_g, C, O, stride1, fits, bf16)
    return min(cost, key=cost.get)


def _dx_without_dy(d_x: float, C: int, O: int, bf16: bool = False) -> Optional[str]:
    """The input gradient's side when it wins whatever dY's density ("x", or in bf16 mode "dense"), else None
    (then dY's operand is needed to decide)."""
    fits = _fits.table()
    cost = _dx_costs(d_x, None, C, O, True, fits, bf16)
    side = min(cost, key=cost.get)
    return side if cost[side] < _dy_floor(_family(bf16) + "dx.dy", fits) else None


def _dx_x_certain(d_x: float, C: int, O: int) -> bool:
    """Whether the relu(x) side wins the input gradient whatever dY's density."""
    return _dx_without_dy(d_x, C, O) == "x"


# Weight gradient, priced the same way: "lists", the per-channel list kernel (csrc/adaptive_wgrad_lists.cpp: its
# work is exactly nnz(relu(x)) x KH*KW x O FMAs, one dY row load each; dearer at C <= 64 and for the largest
# weights, 4x4 images whose lists are short per block of output channels); "x", the union kernel over relu(x)'s
# mask (its work is the 4-pixel unions, so it scales with relu(x)'s union_ratio r, 2 when unknown); "dy", over
# dY's mask (the flipped conv's weight gradient); "dy_lists", the list kernel over dY's nonzeros (work exactly
# nnz(dY) x KH*KW x C; bf16 operands read as they are); in bf16 mode also "dense", the dense bf16 weight gradient.
def _dw_costs(
    d_x: float,
    d_g: Optional[float],
    C: int,
    O: int = 0,
    ratio: Optional[float] = None,
    fits=None,
    bf16: bool = False,
) -> dict:
    fits = _fits.table() if fits is None else fits
    fam = _family(bf16)
    r = 2.0 if ratio is None else min(4.0, max(1.0, ratio))
    big = C * O >= _fits.BIG_WEIGHT
    fl, fx = fits[fam + "dw.lists"], fits[fam + "dw.x"]
    lists = (
        fl["base"]
        + fl["per_dx"] * d_x
        + (fl["small_c"] if C <= _fits.SMALL_C else 0.0)
        + (fl["big_weight"] if big else 0.0)
    )
    cost = {"lists": lists, "x": fx["base"] + fx["per_dx_ratio"] * d_x * r + (fx["big_weight"] if big else 0.0)}
    if d_g is not None:
        fy, fyl = fits[fam + "dw.dy"], fits[fam + "dw.dy_lists"]
        cost["dy"] = fy["base"] + fy["per_dg"] * d_g
        cost["dy_lists"] = fyl["base"] + fyl["per_dg"] * d_g
    if bf16:
        cost["dense"] = 1.0
    return cost


def _dw_dy_floor(fits, bf16: bool) -> float:
    """The least a dY-driven weight gradient (union or lists) costs at any dY density."""
    fam = _family(bf16)
    return min(_dy_floor(fam + "dw.dy", fits), _dy_floor(fam + "dw.dy_lists", fits))


def _dw_side(*args, **kwargs) -> str:
    """The cheapest side of :func:`_dw_costs` (same arguments)."""
    cost = _dw_costs(*args, **kwargs)
    return min(cost, key=cost.get)


def kernels_setting() -> str:
    k = str(KERNELS).lower()
    if k not in ("auto", "union", "list"):
        raise ValueError(f"SPARSA_ADAPTIVE_KERNELS / conv_union.KERNELS must be auto, union or list, got {KERNELS!r}")
    return k


def union_path_supported(x: Tensor, weight: Tensor, bias) -> bool:
    """Whether ``relu_conv2d`` runs this path for these tensors."""
    return x.dim() == 4 and union_path_supported_for(x.dtype, x.device, weight, bias)


def union_path_supported_for(dtype: torch.dtype, device: torch.device, weight: Tensor, bias) -> bool:
    """:func:`union_path_supported` for a 4-D input of this dtype and device (not at hand, e.g. compacted):
    float32, or bfloat16 (with a float32 weight, as under autocast) where the bf16 kernels run."""
    if kernels_setting() == "list" or device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    for t in (weight, bias):
        if t is not None and (t.device.type != "cpu" or t.dtype != torch.float32):
            return False
    if weight.dim() != 4:
        return False
    C, O = int(weight.shape[1]), int(weight.shape[0])
    return _b.union_supported_bf16(C, O) if dtype == torch.bfloat16 else _u.union_supported(C, O)


def kernel_family(kind: str, x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> str:
    """``"union"`` or ``"list"``: the kernels the sparse path of a ``"conv2d"`` / ``"linear"`` layer runs."""
    if kind == "linear":
        x = x.reshape(-1, x.shape[-1]).t().unsqueeze(0).unsqueeze(-1)
        weight = weight.unsqueeze(-1).unsqueeze(-1)
    return "union" if union_path_supported(x, weight, bias) else "list"


def _stride1(geo: ConvGeometry) -> bool:
    return geo.stride1


class UnionReluConv2d(torch.autograd.Function):
    """``conv2d(relu(x), W, b)`` on the union kernels (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, geo, stats, pack_src=None):
        # pack_src: a long-lived detached tensor with weight's values (and version counter) that keys the
        # weight-pack caches when ``weight`` itself is a fresh view each call (relu_linear's 1x1 view)
        weight = weight if pack_src is None else pack_src
        # bf16 x (under autocast): bf16 operands for the forward, both input gradients and the weight gradient
        # over relu(x)'s mask; the list and dY-side weight gradients run on the widened operands
        ctx.bf16 = bf16 = x.dtype == torch.bfloat16
        op = _b.union_operand_bf16(x.detach()) if bf16 else _u.union_operand(x.detach())
        C = geo.C
        d_x = op.nnz / max(1, op.values.numel())
        ctx.stride1 = _stride1(geo)
        # the flipped pack (input gradient over dY's mask) unless another side of the input gradient wins
        # whatever dY's density: relu(x)'s when it is sparse enough (it reads the forward pack), or in bf16 mode
        # the dense bf16 gradient
        ctx.dx_fixed = _dx_without_dy(d_x, C, geo.O, bf16)
        ctx.x_dx = ctx.dx_fixed is not None
        # a channels-last weight is read in place by the dY-driven input gradient (no flipped pack), as long as
        # it still holds the forward's values in backward (else the list side runs, from the forward pack)
        in_place = ctx.stride1 and not bf16 and _u.reads_weight_in_place(weight)
        want_flip = ctx.stride1 and ctx.needs_input_grad[0] and not ctx.x_dx and not in_place
        if bf16:
            packs = _b.union_pair_packs(weight, flipped=want_flip)
            wf, wfl = packs.wc, packs.wfl2  # bf16 mode keeps the input gradient's rows in the forward pack's place
        else:
            wf, wfl = _u.union_packs(weight, flipped=want_flip)
        ctx.w_ref = weakref.ref(weight) if in_place else None
        ctx.w_key = (weight._version, weight.data_ptr())
        # 2-pixel groups on images run in rows of 4 (no 2x2 tiles, see adaptive_union.cpp) once the 4-pixel
        # unions hold enough more channel rows than nonzeros that the waste costs more than the halved
        # weight-row reuse; 2x2 tiles of larger images waste less and stay ahead, except in bf16 mode, where
        # a pair of channels runs when either is set in the group (the crossovers, measured per CPU)
        ratio = ctx.x_ratio = op.union_ratio()
        tiles = geo.Ho % 2 == 0 and geo.Wo % 2 == 0 and geo.Ho >= 16 and geo.Wo >= 16
        if ratio is None or (tiles and not bf16):
            two = False
        else:
            two = ratio > crossover("conv_union.fwd_group4_bf16_tiles" if tiles else "conv_union.fwd_group4")
        group = 2 if two else 4
        if bf16:
            y = _b.union_conv_fwd_bf16(op, weight, bias, geo, group=group, wf2=packs.wf2)
            if x.is_contiguous() and not y.is_contiguous():
                # an NCHW model gets NCHW back: channels-last bf16 outputs made the dense layers after it convert
                y = _ops.nchw_copy(y)
        else:
            y = _u.union_conv_fwd(op, weight, bias, geo, wf=wf, group=group)
        union_paths[f"fwd_g{group}"] += 1
        if bf16:
            union_paths["bf16_fwd"] += 1
        if stats is not None:
            stats["nnz"] = torch.tensor([op.nnz], dtype=torch.int64)
            stats["union_ratio"] = op.union_ratio()
        ctx.geo = geo
        ctx.nnz = op.nnz
        ctx.has_bias = bias is not None
        ctx.w_stride = tuple(weight.stride())
        ctx.channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        # backward reads the weight as the forward saw it (an optimizer step in between changes nothing): the
        # packs for stride 1, the weight itself for the strided conv's dense input gradient
        if ctx.stride1 and ctx.needs_input_grad[0]:
            extra = wfl
        elif ctx.needs_input_grad[0]:
            extra = None if bf16 else weight.detach()  # bf16 mode: the dense gradient reads the weight saved below
        else:
            extra = None
        # bf16 mode: the dense bf16 gradients, when picked, read the weight rounded as autocast rounds it
        ctx.save_for_backward(op.values, op.mask, extra, wf, weight.detach() if bf16 else None)
        return y

    @staticmethod
    def backward(ctx, gy):
        values, mask, extra, wf, w_saved = ctx.saved_tensors
        op = _u.UnionOperand(values, mask, ctx.nnz)
        geo = ctx.geo
        bf16 = ctx.bf16
        if bf16 and gy.dtype != torch.bfloat16:
            gy = gy.to(torch.bfloat16)
        g = _ops.nhwc_copy(gy)
        # the fp32 kernels' operands (bf16: widened once, when first needed)
        wide = {}

        def op32():
            if "op" not in wide:
                wide["op"] = _b.widened(op)
            return wide["op"]

        def g32():
            if "g" not in wide:
                wide["g"] = g.float() if bf16 else g
            return wide["g"]

        dx = dw = db = None
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        C, O = geo.C, geo.O
        d_x = op.nnz / max(1, values.numel())
        g2 = igrad_dy_geometry(geo) if ctx.stride1 else None
        dy_ok = g2 is not None and g2.ph >= 0 and g2.pw >= 0
        # dY's operand only when a dY-driven kernel may win: the input gradient's unless relu(x)'s side wins for
        # any dY, the weight gradient's unless the relu(x)-driven kernels cost less than its minimum
        fits = _fits.table()
        want_g = (need_dx and ctx.stride1 and not ctx.x_dx) or (
            need_dw
            and dy_ok
            and min(_dw_costs(d_x, None, C, O, ctx.x_ratio, fits, bf16).values()) > _dw_dy_floor(fits, bf16)
        )
        if not want_g:
            gop = None
        elif bf16:
            gop = _b.union_operand_bf16(g.permute(0, 3, 1, 2), relu=False)
        else:
            gop = _u.union_operand(g.permute(0, 3, 1, 2), relu=False)
        d_g = gop.nnz / max(1, g.numel()) if gop is not None else None
        dx_side = dw_side = None
        w_now = None
        if need_dx:
            dx_side = ctx.dx_fixed if ctx.x_dx else _dx_side(d_x, d_g, C, O, ctx.stride1, fits, bf16)
            if dx_side == "dy" and extra is None:
                w_now = ctx.w_ref() if ctx.w_ref is not None else None
                if w_now is None or (w_now._version, w_now.data_ptr()) != ctx.w_key:
                    dx_side = "x"  # the weight changed since the forward: the relu(x) side reads the forward pack
        if need_dw:
            dw_side = _dw_side(d_x, d_g if dy_ok else None, C, O, ctx.x_ratio, fits, bf16)
        if dx_side == "x":
            # the backward's operand has no union count: the forward's ratio picks lists or 4-pixel unions
            lists = _u.igrad_x_lists(ctx.x_ratio)
            if bf16:
                dx = _b.union_conv_igrad_x_bf16(op, g, geo, wc=wf, lists=lists)
            else:
                dx = _u.union_conv_igrad_x(op32(), g32(), geo, wc=_u.union_wc(wf, O, C, geo.KH, geo.KW), lists=lists)
        if dx_side is not None:
            if dx_side == "dy":
                # 2-pixel groups over dY's mask when its 4-pixel unions are mostly zeros: behind a max-pool dY has
                # at most one nonzero per 2x2 window, which lifts its union ratio well above other layers'
                ratio = gop.union_ratio()
                group = 2 if ratio is not None and ratio > crossover("conv_union.dy_group4") else 4
                if bf16:
                    dx = _b.union_conv_igrad_bf16(gop, w_now, op, geo, wfl2=extra, group=group)
                else:
                    dx = _u.union_conv_igrad(gop, w_now, op, geo, wflip=extra, group=group)
            elif dx_side == "dense":
                dxd = conv_backward(
                    g.permute(0, 3, 1, 2),
                    op.nchw(),
                    w_saved.to(torch.bfloat16) if bf16 else extra,
                    geo,
                    [True, False, False],
                )[0]
                dx = (
                    dxd.mul_(op.nchw() != 0)
                    if dxd.is_contiguous(memory_format=torch.channels_last)
                    else torch.where(op.nchw() != 0, dxd, torch.zeros(()))
                )
            if bf16 and dx.dtype != torch.bfloat16:
                dx = dx.to(torch.bfloat16)
            union_paths["dx_" + dx_side] += 1
            if bf16 and dx_side in ("x", "dy"):
                union_paths["bf16_dx_" + dx_side] += 1
            if not ctx.channels_last:
                dx = _ops.nchw_copy(dx)
        if dw_side == "dense":  # bf16 mode only
            dw = conv_backward(g.permute(0, 3, 1, 2), op.nchw(), w_saved.to(torch.bfloat16), geo, [False, True, False])[
                1
            ].float()
        elif dw_side == "dy":
            dw = _u.union_conv_wgrad_dy(_b.widened(gop), op32().values, geo, ctx.w_stride)
        elif dw_side == "dy_lists":  # bf16 operands read as they are
            dw = _u.union_conv_wgrad_dy(gop, op.values, geo, ctx.w_stride, lists=True)
        elif dw_side == "x" and bf16:
            dw = _b.union_conv_wgrad_bf16(op, g, geo, ctx.w_stride)
        elif dw_side == "lists":  # bf16 operands read as they are
            dw = _u.union_conv_wgrad(op, g, geo, ctx.w_stride, lists=True)
        elif dw_side == "x":
            dw = _u.union_conv_wgrad(op32(), g32(), geo, ctx.w_stride)
        if dw_side is not None:
            union_paths["dw_" + dw_side] += 1
            if bf16 and dw_side in ("x", "lists", "dy_lists"):
                union_paths["bf16_dw_" + dw_side] += 1
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g32().sum((0, 1, 2))
        return dx, dw, db, None, None, None
