"""Bitmask-operand ("union") kernels of the activation-sparse training runtime.

The operand of an activation is the activation itself, dense in NHWC, plus one bit per element that
says whether it is nonzero (:class:`UnionOperand`). The conv kernels (``csrc/adaptive_union.cpp``,
AVX-512, checked at run time) take groups of 4 output pixels, OR their input pixels' masks per kernel
offset and run over the channels in that union: each loaded weight row then feeds 4 pixels from
registers. They cover all three training GEMMs of ``conv2d(relu(x), W)``:

- :func:`union_conv_fwd`: the forward over relu(x)'s mask;
- :func:`union_conv_wgrad`: the weight gradient over relu(x)'s mask (any stride) or, for a stride-1
  conv, over dY's mask (the flipped conv's weight gradient, :func:`union_conv_wgrad_dy`);
- :func:`union_conv_igrad`: a stride-1 input gradient as the forward of the flipped conv over dY's
  mask, stored only where relu(x) != 0.

The native kernels run as the ``sparsa::adaptive_union_*`` ops of :mod:`sparsa.kernels.adaptive_union_ops`.
Each function has a pure-PyTorch fallback (dense ops, same results), used when the native library
or AVX-512 is unavailable (``SPARSA_NO_NATIVE=1``, ``SPARSA_NO_AVX512=1``) or the channel counts do
not fit the kernels (:func:`union_supported`).

Example::

    >>> import torch
    >>> from sparsa.kernels import adaptive_union as U
    >>> x = torch.randn(2, 16, 6, 6); w = torch.randn(32, 16, 3, 3)
    >>> geo = U.geometry(x.shape, w.shape, (1, 1), (1, 1), (1, 1))
    >>> op = U.union_operand(x)
    >>> y = U.union_conv_fwd(op, w, None, geo)
    >>> torch.allclose(y, torch.nn.functional.conv2d(x.relu(), w, padding=1), atol=1e-4)
    True
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import adaptive_union_ops as _ops
from .adaptive import (
    _cached_pack,
    _conv_args,
    conv_backward,
    _dense_strides,
    _pick_ob,
    geometry,
    igrad_dy_geometry,
    native_library,
)
from ..crossovers import crossover
from .geometry import ConvGeometry

__all__ = [
    "UnionOperand",
    "union_native",
    "union_supported",
    "union_dpbf16",
    "union_packs",
    "union_operand",
    "union_conv_fwd",
    "union_conv_wgrad",
    "union_conv_wgrad_dy",
    "union_conv_igrad",
    "union_conv_igrad_x",
    "igrad_x_lists",
    "union_wc",
    "reads_weight_in_place",
    "geometry",
]


def _lib() -> Optional[ctypes.CDLL]:
    return native_library()  # typed by abi.SIGNATURES["adaptive"]; the kernels run as ops (adaptive_union_ops)


def union_native() -> bool:
    """True when the native union kernels can run here (library built, AVX-512, not disabled)."""
    lib = _lib()
    return lib is not None and bool(lib.sparsa_union_supported())


def union_supported(C: int, O: int) -> bool:
    """Whether the native kernels take a conv with ``C`` input and ``O`` output channels: their
    16-wide output blocks need ``O`` (forward, weight gradient) and ``C`` (input gradient, dY-driven
    weight gradient) to have a forward block ``pick_ob`` that is a multiple of 16."""
    return union_native() and O % 8 == 0 and C % 8 == 0 and _pick_ob(O) % 16 == 0 and _pick_ob(C) % 16 == 0


@dataclass
class UnionOperand:
    """An activation as the union kernels read it.

    ``values``: ``[N, H, W, C]`` contiguous, zero where the element is not kept; ``mask``: int64
    ``[N*H*W, ceil(C/64)]``, bit ``c % 64`` of word ``c // 64`` set where channel ``c`` is kept (None
    on the fallback path); ``nnz``: number of kept elements; ``union4``: over runs of 4 consecutive
    pixels of each image (rows flattened), the summed count of channels kept in any of them (how
    clustered the zeros are: the 4-pixel kernels' work), or None when not measured.
    """

    values: Tensor
    mask: Optional[Tensor]
    nnz: int
    union4: Optional[int] = None

    def union_ratio(self) -> Optional[float]:
        """``4 * union4 / nnz``: the 4-pixel kernels' work per kept element, 1 when every run of 4 pixels
        shares its nonzero channels, up to 4 when none do (clustered ReLU zeros sit between). None when
        not measured or nothing is kept."""
        if self.union4 is None or self.nnz == 0:
            return None
        return 4.0 * self.union4 / self.nnz

    @property
    def shape(self):
        """Logical ``[N, C, H, W]``."""
        N, H, W, C = self.values.shape
        return (N, C, H, W)

    def nchw(self) -> Tensor:
        """The values as a logical ``[N, C, H, W]`` tensor (channels-last strides, no copy)."""
        return self.values.permute(0, 3, 1, 2)


def union_dpbf16() -> bool:
    """True when the bf16 union kernels run here (the union kernels' AVX-512 plus AVX512-BF16)."""
    lib = _lib()
    return lib is not None and bool(lib.sparsa_union_has_dpbf16())


def union_operand(
    x: Tensor, relu: bool = True, native: Optional[bool] = None, dtype: torch.dtype = torch.float32
) -> UnionOperand:
    """The operand of ``x`` (logical ``[N, C, H, W]`` of ``dtype``, float32 or bfloat16, any strides):
    ``relu=True`` keeps ``x > 0`` (values ``relu(x)``), ``relu=False`` keeps ``x != 0`` (NaN and inf
    included; for dY). When ``x`` is channels-last contiguous and ``relu=False`` the values are ``x`` itself
    (no copy). ``native=False`` forces the PyTorch fallback (masks then None); bfloat16 runs natively where
    :func:`union_dpbf16`."""
    if x.dim() != 4:
        raise ValueError(f"x must be 4-D [N, C, H, W], got shape {tuple(x.shape)}")
    if x.dtype != dtype:
        raise ValueError(f"x must be {dtype}, got {x.dtype}; convert it with x.to({dtype})")
    lib = _lib() if native is not False and x.device.type == "cpu" else None
    if lib is not None and (union_dpbf16() if dtype == torch.bfloat16 else lib.sparsa_union_supported()):
        nhwc = x.permute(0, 2, 3, 1)
        view = not relu and nhwc.is_contiguous()  # dY read in place: the op writes only the mask
        values, mask, counts = _ops.union_compact(x, bool(relu), not view)
        nnz, u4 = counts.tolist()
        return UnionOperand(nhwc if view else values, mask, nnz, u4)
    keep = x > 0 if relu else x != 0
    values = torch.where(keep, x, torch.zeros((), dtype=x.dtype)).permute(0, 2, 3, 1).contiguous()
    return UnionOperand(values, None, int(keep.sum()))


def _check_group(group) -> None:
    if group not in (1, 2, 4):
        raise ValueError(f"group must be 1, 2 or 4 output pixels, got {group!r}")


def _native_for(op: UnionOperand, C: int, O: int) -> Optional[ctypes.CDLL]:
    return _lib() if op.mask is not None and union_supported(C, O) else None


# id(weight) -> (weakref, key, [wf, wfl]): the union path's weight packs, once per weight version (wfl
# filled in when first asked for)
_UNION_PACKS: dict = {}


def _union_pack(w: Tensor, want_wf: bool, want_wfl: bool):
    wf, wfl = _ops.union_pack(w, want_wf, want_wfl)
    return (wf if want_wf else None), (wfl if want_wfl else None)


def union_packs(weight: Tensor, flipped: bool = True) -> Tuple[Tensor, Optional[Tensor]]:
    """``(wf, wfl)``: ``weight`` ``[O, C, KH, KW]`` packed for the forward (as
    :func:`~sparsa.kernels.adaptive.packed_weight`'s ``wf``) and for the input gradient's flipped conv
    (as :func:`~sparsa.kernels.adaptive.packed_weight_flipped`), built together straight from the weight
    and cached per tensor and version; cheaper than the list path's packs, which also build the
    ``[C, KH, KW, O]`` input-gradient pack.
    ``flipped=False`` builds (and returns) only ``wf`` unless ``wfl`` is cached already; a later call
    with ``flipped=True`` for the same weight version adds ``wfl``."""
    packs = _cached_pack(_UNION_PACKS, weight, lambda w: list(_union_pack(w, True, flipped)))
    if flipped and packs[1] is None:
        packs[1] = _union_pack(weight.detach(), False, True)[1]
    return packs[0], packs[1]


def union_wc(wf: Tensor, O: int, C: int, KH: int, KW: int) -> Tensor:
    """The list kernels' input-gradient pack (``[C, KH, KW, O]``, as
    :func:`~sparsa.kernels.adaptive.packed_weight`'s ``wc``) rebuilt from the forward pack ``wf`` by row
    copies: the weight the forward used, whatever happened to the weight since."""
    return _ops.union_wc(wf, [O, C, KH, KW])


def union_conv_fwd(
    op: UnionOperand,
    weight: Tensor,
    bias: Optional[Tensor],
    geo: Sequence[int],
    wf: Optional[Tensor] = None,
    group: int = 4,
) -> Tensor:
    """``conv2d(op values, weight, bias)`` as ``[N, O, Ho, Wo]`` with channels-last strides. ``wf``: the
    weight's forward pack (:func:`union_packs`) when already at hand. ``group``: output pixels per kernel
    group (4, 2 or 1; fewer waste less on channels nonzero in only some of them)."""
    _check_group(group)
    G = ConvGeometry.of(geo)
    lib = _native_for(op, G.C, G.O)
    if lib is None:
        y = F.conv2d(op.nchw(), weight.detach().float(), None if bias is None else bias.detach(), **_conv_args(geo))
        return y.contiguous(memory_format=torch.channels_last)
    wf = union_packs(weight, flipped=False)[0] if wf is None else wf
    return _ops.union_conv_fwd(op.values, op.mask, wf, None if bias is None else bias.detach(), G, None, 1, group)


def reads_weight_in_place(weight: Optional[Tensor]) -> bool:
    """Whether :func:`union_conv_igrad` reads ``weight`` as it is (channels-last float32 ``[O, C, KH, KW]``,
    no flipped pack needed)."""
    return (
        weight is not None
        and weight.dtype == torch.float32
        and weight.dim() == 4
        and weight.stride(1) == 1
        and _dense_strides(tuple(weight.shape), weight.stride())
    )


def union_conv_igrad(
    gop: UnionOperand,
    weight: Optional[Tensor],
    xop: UnionOperand,
    geo: Sequence[int],
    wflip: Optional[Tensor] = None,
    group: int = 4,
) -> Tensor:
    """The input gradient of the stride-1 ``conv2d(relu(x), weight)`` (``geo``) given the output gradient's
    operand ``gop`` (``relu=False``) and relu(x)'s ``xop``: ``conv_transpose(dY, W)`` kept where
    ``relu(x) != 0``, as ``[N, C, H, W]`` with channels-last strides. ``wflip``: the weight's
    :func:`~sparsa.kernels.adaptive.packed_weight_flipped` when already at hand (then ``weight`` may be None);
    without it a channels-last float32 ``weight`` (:func:`reads_weight_in_place`) is read in place, any
    other is packed. ``group``: as in :func:`union_conv_fwd` (over dY's mask)."""
    _check_group(group)
    G = ConvGeometry.of(geo)
    C, O = G.C, G.O
    if not G.stride1:
        raise ValueError(f"union_conv_igrad needs a stride-1 geometry, got {G}")
    if weight is None and wflip is None:
        raise ValueError("union_conv_igrad needs weight or wflip")
    lib = _native_for(gop, C, O) if xop.mask is not None else None
    if lib is None and weight is None:
        raise ValueError("union_conv_igrad: the PyTorch fallback needs weight (wflip is the native pack)")
    if lib is None:
        dx = conv_backward(gop.nchw(), xop.nchw(), weight.detach().float(), geo, [True, False, False])[0]
        return torch.where(xop.nchw() != 0, dx, torch.zeros(())).contiguous(memory_format=torch.channels_last)
    g2 = igrad_dy_geometry(G)
    if wflip is None and reads_weight_in_place(weight):
        return _ops.union_conv_igrad_w(gop.values, gop.mask, weight.detach(), g2, xop.mask, group)
    wfl = wflip if wflip is not None else union_packs(weight)[1]
    return _ops.union_conv_fwd(gop.values, gop.mask, wfl, None, g2, xop.mask, 0, group)


def igrad_x_lists(union_ratio: Optional[float]) -> bool:
    """Whether the input gradient at relu(x)'s nonzeros takes per-channel pixel lists (work exactly nnz(relu(x))
    dot products) rather than 4-pixel unions (4 x 4 register blocks, but every union channel at every pixel of
    the group): above the ``conv_union.dx_x_lists`` crossover of relu(x)'s union ratio (unknown: the lists)."""
    return union_ratio is None or union_ratio > crossover("conv_union.dx_x_lists")


def union_conv_igrad_x(
    xop: UnionOperand,
    dy_nhwc: Tensor,
    geo: Sequence[int],
    weight: Optional[Tensor] = None,
    wc: Optional[Tensor] = None,
    lists: Optional[bool] = None,
) -> Tensor:
    """The input gradient of ``conv2d(relu(x), W)`` (``geo``, any stride) computed only where relu(x) != 0
    (``xop``'s mask), as dot products of ``dy_nhwc`` (``[N, Ho, Wo, O]``) patches with the weight's rows
    (``wc``: the ``[C, KH, KW, O]`` pack of :func:`union_wc`; built from ``weight`` when not given). Work
    follows relu(x)'s nonzeros, not dY's: for a dense dY and a sparse relu(x). ``lists``: per-channel pixel
    lists (True) or 4-pixel unions (False); default :func:`igrad_x_lists`. Returns ``[N, C, H, W]`` with
    channels-last strides."""
    G = ConvGeometry.of(geo)
    C, O, KH, KW = G.C, G.O, G.KH, G.KW
    if wc is None and weight is None:
        raise ValueError("union_conv_igrad_x needs weight or wc")
    lib = _native_for(xop, C, O)
    if lib is None:
        if weight is None:
            raise ValueError("union_conv_igrad_x: the PyTorch fallback needs weight (wc is the native pack)")
        dx = conv_backward(dy_nhwc.permute(0, 3, 1, 2), xop.nchw(), weight.detach().float(), geo, [True, False, False])[
            0
        ]
        return torch.where(xop.nchw() != 0, dx, torch.zeros(())).contiguous(memory_format=torch.channels_last)
    if wc is None:
        wc = union_wc(union_packs(weight, flipped=False)[0], O, C, KH, KW)
    lists = igrad_x_lists(xop.union_ratio()) if lists is None else bool(lists)
    return _ops.union_conv_igrad_x(xop.mask, dy_nhwc, wc, G, lists)


def _dw_empty(shape, w_stride: Optional[Sequence[int]]) -> Tensor:
    if w_stride is not None and _dense_strides(shape, w_stride):
        return torch.empty_strided(shape, tuple(w_stride), dtype=torch.float32)
    return torch.empty(shape, dtype=torch.float32)


def _wgrad_reference(xnchw: Tensor, dy_nhwc: Tensor, geo: Sequence[int], w_stride) -> Tensor:
    G = ConvGeometry.of(geo)
    dy, x = dy_nhwc.permute(0, 3, 1, 2).float(), xnchw.float()  # bf16 operands: the same products, in fp32
    dw = conv_backward(dy, x, torch.empty(G.O, G.C, G.KH, G.KW), G, [False, True, False])[1]
    out = _dw_empty((G.O, G.C, G.KH, G.KW), w_stride)
    return out.copy_(dw)


def union_conv_wgrad(
    xop: UnionOperand,
    dy_nhwc: Tensor,
    geo: Sequence[int],
    w_stride: Optional[Sequence[int]] = None,
    lists: bool = False,
) -> Tensor:
    """``dW [O, C, KH, KW]`` of ``conv2d(relu(x), W)`` (any stride) over relu(x)'s mask; ``dy_nhwc``:
    the output gradient ``[N, Ho, Wo, O]``. ``w_stride``: strides to give ``dW`` (the weight's, so
    autograd keeps it without a copy). ``lists=True`` runs the per-channel list kernel
    (``csrc/adaptive_wgrad_lists.cpp``: its work follows nnz(relu(x)) exactly, no 4-pixel unions)
    instead of the union kernel; same result. ``lists=True`` also takes bf16 ``xop`` values and ``dy_nhwc``
    (widened as read, fp32 ``dW``)."""
    G = ConvGeometry.of(geo)
    lib = _native_for(xop, G.C, G.O)
    if lib is None:
        return _wgrad_reference(xop.nchw(), dy_nhwc, G, w_stride)
    return _ops.union_conv_wgrad(
        xop.values, xop.mask, dy_nhwc, G, None if w_stride is None else list(w_stride), bool(lists)
    )


def union_conv_wgrad_dy(
    gop: UnionOperand,
    xr_nhwc: Tensor,
    geo: Sequence[int],
    w_stride: Optional[Sequence[int]] = None,
    lists: bool = False,
) -> Tensor:
    """``dW`` of a stride-1 ``conv2d(relu(x), W)`` over dY's mask (operand ``gop``, ``relu=False``):
    the flipped conv's weight gradient with ``relu(x)`` (``xr_nhwc``, ``[N, H, W, C]``) in the place of
    its output gradient. Needs ``padding <= dilation * (kernel - 1)``. ``lists=True`` runs the per-channel
    list kernel over dY's nonzeros instead (work exactly nnz(dY) x KH*KW x C, no 4-pixel unions: behind a
    max-pool, whose dY keeps one pixel of each 2x2 window, the unions hold several times the nonzeros); it
    also takes bf16 ``gop`` values and ``xr_nhwc`` (widened as read, fp32 ``dW``)."""
    G = ConvGeometry.of(geo)
    g2 = igrad_dy_geometry(G)
    if g2.ph < 0 or g2.pw < 0:
        raise ValueError(f"union_conv_wgrad_dy needs padding <= dilation * (kernel - 1), got geometry {G}")
    lib = _native_for(gop, G.C, G.O)
    if lib is None:
        return _wgrad_reference(xr_nhwc.permute(0, 3, 1, 2), gop.values, G, w_stride)
    ws = None if w_stride is None else list(w_stride)
    if lists:
        return _ops.union_conv_wgrad_dy_lists(gop.values, gop.mask, xr_nhwc, G, ws)
    return _ops.union_conv_wgrad_dy(gop.values, gop.mask, xr_nhwc, G, ws)
