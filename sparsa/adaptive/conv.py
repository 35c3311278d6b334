"""``relu_conv2d``: ``conv2d(relu(x), W, b)`` with all three training GEMMs exploiting relu(x)'s zeros.

Forward compacts ``relu(x)`` once (fused ReLU + compaction) and runs the gather kernel; backward
reuses the same compacted operand for the weight gradient and computes the input gradient only
where ``relu(x) != 0`` (elsewhere the ReLU's derivative is zero anyway), so the result is the exact
gradient of ``conv2d(relu(x), W, b)``. When ``x`` already is a ReLU output, ``relu(x) == x``.

Stride-1 convolutions whose output gradient dY is sparse too (the conv feeds a ReLU, no BatchNorm
in between) may compute the input gradient from dY's nonzeros instead: a forward conv of the
compacted dY with the flipped, transposed weight, masked by relu(x)'s nonzeros. A cost model (see
``_dy_path_pays``) picks the cheaper path per call from nnz(relu(x)) and a sampled nnz(dY).

Those are the *list* kernels (per-pixel lists of nonzero channels). Where the CPU has AVX-512 and the
channel counts fit, ``relu_conv2d`` runs the bitmask-operand *union* kernels instead
(:mod:`sparsa.adaptive.conv_union`), which are faster at every density measured; the list kernels
remain for the other CPUs and shapes (``SPARSA_ADAPTIVE_KERNELS=list`` forces them).

Example::

    >>> import torch
    >>> from sparsa.adaptive import relu_conv2d
    >>> x = torch.randn(2, 8, 6, 6, requires_grad=True); w = torch.randn(16, 8, 3, 3)
    >>> y = relu_conv2d(x, w, None, padding=1)
    >>> torch.allclose(y, torch.nn.functional.conv2d(x.relu(), w, padding=1), atol=1e-4)
    True
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Dict, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..kernels import adaptive as _k
from . import cost_fits as _fits
from .compaction import DEFAULT_SLICE
from .conv_union import UnionReluConv2d, union_path_supported, union_path_supported_for

__all__ = ["relu_conv2d", "conv_supported", "dy_path_supported", "backward_paths", "backward_paths_dw"]

# How many input gradients each stride-1 native backward computed over the nonzeros of relu(x)
# ("x") or of dY ("dy"); tests and benchmarks read it to see which path ran.
backward_paths: Counter = Counter()

# Sparse-dY input gradient (stride 1, C % 8 == 0): dx = mask_{x>0}(conv2d(dY, W flipped, transposed)),
# a forward conv over the compacted dY (work ~ nnz(dY) * C) instead of dot products at the nonzeros of
# relu(x) (work ~ nnz(x) * O). Cost model ``conv_list.dx.dy`` of :mod:`sparsa.adaptive.cost_fits` (refitted
# by ``sparsa cost --refit``), in units of the x-sparse kernel's time ``nnz(x) * O``: the dY path costs
# ``per_nnz * nnz(dY) * C`` plus ``fixed * numel(dY) * O`` (compacting dY, applying the ReLU mask), times
# sqrt(C / O) when C > O, where it ran slower than predicted. It is taken below ``margin``, or
# ``margin_with_dw`` when the weight gradient is needed too: the x path then computes both in one call that
# shares its per-channel view of the operand and the padded dY. Fit conditions: docs/benchmarks.md.
# A test or benchmark can force a path by setting these module attributes (None: the model's coefficients).
_DY_PER_NNZ = _DY_FIXED = _DY_MARGIN = _DY_MARGIN_WITH_DW = None
_DY_SAMPLE_ELEMENTS = 16384
_SAMPLE_BASE: Dict[Tuple[int, int, int], Tensor] = {}


def _dy_density(g: Tensor) -> float:
    """Estimated fraction of nonzeros of ``g`` ([N, Ho, Wo, O] contiguous) from evenly spaced pixels."""
    P, O = g.numel() // max(1, g.shape[-1]), g.shape[-1]
    m = min(P, max(16, _DY_SAMPLE_ELEMENTS // max(1, O)))
    base = _SAMPLE_BASE.get((P, O, m))
    if base is None:
        if len(_SAMPLE_BASE) > 256:
            _SAMPLE_BASE.clear()
        base = _SAMPLE_BASE[(P, O, m)] = (torch.arange(m, dtype=torch.int64) * P // m) * O
    res = _k.sample_zeros(g.permute(0, 3, 1, 2), base, max(1, O))
    if res is None:
        return 1.0
    return 1.0 - res[0] / max(1, m * O)


def _dy_path_pays(g: Tensor, cnt: Tensor, geo: Sequence[int], need_dw: bool = True) -> bool:
    """The cost model above: True when the dY path should compute the input gradient."""
    numel_dy = g.numel()
    return _dy_rule(int(cnt.sum()), _dy_density(g) * numel_dy, numel_dy, geo.C, geo.O, need_dw)


def dy_path_terms(nnz_dy: float, numel_dy: int, C: int, O: int) -> Tuple[float, float]:
    """The two work terms of cost model ``conv_list.dx.dy``, ``(nnz(dY) * C, numel(dY) * O)``, which
    ``per_nnz`` and ``fixed`` multiply; the refit regresses the measured times on these same terms."""
    return nnz_dy * C, numel_dy * O


def _dy_rule(nnz_x: int, nnz_dy: float, numel_dy: int, C: int, O: int, need_dw: bool) -> bool:
    c = _fits.coefficients("conv_list.dx.dy")
    per_nnz, fixed, margin, margin_dw = (
        c[k] if v is None else v
        for k, v in (
            ("per_nnz", _DY_PER_NNZ),
            ("fixed", _DY_FIXED),
            ("margin", _DY_MARGIN),
            ("margin_with_dw", _DY_MARGIN_WITH_DW),
        )
    )
    sparse_work, dense_work = dy_path_terms(nnz_dy, numel_dy, C, O)
    new = (per_nnz * sparse_work + fixed * dense_work) * max(1.0, C / O) ** 0.5
    return new < (margin_dw if need_dw else margin) * nnz_x * O


IntOr2 = Union[int, Sequence[int]]


def _pair(v: IntOr2, name: str):
    if isinstance(v, int):
        return (v, v)
    t = tuple(int(i) for i in v)
    if len(t) != 2:
        raise ValueError(f"{name} must be an int or a pair, got {v!r}")
    return t


def conv_supported(weight: Tensor, groups: int = 1, padding_mode: str = "zeros", padding: object = 0) -> bool:
    """Whether the native sparse path handles this conv (else the layer stays dense)."""
    return (
        groups == 1
        and padding_mode == "zeros"
        and not isinstance(padding, str)
        and weight.dim() == 4
        and weight.shape[0] % 8 == 0
    )


def dy_path_supported(x: Tensor, weight: Tensor, stride: IntOr2 = 1, padding: IntOr2 = 0, dilation: IntOr2 = 1) -> bool:
    """Whether the backward may run over dY's nonzeros (native, stride 1, C and O multiples of 8)."""
    return (
        _k.native_available()
        and x.dim() == 4
        and weight.dim() == 4
        and x.dtype == torch.float32
        and _pair(stride, "stride") == (1, 1)
        and weight.shape[0] % 8 == 0
        and weight.shape[1] % 8 == 0
    )


def _conv_forward(ctx, cnt, idx, val, weight, bias, geo, x_keep=None, channels_last=True):
    """``conv2d`` of the compacted ``relu(x)`` ``(cnt, idx, val)`` with ``weight`` and ``bias``; fills ``ctx``
    for :func:`_conv_backward`. ``x_keep``: ``(x, x._version, nonnegative)`` when the dense ``x`` is at hand
    (the dY-driven weight gradient reads it); ``channels_last``: the memory format of the input gradient."""
    b = None if bias is None else bias.detach()
    # native fast path: the weight packed once per parameter version (cached), dY padding and the
    # weight gradient's [O, C, KH, KW] layout inside the stride-1 backward kernel
    packed = _k.packed_supported(val, weight, bias) and geo.O % 8 == 0
    if packed:
        wf, wc = _k.packed_weight(weight)
        y = _k.conv_fwd_packed(cnt, idx, val, wf, b, geo, 1)
        wsave = wc if _k._stride1(geo) else weight.detach()
    else:
        wsave = weight.detach().permute(2, 3, 1, 0).contiguous()
        y = _k.conv_fwd(cnt, idx, val, wsave, b, geo, 1)
    ctx.geo = geo
    ctx.channels_last = channels_last
    ctx.has_bias = bias is not None
    ctx.packed = packed
    ctx.w_stride = tuple(weight.stride())
    # the dY path packs the flipped weight in backward: only if the weight still holds these values
    ctx.w_ref = weakref.ref(weight) if packed and geo.stride1 and geo.C % 8 == 0 else None
    ctx.w_key = (weight._version, weight.data_ptr())
    ctx.x_keep = None
    if x_keep is not None and ctx.w_ref is not None:
        if geo.ph <= geo.dh * (geo.KH - 1) and geo.pw <= geo.dw * (geo.KW - 1):
            ctx.x_keep = x_keep
    ctx.save_for_backward(cnt, idx, val, wsave)
    return y


def _conv_backward(ctx, gy):
    """``(dx, dw, db)`` of :func:`_conv_forward` for the arguments ``ctx.needs_input_grad`` asks for."""
    cnt, idx, val, w = ctx.saved_tensors
    g = gy.permute(0, 2, 3, 1).contiguous()
    dx = dw = db = None
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if ctx.packed and _k._stride1(ctx.geo):
        weight = ctx.w_ref() if ctx.w_ref is not None else None
        if (
            need_dx
            and weight is not None
            and (weight._version, weight.data_ptr()) == ctx.w_key
            and g.numel()
            and _dy_path_pays(g, cnt, ctx.geo, need_dw)
        ):
            S = ctx.geo.slice
            gc, gi, gv = _k.compact_signed(g.permute(0, 3, 1, 2), S)
            dx = _k.conv_igrad_dy(gc, gi, gv, _k.packed_weight_flipped(weight), cnt, idx, ctx.geo, S, ctx.channels_last)
            backward_paths["dy"] += 1
            if need_dw:
                dw = _wgrad_dy(ctx, gc, gi, gv, cnt)
            if need_dw and dw is None:
                _, dw = _k.conv_bwd_packed(cnt, idx, val, g, w, ctx.geo, ctx.channels_last, False, True, ctx.w_stride)
        elif need_dx or need_dw:
            backward_paths["x"] += need_dx
            dx, dw = _k.conv_bwd_packed(cnt, idx, val, g, w, ctx.geo, ctx.channels_last, need_dx, need_dw, ctx.w_stride)
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
    return dx, dw, db


class _ReluConv2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, geo, stats, nonnegative):
        cnt, idx, val = _k.compact(x.detach(), geo.slice)
        if stats is not None:
            stats["nnz"] = cnt
        channels_last = x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        # the dY-driven weight gradient reads relu(x) densely: keep x (no copy; not via save_for_backward,
        # so a later in-place change of x only turns that path off instead of failing the backward)
        return _conv_forward(
            ctx, cnt, idx, val, weight, bias, geo, (x.detach(), x._version, nonnegative), channels_last
        )

    @staticmethod
    def backward(ctx, gy):
        return _conv_backward(ctx, gy) + (None, None, None)


# dY-driven weight gradient: dW[o, c, i, j] is the weight gradient of the flipped conv (input dY, output
# dX, weight W'[c, o] = W[o, c] flipped) taken with relu(x) in the place of its output gradient, so the
# stride-1 weight-gradient kernel runs over dY's compacted nonzeros (work ~ nnz(dY) * C) instead of
# relu(x)'s (~ nnz(x) * O). Per nonzero it is slower than the x-driven kernel, so it is taken only when dY
# is clearly the sparser side: nnz(dY) * C < ratio * nnz(x) * O, cost model ``conv_list.dw.dy`` (a module
# attribute overrides it, like the ones above; figures in docs/benchmarks.md).
_DW_DY_RATIO = None
backward_paths_dw: Counter = Counter()


def _wgrad_dy(ctx, gc: Tensor, gi: Tensor, gv: Tensor, cnt: Tensor) -> Optional[Tensor]:
    """``dW`` from the compacted dY ``(gc, gi, gv)`` when that is the cheaper side, else None."""
    if ctx.x_keep is None:
        return None
    x, version, nonnegative = ctx.x_keep
    geo = ctx.geo
    C, O = geo.C, geo.O
    ratio = _fits.coefficients("conv_list.dw.dy")["ratio"] if _DW_DY_RATIO is None else _DW_DY_RATIO
    if x._version != version or int(gc.sum()) * C >= ratio * int(cnt.sum()) * O:
        return None
    xr = x if nonnegative else x.clamp_min(0)
    dw = _k.conv_wgrad_dy(gc, gi, gv, xr.permute(0, 2, 3, 1), geo, geo.slice, ctx.w_stride)
    backward_paths_dw["dy"] += 1
    return dw


def relu_conv2d(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    stride: IntOr2 = 1,
    padding: IntOr2 = 0,
    dilation: IntOr2 = 1,
    slice: int = DEFAULT_SLICE,
    stats: Optional[dict] = None,
    nonnegative: bool = False,
) -> Tensor:
    """``F.conv2d(relu(x), weight, bias, stride, padding, dilation)`` through the sparse kernels.

    ``stats``, if given, receives ``"nnz"``: the per-(pixel, slice) nonzero counts of ``relu(x)``.
    ``nonnegative=True`` promises ``x >= 0`` (a ReLU output): the dY-driven weight gradient then reads
    ``x`` itself instead of a ``relu(x)`` copy. The result is ``[N, O, Ho, Wo]`` with channels-last strides.
    A bfloat16 ``x`` (with a float32 weight, as under autocast) gives a bfloat16 result accumulated in fp32: on
    CPUs with AVX512-BF16 through the bf16 union kernels (the weight rounded to bf16, as autocast rounds it),
    elsewhere through the fp32 kernels.
    """
    if x.dim() != 4:
        raise ValueError(f"x must be 4-D [N, C, H, W], got shape {tuple(x.shape)}")
    if weight.dim() != 4:
        raise ValueError(f"weight must be 4-D [O, C, KH, KW], got shape {tuple(weight.shape)}")
    geo = _k.geometry(
        x.shape, weight.shape, _pair(stride, "stride"), _pair(padding, "padding"), _pair(dilation, "dilation"), slice
    )
    return _step(x, weight, bias, geo, stats, bool(nonnegative))


# The step picks its kernels from measured densities and keys weight packs by tensor identity and version
# (data-dependent, not traceable): under torch.compile it runs exactly as in eager, behind a graph break.
@torch.compiler.disable
def _step(x: Tensor, weight: Tensor, bias: Optional[Tensor], geo, stats: Optional[dict], nonnegative: bool) -> Tensor:
    if union_path_supported(x, weight, bias):
        return UnionReluConv2d.apply(x, weight, bias, geo, stats)
    if x.dtype == torch.bfloat16:  # no bf16 kernels here: the fp32 ones on the widened input, rounded once
        return _step(x.float(), weight, bias, geo, stats, nonnegative).to(torch.bfloat16)
    return _ReluConv2d.apply(x, weight, bias, geo, stats, nonnegative)


# The ReluCompact layout holds relu(x) already compacted for these kernels: its conv runs from those
# components (no densify and compact again), unless the union kernels take the shape (they read x densely).
def compacted_path_supported(dtype: torch.dtype, device: torch.device, weight: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether :func:`compacted_conv_forward` runs for a compacted input of this dtype and device."""
    return not union_path_supported_for(dtype, device, weight, bias)


@torch.compiler.disable
def compacted_conv_forward(
    ctx,
    x_shape,
    cnt: Tensor,
    idx: Tensor,
    val: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    stride: IntOr2 = 1,
    padding: IntOr2 = 0,
    dilation: IntOr2 = 1,
    slice: int = DEFAULT_SLICE,
) -> Tensor:
    """``conv2d(relu(x), weight, bias, ...)`` for ``relu(x)`` given compacted (``cnt, idx, val`` of
    :func:`sparsa.kernels.adaptive.compact` with ``slice``); ``ctx`` (an autograd context, or any object
    when no gradient is needed) is filled for :func:`compacted_conv_backward`, whose input gradient has
    channels-last strides."""
    geo = _k.geometry(
        x_shape, weight.shape, _pair(stride, "stride"), _pair(padding, "padding"), _pair(dilation, "dilation"), slice
    )
    return _conv_forward(ctx, cnt, idx, val, weight, bias, geo)


compacted_conv_backward = torch.compiler.disable(_conv_backward)
