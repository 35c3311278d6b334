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

from .adaptive import (_cached_pack, _conv_args, _dense_strides, _nthreads, _pick_ob, geometry, igrad_dy_geometry,
                       native_library)

__all__ = ["UnionOperand", "union_native", "union_supported", "union_packs", "union_operand", "union_conv_fwd",
           "union_conv_wgrad", "union_conv_wgrad_dy", "union_conv_igrad", "union_conv_igrad_x", "union_wc",
           "reads_weight_in_place", "geometry"]


def _lib() -> Optional[ctypes.CDLL]:
    lib = native_library()
    if lib is not None and not getattr(lib, "_sparsa_union_typed", False):
        i64, vp, ci = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        lib.sparsa_union_supported.argtypes = []
        lib.sparsa_union_supported.restype = ci
        lib.sparsa_union_compact_f32.argtypes = [vp] + [i64] * 8 + [ci, vp, vp, vp, ci]
        lib.sparsa_union_compact_f32.restype = i64
        lib.sparsa_union_conv_fwd_f32.argtypes = [vp] * 7 + [ci, ci, ci]
        lib.sparsa_union_conv_fwd_f32.restype = ci
        lib.sparsa_union_conv_igrad_x_f32.argtypes = [vp] * 5 + [ci]
        lib.sparsa_union_conv_igrad_x_f32.restype = ci
        lib.sparsa_union_conv_igrad_w_f32.argtypes = [vp] * 7 + [ci, ci]
        lib.sparsa_union_conv_igrad_w_f32.restype = ci
        lib.sparsa_union_conv_wgrad_f32.argtypes = [vp] * 6 + [i64, ci, ci]
        lib.sparsa_union_conv_wgrad_f32.restype = ci
        lib.sparsa_union_conv_wgrad_lists_f32.argtypes = [vp] * 6 + [ci]
        lib.sparsa_union_conv_wgrad_lists_f32.restype = ci
        lib.sparsa_union_pack_f32.argtypes = [vp, vp] + [i64] * 4 + [vp, vp, ci]
        lib.sparsa_union_pack_f32.restype = ci
        lib.sparsa_union_wc_from_wf_f32.argtypes = [vp, i64, i64, i64, vp, ci]
        lib.sparsa_union_wc_from_wf_f32.restype = None
        lib.sparsa_union_transpose_f32.argtypes = [vp, i64, i64, vp, ci]
        lib.sparsa_union_transpose_f32.restype = None
        lib.sparsa_union_transpose_batched_f32.argtypes = [vp, i64, i64, i64, vp, ci]
        lib.sparsa_union_transpose_batched_f32.restype = None
        lib._sparsa_union_typed = True
    return lib


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


def union_operand(x: Tensor, relu: bool = True, native: Optional[bool] = None) -> UnionOperand:
    """The operand of ``x`` (logical ``[N, C, H, W]`` float32, any strides): ``relu=True`` keeps
    ``x > 0`` (values ``relu(x)``), ``relu=False`` keeps ``x != 0`` (NaN and inf included; for dY).
    When ``x`` is channels-last contiguous and ``relu=False`` the values are ``x`` itself (no copy).
    ``native=False`` forces the PyTorch fallback (masks then None)."""
    if x.dim() != 4:
        raise ValueError(f"x must be 4-D [N, C, H, W], got shape {tuple(x.shape)}")
    if x.dtype != torch.float32:
        raise ValueError(f"x must be float32, got {x.dtype}; convert it with x.float()")
    N, C, H, W = x.shape
    lib = _lib() if native is not False and x.device.type == "cpu" else None
    if lib is not None and lib.sparsa_union_supported():
        nhwc = x.permute(0, 2, 3, 1)
        view = not relu and nhwc.is_contiguous()
        values = nhwc if view else torch.empty(N, H, W, C, dtype=torch.float32)
        mask = torch.empty(N * H * W, (C + 63) // 64, dtype=torch.int64)
        sn, sc, sh, sw = x.stride()
        u4 = ctypes.c_int64(0)
        nnz = lib.sparsa_union_compact_f32(x.data_ptr(), N, C, H, W, sn, sc, sh, sw, int(relu),
                                           None if view else values.data_ptr(), mask.data_ptr(),
                                           ctypes.byref(u4), _nthreads())
        if nnz < 0:
            raise RuntimeError(f"sparsa_union_compact_f32 failed ({nnz})")
        return UnionOperand(values, mask, int(nnz), int(u4.value))
    keep = x > 0 if relu else x != 0
    values = torch.where(keep, x, torch.zeros((), dtype=x.dtype)).permute(0, 2, 3, 1).contiguous()
    return UnionOperand(values, None, int(keep.sum()))


def _check_group(group) -> None:
    if group not in (1, 2, 4):
        raise ValueError(f"group must be 1, 2 or 4 output pixels, got {group!r}")


def _native_for(op: UnionOperand, C: int, O: int) -> Optional[ctypes.CDLL]:
    return _lib() if op.mask is not None and union_supported(C, O) else None


def _empty_cl(N: int, C: int, H: int, W: int) -> Tensor:
    return torch.empty(N, C, H, W, dtype=torch.float32, memory_format=torch.channels_last)


# id(weight) -> (weakref, key, [wf, wfl]): the union path's weight packs, once per weight version (wfl
# filled in when first asked for)
_UNION_PACKS: dict = {}


def _union_pack(w: Tensor, want_wf: bool, want_wfl: bool):
    O, C, KH, KW = w.shape
    w = w.float()
    wf = torch.empty(O * C * KH * KW, dtype=torch.float32) if want_wf else None
    wfl = torch.empty(O * C * KH * KW, dtype=torch.float32) if want_wfl else None
    ws = torch.tensor(w.stride(), dtype=torch.int64)
    rc = _lib().sparsa_union_pack_f32(w.data_ptr(), ws.data_ptr(), O, C, KH, KW,
                                      None if wf is None else wf.data_ptr(), None if wfl is None else wfl.data_ptr(),
                                      _nthreads())
    if rc:
        raise ValueError(f"union_packs: weight {tuple(w.shape)} needs in and out channels that are multiples of 8")
    return wf, wfl


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
    wc = torch.empty(O * C * KH * KW, dtype=torch.float32)
    _lib().sparsa_union_wc_from_wf_f32(wf.data_ptr(), O, C, KH * KW, wc.data_ptr(), _nthreads())
    return wc


def union_conv_fwd(op: UnionOperand, weight: Tensor, bias: Optional[Tensor], geo: Sequence[int],
                   wf: Optional[Tensor] = None, group: int = 4) -> Tensor:
    """``conv2d(op values, weight, bias)`` as ``[N, O, Ho, Wo]`` with channels-last strides. ``wf``: the
    weight's forward pack (:func:`union_packs`) when already at hand. ``group``: output pixels per kernel
    group (4, 2 or 1; fewer waste less on channels nonzero in only some of them)."""
    _check_group(group)
    N, C, H, W, O, KH, KW, Ho, Wo = (int(v) for v in geo[:9])
    lib = _native_for(op, C, O)
    if lib is None:
        y = F.conv2d(op.nchw(), weight.detach().float(), None if bias is None else bias.detach(), **_conv_args(geo))
        return y.contiguous(memory_format=torch.channels_last)
    wf = union_packs(weight, flipped=False)[0] if wf is None else wf
    b = None if bias is None else bias.detach().float().contiguous()
    y = _empty_cl(N, O, Ho, Wo)
    g = torch.tensor(list(geo), dtype=torch.int64)
    rc = lib.sparsa_union_conv_fwd_f32(g.data_ptr(), op.values.data_ptr(), op.mask.data_ptr(), wf.data_ptr(),
                                       None if b is None else b.data_ptr(), y.data_ptr(), None, 1, group, _nthreads())
    if rc:
        raise RuntimeError(f"sparsa_union_conv_fwd_f32 failed ({rc}) for geometry {list(geo)}")
    return y


def reads_weight_in_place(weight: Optional[Tensor]) -> bool:
    """Whether :func:`union_conv_igrad` reads ``weight`` as it is (channels-last float32 ``[O, C, KH, KW]``,
    no flipped pack needed)."""
    return (weight is not None and weight.dtype == torch.float32 and weight.dim() == 4 and weight.stride(1) == 1
            and _dense_strides(tuple(weight.shape), weight.stride()))


def union_conv_igrad(gop: UnionOperand, weight: Optional[Tensor], xop: UnionOperand, geo: Sequence[int],
                     wflip: Optional[Tensor] = None, group: int = 4) -> Tensor:
    """The input gradient of the stride-1 ``conv2d(relu(x), weight)`` (``geo``) given the output gradient's
    operand ``gop`` (``relu=False``) and relu(x)'s ``xop``: ``conv_transpose(dY, W)`` kept where
    ``relu(x) != 0``, as ``[N, C, H, W]`` with channels-last strides. ``wflip``: the weight's
    :func:`~sparsa.kernels.adaptive.packed_weight_flipped` when already at hand (then ``weight`` may be None);
    without it a channels-last float32 ``weight`` (:func:`reads_weight_in_place`) is read in place, any
    other is packed. ``group``: as in :func:`union_conv_fwd` (over dY's mask)."""
    _check_group(group)
    N, C, H, W, O = (int(v) for v in geo[:5])
    if geo[9] != 1 or geo[10] != 1:
        raise ValueError(f"union_conv_igrad needs a stride-1 geometry, got {list(geo)}")
    if weight is None and wflip is None:
        raise ValueError("union_conv_igrad needs weight or wflip")
    lib = _native_for(gop, C, O) if xop.mask is not None else None
    if lib is None and weight is None:
        raise ValueError("union_conv_igrad: the PyTorch fallback needs weight (wflip is the native pack)")
    if lib is None:
        a = _conv_args(geo)
        dx = torch.ops.aten.convolution_backward(
            gop.nchw(), xop.nchw(), weight.detach().float(), None, a["stride"], a["padding"], a["dilation"],
            False, (0, 0), 1, [True, False, False])[0]
        return torch.where(xop.nchw() != 0, dx, torch.zeros(())).contiguous(memory_format=torch.channels_last)
    g2 = torch.tensor(igrad_dy_geometry(geo), dtype=torch.int64)
    dx = _empty_cl(N, C, H, W)
    if wflip is None and reads_weight_in_place(weight):
        w = weight.detach()
        ws = torch.tensor(w.stride(), dtype=torch.int64)
        rc = lib.sparsa_union_conv_igrad_w_f32(g2.data_ptr(), gop.values.data_ptr(), gop.mask.data_ptr(),
                                               w.data_ptr(), ws.data_ptr(), dx.data_ptr(), xop.mask.data_ptr(),
                                               group, _nthreads())
    else:
        wfl = wflip if wflip is not None else union_packs(weight)[1]
        rc = lib.sparsa_union_conv_fwd_f32(g2.data_ptr(), gop.values.data_ptr(), gop.mask.data_ptr(),
                                           wfl.data_ptr(), None, dx.data_ptr(), xop.mask.data_ptr(), 0, group,
                                           _nthreads())
    if rc:
        raise RuntimeError(f"sparsa_union_conv_fwd_f32 (input gradient) failed ({rc}) for geometry {list(geo)}")
    return dx


def union_conv_igrad_x(xop: UnionOperand, dy_nhwc: Tensor, geo: Sequence[int], weight: Optional[Tensor] = None,
                       wc: Optional[Tensor] = None) -> Tensor:
    """The input gradient of ``conv2d(relu(x), W)`` (``geo``, any stride) computed only where relu(x) != 0
    (``xop``'s mask), as dot products of ``dy_nhwc`` (``[N, Ho, Wo, O]``) patches with the weight's rows
    (``wc``: the ``[C, KH, KW, O]`` pack of :func:`union_wc`; built from ``weight`` when not given). Work
    follows relu(x)'s nonzeros (4-pixel unions), not dY's: for a dense dY and a sparse relu(x). Returns
    ``[N, C, H, W]`` with channels-last strides."""
    N, C, H, W, O, KH, KW = (int(v) for v in geo[:7])
    if wc is None and weight is None:
        raise ValueError("union_conv_igrad_x needs weight or wc")
    lib = _native_for(xop, C, O)
    if lib is None:
        if weight is None:
            raise ValueError("union_conv_igrad_x: the PyTorch fallback needs weight (wc is the native pack)")
        a = _conv_args(geo)
        dx = torch.ops.aten.convolution_backward(
            dy_nhwc.permute(0, 3, 1, 2), xop.nchw(), weight.detach().float(), None, a["stride"], a["padding"],
            a["dilation"], False, (0, 0), 1, [True, False, False])[0]
        return torch.where(xop.nchw() != 0, dx, torch.zeros(())).contiguous(memory_format=torch.channels_last)
    if wc is None:
        wc = union_wc(union_packs(weight, flipped=False)[0], O, C, KH, KW)
    dy = dy_nhwc.contiguous()
    dx = _empty_cl(N, C, H, W)
    g = torch.tensor(list(geo), dtype=torch.int64)
    rc = lib.sparsa_union_conv_igrad_x_f32(g.data_ptr(), xop.mask.data_ptr(), dy.data_ptr(), wc.data_ptr(),
                                           dx.data_ptr(), _nthreads())
    if rc:
        raise RuntimeError(f"sparsa_union_conv_igrad_x_f32 failed ({rc}) for geometry {list(geo)}")
    return dx


def _dw_empty(shape, w_stride: Optional[Sequence[int]]) -> Tensor:
    if w_stride is not None and _dense_strides(shape, w_stride):
        return torch.empty_strided(shape, tuple(w_stride), dtype=torch.float32)
    return torch.empty(shape, dtype=torch.float32)


def _wgrad_reference(xnchw: Tensor, dy_nhwc: Tensor, geo: Sequence[int], w_stride) -> Tensor:
    N, C, H, W, O, KH, KW = (int(v) for v in geo[:7])
    a = _conv_args(geo)
    dw = torch.ops.aten.convolution_backward(
        dy_nhwc.permute(0, 3, 1, 2), xnchw, torch.empty(O, C, KH, KW), None, a["stride"], a["padding"],
        a["dilation"], False, (0, 0), 1, [False, True, False])[1]
    out = _dw_empty((O, C, KH, KW), w_stride)
    return out.copy_(dw)


def union_conv_wgrad(xop: UnionOperand, dy_nhwc: Tensor, geo: Sequence[int],
                     w_stride: Optional[Sequence[int]] = None, lists: bool = False) -> Tensor:
    """``dW [O, C, KH, KW]`` of ``conv2d(relu(x), W)`` (any stride) over relu(x)'s mask; ``dy_nhwc``:
    the output gradient ``[N, Ho, Wo, O]``. ``w_stride``: strides to give ``dW`` (the weight's, so
    autograd keeps it without a copy). ``lists=True`` runs the per-channel list kernel
    (``csrc/adaptive_wgrad_lists.cpp``: its work follows nnz(relu(x)) exactly, no 4-pixel unions)
    instead of the union kernel; same result."""
    N, C, H, W, O, KH, KW = (int(v) for v in geo[:7])
    lib = _native_for(xop, C, O)
    if lib is None:
        return _wgrad_reference(xop.nchw(), dy_nhwc, geo, w_stride)
    dy = dy_nhwc.contiguous()
    dw = _dw_empty((O, C, KH, KW), w_stride)
    g = torch.tensor(list(geo), dtype=torch.int64)
    if lists:  # written straight into dw's layout
        ws = torch.tensor(dw.stride(), dtype=torch.int64)
        rc = lib.sparsa_union_conv_wgrad_lists_f32(g.data_ptr(), xop.values.data_ptr(), xop.mask.data_ptr(),
                                                   dy.data_ptr(), dw.data_ptr(), ws.data_ptr(), _nthreads())
        if rc:
            raise RuntimeError(f"sparsa_union_conv_wgrad_lists_f32 failed ({rc}) for geometry {list(geo)}")
        return dw
    K2 = KH * KW
    s0, s1, s2, s3 = dw.stride()
    if s0 == C * K2 and s1 == 1 and s2 == KW * C and s3 == C:    # [O, KH, KW, C]: rows (kh, kw, c)
        rs = (1, KW * C, C, 0)
    elif s0 == C * K2 and s1 == K2 and s2 == KW and s3 == 1:     # [O, C, KH, KW]: rows (c, kh, kw)
        rs = (K2, KW, 1, 0)
    else:
        rs = None
    S = torch.empty(C * K2, O, dtype=torch.float32)
    rst = torch.tensor(rs or (K2, KW, 1, 0), dtype=torch.int64)
    rc = lib.sparsa_union_conv_wgrad_f32(g.data_ptr(), xop.values.data_ptr(), xop.mask.data_ptr(),
                                         dy.data_ptr(), S.data_ptr(), rst.data_ptr(), O, 1, _nthreads())
    if rc:
        raise RuntimeError(f"sparsa_union_conv_wgrad_f32 failed ({rc}) for geometry {list(geo)}")
    if rs is None:
        return dw.copy_(S.view(C, KH, KW, O).permute(3, 0, 1, 2))
    lib.sparsa_union_transpose_f32(S.data_ptr(), C * K2, O, dw.data_ptr(), _nthreads())
    return dw


def union_conv_wgrad_dy(gop: UnionOperand, xr_nhwc: Tensor, geo: Sequence[int],
                        w_stride: Optional[Sequence[int]] = None) -> Tensor:
    """``dW`` of a stride-1 ``conv2d(relu(x), W)`` over dY's mask (operand ``gop``, ``relu=False``):
    the flipped conv's weight gradient with ``relu(x)`` (``xr_nhwc``, ``[N, H, W, C]``) in the place of
    its output gradient. Needs ``padding <= dilation * (kernel - 1)``."""
    N, C, H, W, O, KH, KW = (int(v) for v in geo[:7])
    g2 = igrad_dy_geometry(geo)
    if g2[11] < 0 or g2[12] < 0:
        raise ValueError(f"union_conv_wgrad_dy needs padding <= dilation * (kernel - 1), got geometry {list(geo)}")
    lib = _native_for(gop, C, O)
    if lib is None:
        return _wgrad_reference(xr_nhwc.permute(0, 3, 1, 2), gop.values, geo, w_stride)
    xr = xr_nhwc.contiguous()
    dw = _dw_empty((O, C, KH, KW), w_stride)
    K2 = KH * KW
    s0, s1, s2, s3 = dw.stride()
    # the flipped conv's (c' = o, kh, kw) row is dW[o, :, KH-1-kh, KW-1-kw]
    direct = s0 == C * K2 and s1 == 1 and s2 == KW * C and s3 == C
    oihw = s0 == C * K2 and s1 == K2 and s2 == KW and s3 == 1
    S = dw if direct else torch.empty(O, KH, KW, C, dtype=torch.float32)
    rst = torch.tensor((K2, -KW, -1, K2 - 1), dtype=torch.int64)
    g = torch.tensor(g2, dtype=torch.int64)
    rc = lib.sparsa_union_conv_wgrad_f32(g.data_ptr(), gop.values.data_ptr(), gop.mask.data_ptr(), xr.data_ptr(),
                                         S.data_ptr(), rst.data_ptr(), C, 0, _nthreads())
    if rc:
        raise RuntimeError(f"sparsa_union_conv_wgrad_f32 (dY-driven) failed ({rc}) for geometry {list(geo)}")
    if oihw:  # per output channel a [KH*KW x C] -> [C x KH*KW] transpose
        lib.sparsa_union_transpose_batched_f32(S.data_ptr(), O, K2, C, dw.data_ptr(), _nthreads())
    elif not direct:
        dw.copy_(S.permute(0, 3, 1, 2))
    return dw
