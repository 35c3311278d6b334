"""The union ("bitmask operand") kernels of ``csrc/adaptive_union*.cpp`` as ``sparsa::`` kernel ops.

Native only (AVX-512): the functions of :mod:`sparsa.kernels.adaptive_union` call them after checking
:func:`~sparsa.kernels.adaptive_union.union_supported` and run their pure-PyTorch fallback otherwise.
Every op is forward-only: ``UnionReluConv2d`` (:mod:`sparsa.adaptive.conv_union`) owns the backward.
A gradient not asked for, or values the caller reads in place, come back as an empty ``[0]`` tensor
(an op may not return a view of its input).

- ``adaptive_union_compact(x, relu, write_values) -> (values [N,H,W,C], mask, counts [nnz, union4])``
  (x float32, or bfloat16 where the bf16 kernels run; values in x's dtype)
- ``adaptive_union_pack(w, want_wf, want_wfl) -> (wf, wfl)``;
  ``adaptive_union_wc(wf, w_shape) -> wc``
- ``adaptive_union_conv_fwd(values, mask, wp, bias, geo, omask, tiles, group)``: ``[N, O, Ho, Wo]``
  channels-last (the forward; with ``omask`` and the dY geometry, the input gradient over dY's mask)
- ``adaptive_union_conv_igrad_w``: the same input gradient reading a channels-last weight in place
- ``adaptive_union_conv_igrad_x``, ``adaptive_union_conv_wgrad``, ``adaptive_union_conv_wgrad_dy``:
  the input and weight gradients over relu(x)'s or dY's mask (``igrad_x``'s ``lists``: per-channel lists of pixels
  instead of 4-pixel unions)
- ``adaptive_union_conv_wgrad_dy_lists``: the weight gradient over per-channel lists of dY's nonzeros (float32
  or bfloat16 operands, AVX-512)
- ``adaptive_layout16(x, channels_last)``: a 16-bit ``[N, C, H, W]`` tensor copied into the other memory format
  by 16x16-tile transposes (bf16 activations; :func:`nhwc_copy` / :func:`nchw_copy`)
- ``adaptive_union_pair_packs(w, want_fwd, want_flipped) -> (wf2, wfl2, wc)``: the bf16 packs straight from the
  weight (AVX512-BF16)
- bf16 operands (``csrc/adaptive_union_bf16.cpp``, AVX512-BF16): ``adaptive_union_compact``,
  ``adaptive_union_conv_fwd`` (with the paired pack of ``adaptive_union_pair_packs``; bf16 out),
  ``adaptive_union_conv_igrad_x`` (bf16 dy and wc; bf16 dx) and ``adaptive_union_conv_wgrad`` (float32 dW) take
  bf16 operands where the CPU has AVX512-BF16 (its ``lists`` kernel, and ``adaptive_union_conv_wgrad_dy_lists``,
  widen them as they read them: AVX-512 suffices)

Example::

    >>> import torch
    >>> from sparsa.kernels import adaptive_union_ops
    >>> torch.ops.sparsa.adaptive_union_conv_fwd.default.name()
    'sparsa::adaptive_union_conv_fwd'
"""

from __future__ import annotations

import ctypes
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .adaptive import _dense_strides, _i64s, _native_only, _nthreads
from .adaptive import native_library as _native_lib
from .geometry import ConvGeometry
from .opdef import kernel_op

__all__ = [
    "union_compact",
    "union_pack",
    "union_wc",
    "union_conv_fwd",
    "union_conv_igrad_w",
    "union_conv_igrad_x",
    "union_conv_wgrad",
    "union_conv_wgrad_dy",
    "union_conv_wgrad_dy_lists",
    "union_pair_packs",
    "layout16",
    "nhwc_copy",
    "nchw_copy",
]


def _empty_cl(N: int, C: int, H: int, W: int, like: Optional[Tensor] = None, dtype=torch.float32) -> Tensor:
    dev = like.device if like is not None else None
    return torch.empty(N, C, H, W, dtype=dtype, device=dev, memory_format=torch.channels_last)


def _same_dtype(op: str, *tensors: Tensor) -> torch.dtype:
    """The one dtype, float32 or bfloat16, of ``tensors`` (a TypeError naming ``op`` otherwise)."""
    dts = {t.dtype for t in tensors}
    if len(dts) != 1 or not dts <= {torch.float32, torch.bfloat16}:
        raise TypeError(f"{op}: operands must all be float32 or all bfloat16, got {[t.dtype for t in tensors]}")
    return dts.pop()


def _none0(t: Optional[Tensor], like: Optional[Tensor] = None) -> Tensor:
    """``t``, or an empty ``[0]`` float32 tensor for an output not produced."""
    if t is not None:
        return t
    return torch.empty(0, dtype=torch.float32, device=like.device if like is not None else None)


def _dw_empty(shape: Sequence[int], w_stride: Optional[Sequence[int]], like: Optional[Tensor] = None) -> Tensor:
    dev = like.device if like is not None else None
    if w_stride is not None and _dense_strides(shape, w_stride):
        return torch.empty_strided(tuple(shape), tuple(w_stride), dtype=torch.float32, device=dev)
    return torch.empty(tuple(shape), dtype=torch.float32, device=dev)


# ------------------------------------------------------------------------------------------ operand
def _layout16_impl(x: Tensor, channels_last: bool) -> Tensor:
    lib = _native_only("adaptive_layout16")
    src_ok = x.is_contiguous() if channels_last else x.permute(0, 2, 3, 1).is_contiguous()
    if x.dim() != 4 or x.element_size() != 2 or not src_ok:
        raise ValueError(
            f"adaptive_layout16: x ({x.dtype}, {tuple(x.shape)}, strides {x.stride()}) must be a 4-D 16-bit tensor in "
            f"the other memory format ({'NCHW' if channels_last else 'channels-last'}) contiguous"
        )
    N, C, H, W = x.shape
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.empty(N, C, H, W, dtype=x.dtype, memory_format=fmt)
    rows, cols = (C, H * W) if channels_last else (H * W, C)
    lib.sparsa_transpose16(x.data_ptr(), N, rows, cols, out.data_ptr(), _nthreads())
    return out


def _layout16_fake(x, channels_last):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return torch.empty_like(x, memory_format=fmt)


layout16 = kernel_op("adaptive_layout16(Tensor x, bool channels_last) -> Tensor", _layout16_impl, _layout16_fake)


def _fast16(x: Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.dim() == 4 and x.device.type == "cpu" and _native_lib() is not None


def nhwc_copy(x: Tensor) -> Tensor:
    """``x`` (logical ``[N, C, H, W]``) as a contiguous ``[N, H, W, C]`` tensor: a view when ``x`` is channels-last
    already, the 16x16-tile transpose for an NCHW-contiguous bf16 ``x`` where the native kernels run, else
    PyTorch's copy (which moves bf16 one element at a time)."""
    nhwc = x.permute(0, 2, 3, 1)
    if nhwc.is_contiguous():
        return nhwc
    if _fast16(x) and x.is_contiguous():
        return layout16(x, True).permute(0, 2, 3, 1)
    return nhwc.contiguous()


def nchw_copy(x: Tensor) -> Tensor:
    """``x`` (logical ``[N, C, H, W]``) as an NCHW-contiguous tensor, the bf16 transpose as :func:`nhwc_copy`."""
    if x.is_contiguous():
        return x
    if _fast16(x) and x.permute(0, 2, 3, 1).is_contiguous():
        return layout16(x, False)
    return x.contiguous()


def _compact_impl(x: Tensor, relu: bool, write_values: bool) -> Tuple[Tensor, Tensor, Tensor]:
    lib = _native_only("adaptive_union_compact")
    if x.dim() != 4 or x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"adaptive_union_compact needs a 4-D float32 or bfloat16 x, got {x.dtype} {tuple(x.shape)}")
    N, C, H, W = x.shape
    values = torch.empty(N, H, W, C, dtype=x.dtype) if write_values else torch.empty(0, dtype=x.dtype)
    mask = torch.empty(N * H * W, (C + 63) // 64, dtype=torch.int64)
    u4 = ctypes.c_int64(0)
    vp = values.data_ptr() if write_values else None
    if x.dtype == torch.bfloat16:  # the bf16 kernel reads NHWC rows
        nhwc = nhwc_copy(x)
        head = (nhwc.data_ptr(), N, C, H, W)
        nnz = lib.sparsa_union_compact_bf16(*head, int(relu), vp, mask.data_ptr(), ctypes.byref(u4), _nthreads())
    else:
        head = (x.data_ptr(), N, C, H, W, *x.stride())
        nnz = lib.sparsa_union_compact_f32(*head, int(relu), vp, mask.data_ptr(), ctypes.byref(u4), _nthreads())
    if nnz < 0:
        raise RuntimeError(f"adaptive_union_compact failed ({nnz}): this CPU lacks AVX-512 (or AVX512-BF16 for bf16)")
    return values, mask, torch.tensor([nnz, u4.value], dtype=torch.int64)


def _compact_fake(x, relu, write_values):
    N, C, H, W = x.shape
    values = x.new_empty(N, H, W, C) if write_values else x.new_empty(0)
    return values, x.new_empty(N * H * W, (C + 63) // 64, dtype=torch.int64), x.new_empty(2, dtype=torch.int64)


union_compact = kernel_op(
    "adaptive_union_compact(Tensor x, bool relu, bool write_values) -> (Tensor, Tensor, Tensor)",
    _compact_impl,
    _compact_fake,
)


# ------------------------------------------------------------------------------------------ weight packs
def _pack_impl(w: Tensor, want_wf: bool, want_wfl: bool) -> Tuple[Tensor, Tensor]:
    lib = _native_only("adaptive_union_pack")
    O, C, KH, KW = w.shape
    w = w.float()
    wf = torch.empty(O * C * KH * KW, dtype=torch.float32) if want_wf else None
    wfl = torch.empty(O * C * KH * KW, dtype=torch.float32) if want_wfl else None
    rc = lib.sparsa_union_pack_f32(
        w.data_ptr(),
        _i64s(*w.stride()),
        O,
        C,
        KH,
        KW,
        None if wf is None else wf.data_ptr(),
        None if wfl is None else wfl.data_ptr(),
        _nthreads(),
    )
    if rc:
        raise ValueError(f"union_packs: weight {tuple(w.shape)} needs in and out channels that are multiples of 8")
    return _none0(wf), _none0(wfl)


def _pack_fake(w, want_wf, want_wfl):
    n = w.numel()
    return w.new_empty(n if want_wf else 0, dtype=torch.float32), w.new_empty(n if want_wfl else 0, dtype=torch.float32)


union_pack = kernel_op(
    "adaptive_union_pack(Tensor w, bool want_wf, bool want_wfl) -> (Tensor, Tensor)", _pack_impl, _pack_fake
)


def _wc_impl(wf: Tensor, w_shape: List[int]) -> Tensor:
    lib = _native_only("adaptive_union_wc")
    O, C, KH, KW = (int(v) for v in w_shape)
    if wf.numel() != O * C * KH * KW:
        raise ValueError(
            f"adaptive_union_wc: wf holds {wf.numel()} values, the weight {list(w_shape)} needs "
            f"{O * C * KH * KW}; pass the forward pack of that weight"
        )
    wf = wf.contiguous()
    wc = torch.empty(O * C * KH * KW, dtype=torch.float32)
    lib.sparsa_union_wc_from_wf_f32(wf.data_ptr(), O, C, KH * KW, wc.data_ptr(), _nthreads())
    return wc


union_wc = kernel_op(
    "adaptive_union_wc(Tensor wf, int[] w_shape) -> Tensor", _wc_impl, lambda wf, w_shape: wf.new_empty(wf.numel())
)


# ------------------------------------------------------------------------------------------ convs
def _fwd_impl(
    values: Tensor,
    mask: Tensor,
    wp: Tensor,
    bias: Optional[Tensor],
    geo: List[int],
    omask: Optional[Tensor],
    tiles: int,
    group: int,
) -> Tensor:
    lib = _native_only("adaptive_union_conv_fwd")
    G = ConvGeometry.of(geo)
    dt = _same_dtype("adaptive_union_conv_fwd", values, wp)
    b = None if bias is None else bias.float().contiguous()
    y = _empty_cl(G.N, G.O, G.Ho, G.Wo, dtype=dt)
    rc = (lib.sparsa_union_conv_fwd_bf16 if dt == torch.bfloat16 else lib.sparsa_union_conv_fwd_f32)(
        G.c(),
        values.data_ptr(),
        mask.data_ptr(),
        wp.data_ptr(),
        None if b is None else b.data_ptr(),
        y.data_ptr(),
        None if omask is None else omask.data_ptr(),
        tiles,
        group,
        _nthreads(),
    )
    if rc:
        raise RuntimeError(f"adaptive_union_conv_fwd failed ({rc}) for geometry {G} ({dt})")
    return y


def _fwd_fake(values, mask, wp, bias, geo, omask, tiles, group):
    G = ConvGeometry.of(geo)
    return _empty_cl(G.N, G.O, G.Ho, G.Wo, like=values, dtype=values.dtype)


union_conv_fwd = kernel_op(
    "adaptive_union_conv_fwd(Tensor values, Tensor mask, Tensor wp, Tensor? bias, int[] geo, "
    "Tensor? omask, int tiles, int group) -> Tensor",
    _fwd_impl,
    _fwd_fake,
)


def _igrad_w_impl(values: Tensor, mask: Tensor, w: Tensor, geo: List[int], omask: Tensor, group: int) -> Tensor:
    lib = _native_only("adaptive_union_conv_igrad_w")
    G = ConvGeometry.of(geo)  # the dY geometry (igrad_dy_geometry)
    dx = _empty_cl(G.N, G.O, G.Ho, G.Wo)
    rc = lib.sparsa_union_conv_igrad_w_f32(
        G.c(),
        values.data_ptr(),
        mask.data_ptr(),
        w.data_ptr(),
        _i64s(*w.stride()),
        dx.data_ptr(),
        omask.data_ptr(),
        group,
        _nthreads(),
    )
    if rc:
        raise RuntimeError(f"sparsa_union_conv_igrad_w_f32 failed ({rc}) for geometry {G}")
    return dx


def _igrad_w_fake(values, mask, w, geo, omask, group):
    G = ConvGeometry.of(geo)
    return _empty_cl(G.N, G.O, G.Ho, G.Wo, like=values)


union_conv_igrad_w = kernel_op(
    "adaptive_union_conv_igrad_w(Tensor values, Tensor mask, Tensor w, int[] geo, Tensor omask, int group) -> Tensor",
    _igrad_w_impl,
    _igrad_w_fake,
)


def _igrad_x_impl(mask: Tensor, dy: Tensor, wc: Tensor, geo: List[int], lists: bool) -> Tensor:
    lib = _native_only("adaptive_union_conv_igrad_x")
    G = ConvGeometry.of(geo)
    dt = _same_dtype("adaptive_union_conv_igrad_x", dy, wc)
    dy, wc = dy.contiguous(), wc.contiguous()
    dx = _empty_cl(G.N, G.C, G.H, G.W, dtype=dt)
    kernel = lib.sparsa_union_conv_igrad_x_bf16 if dt == torch.bfloat16 else lib.sparsa_union_conv_igrad_x_f32
    rc = kernel(G.c(), mask.data_ptr(), dy.data_ptr(), wc.data_ptr(), dx.data_ptr(), int(lists), _nthreads())
    if rc:
        raise RuntimeError(f"adaptive_union_conv_igrad_x failed ({rc}) for geometry {G} ({dt})")
    return dx


def _igrad_x_fake(mask, dy, wc, geo, lists):
    G = ConvGeometry.of(geo)
    return _empty_cl(G.N, G.C, G.H, G.W, like=dy, dtype=dy.dtype)


union_conv_igrad_x = kernel_op(
    "adaptive_union_conv_igrad_x(Tensor mask, Tensor dy, Tensor wc, int[] geo, bool lists) -> Tensor",
    _igrad_x_impl,
    _igrad_x_fake,
)


def _wgrad_impl(
    values: Tensor, mask: Tensor, dy: Tensor, geo: List[int], w_stride: Optional[List[int]], lists: bool
) -> Tensor:
    lib = _native_only("adaptive_union_conv_wgrad")
    G = ConvGeometry.of(geo)
    C, O, KH, KW = G.C, G.O, G.KH, G.KW
    dy = dy.contiguous()
    dw = _dw_empty((O, C, KH, KW), w_stride)
    bf16 = values.dtype == torch.bfloat16
    if bf16 != (dy.dtype == torch.bfloat16):
        raise TypeError(
            f"adaptive_union_conv_wgrad: values {values.dtype} and dy {dy.dtype} must both be float32 or both bfloat16"
        )
    if lists:  # written straight into dw's layout
        fn = lib.sparsa_union_conv_wgrad_lists_bf16 if bf16 else lib.sparsa_union_conv_wgrad_lists_f32
        rc = fn(
            G.c(), values.data_ptr(), mask.data_ptr(), dy.data_ptr(), dw.data_ptr(), _i64s(*dw.stride()), _nthreads()
        )
        if rc:
            raise RuntimeError(f"the union list weight gradient failed ({rc}) for geometry {G} ({values.dtype})")
        return dw
    K2 = KH * KW
    s0, s1, s2, s3 = dw.stride()
    if s0 == C * K2 and s1 == 1 and s2 == KW * C and s3 == C:  # [O, KH, KW, C]: rows (kh, kw, c)
        rs = (1, KW * C, C, 0)
    elif s0 == C * K2 and s1 == K2 and s2 == KW and s3 == 1:  # [O, C, KH, KW]: rows (c, kh, kw)
        rs = (K2, KW, 1, 0)
    else:
        rs = None
    S = torch.empty(C * K2, O, dtype=torch.float32)
    rc = (lib.sparsa_union_conv_wgrad_bf16 if bf16 else lib.sparsa_union_conv_wgrad_f32)(
        G.c(),
        values.data_ptr(),
        mask.data_ptr(),
        dy.data_ptr(),
        S.data_ptr(),
        _i64s(*(rs or (K2, KW, 1, 0))),
        O,
        1,
        _nthreads(),
    )
    if rc:
        raise RuntimeError(f"adaptive_union_conv_wgrad failed ({rc}) for geometry {G} ({values.dtype})")
    if rs is None:
        return dw.copy_(S.view(C, KH, KW, O).permute(3, 0, 1, 2))
    lib.sparsa_union_transpose_f32(S.data_ptr(), C * K2, O, dw.data_ptr(), _nthreads())
    return dw


def _wgrad_fake(values, mask, dy, geo, w_stride, lists):
    G = ConvGeometry.of(geo)
    return _dw_empty((G.O, G.C, G.KH, G.KW), w_stride, like=dy)


union_conv_wgrad = kernel_op(
    "adaptive_union_conv_wgrad(Tensor values, Tensor mask, Tensor dy, int[] geo, "
    "int[]? w_stride, bool lists) -> Tensor",
    _wgrad_impl,
    _wgrad_fake,
)


def _dy_side_dw(lib, G: ConvGeometry, w_stride: Optional[List[int]], run: Callable[[Tensor], int], what: str) -> Tensor:
    """``dW`` of a dY-driven weight gradient: ``run(S)`` writes it into ``S`` as ``[O, KH, KW, C]`` (the flipped
    conv's (c' = o, kh, kw) row is dW[o, :, KH-1-kh, KW-1-kw]), which is ``dW`` itself for channels-last strides,
    else transposed into ``dW``'s layout."""
    C, O, KH, KW = G.C, G.O, G.KH, G.KW
    dw = _dw_empty((O, C, KH, KW), w_stride)
    K2 = KH * KW
    s0, s1, s2, s3 = dw.stride()
    direct = s0 == C * K2 and s1 == 1 and s2 == KW * C and s3 == C
    oihw = s0 == C * K2 and s1 == K2 and s2 == KW and s3 == 1
    S = dw if direct else torch.empty(O, KH, KW, C, dtype=torch.float32)
    rc = run(S)
    if rc:
        raise RuntimeError(f"{what} failed ({rc}) for geometry {G}")
    if oihw:  # per output channel a [KH*KW x C] -> [C x KH*KW] transpose
        lib.sparsa_union_transpose_batched_f32(S.data_ptr(), O, K2, C, dw.data_ptr(), _nthreads())
    elif not direct:
        dw.copy_(S.permute(0, 3, 1, 2))
    return dw


def _wgrad_dy_impl(
    gvalues: Tensor, gmask: Tensor, xr_nhwc: Tensor, geo: List[int], w_stride: Optional[List[int]]
) -> Tensor:
    lib = _native_only("adaptive_union_conv_wgrad_dy")
    from .adaptive import igrad_dy_geometry

    G = ConvGeometry.of(geo)
    g2, xr, K2 = igrad_dy_geometry(G), xr_nhwc.contiguous(), G.KH * G.KW

    def run(S: Tensor) -> int:
        rs = _i64s(K2, -G.KW, -1, K2 - 1)
        return lib.sparsa_union_conv_wgrad_f32(
            g2.c(), gvalues.data_ptr(), gmask.data_ptr(), xr.data_ptr(), S.data_ptr(), rs, G.C, 0, _nthreads()
        )

    return _dy_side_dw(lib, G, w_stride, run, "sparsa_union_conv_wgrad_f32 (dY-driven)")


def _wgrad_dy_fake(gvalues, gmask, xr_nhwc, geo, w_stride):
    G = ConvGeometry.of(geo)
    return _dw_empty((G.O, G.C, G.KH, G.KW), w_stride, like=xr_nhwc)


union_conv_wgrad_dy = kernel_op(
    "adaptive_union_conv_wgrad_dy(Tensor gvalues, Tensor gmask, Tensor xr_nhwc, int[] geo, int[]? w_stride) -> Tensor",
    _wgrad_dy_impl,
    _wgrad_dy_fake,
)


def _wgrad_dy_lists_impl(
    gvalues: Tensor, gmask: Tensor, xr_nhwc: Tensor, geo: List[int], w_stride: Optional[List[int]]
) -> Tensor:
    lib = _native_only("adaptive_union_conv_wgrad_dy_lists")
    from .adaptive import igrad_dy_geometry

    G = ConvGeometry.of(geo)
    if gvalues.dtype != xr_nhwc.dtype or gvalues.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(
            f"adaptive_union_conv_wgrad_dy_lists: gvalues {gvalues.dtype} and xr_nhwc {xr_nhwc.dtype} must both be "
            "float32 or both bfloat16"
        )
    g2, xr, C, K2 = igrad_dy_geometry(G), xr_nhwc.contiguous(), G.C, G.KH * G.KW
    fn = (
        lib.sparsa_union_conv_wgrad_lists_bf16
        if gvalues.dtype == torch.bfloat16
        else lib.sparsa_union_conv_wgrad_lists_f32
    )

    def run(S: Tensor) -> int:
        # the list kernel on the flipped conv (dY its input, relu(x) its output gradient) computes dW'[c, o, i, j] =
        # dW[o, c, KH-1-i, KW-1-j]: written into S [O, KH, KW, C] through strides that swap and flip
        base = S.data_ptr() + 4 * ((G.KH - 1) * G.KW * C + (G.KW - 1) * C)
        ws = _i64s(1, K2 * C, -G.KW * C, -C)
        return fn(g2.c(), gvalues.data_ptr(), gmask.data_ptr(), xr.data_ptr(), base, ws, _nthreads())

    return _dy_side_dw(lib, G, w_stride, run, f"adaptive_union_conv_wgrad_dy_lists ({gvalues.dtype})")


union_conv_wgrad_dy_lists = kernel_op(
    "adaptive_union_conv_wgrad_dy_lists(Tensor gvalues, Tensor gmask, Tensor xr_nhwc, int[] geo, int[]? w_stride) "
    "-> Tensor",
    _wgrad_dy_lists_impl,
    _wgrad_dy_fake,
)


# ------------------------------------------------------------------------------------------ bf16 operands
def _pair_packs_impl(w: Tensor, want_fwd: bool, want_flipped: bool) -> Tuple[Tensor, Tensor, Tensor]:
    lib = _native_only("adaptive_union_pair_packs")
    if w.dim() != 4 or w.dtype != torch.float32:
        raise ValueError(
            f"adaptive_union_pair_packs: w must be a float32 [O, C, KH, KW] weight, got {w.dtype} {tuple(w.shape)}"
        )
    O, C, KH, KW = w.shape
    K2 = KH * KW
    # the kernel reads OIHW or channels-last memory (strides given in full: size-1 dims may carry any stride)
    if w.is_contiguous():
        strides = (C * K2, K2, KW, 1)
    elif w.is_contiguous(memory_format=torch.channels_last):
        strides = (K2 * C, 1, KW * C, C)
    else:
        w, strides = w.contiguous(), (C * K2, K2, KW, 1)
    n = w.numel()
    wf2 = torch.empty(n if want_fwd else 0, dtype=torch.bfloat16)
    wc = torch.empty(n if want_fwd else 0, dtype=torch.bfloat16)
    wfl2 = torch.empty(n if want_flipped else 0, dtype=torch.bfloat16)
    rc = lib.sparsa_union_pair_packs_bf16(
        w.data_ptr(),
        _i64s(*strides),
        O,
        C,
        KH,
        KW,
        wf2.data_ptr() if want_fwd else None,
        wfl2.data_ptr() if want_flipped else None,
        wc.data_ptr() if want_fwd else None,
        _nthreads(),
    )
    if rc:
        raise ValueError(
            f"adaptive_union_pair_packs: weight {tuple(w.shape)} needs in and out channels whose union blocks are "
            f"multiples of 16 (rc {rc})"
        )
    return wf2, wfl2, wc


def _pair_packs_fake(w, want_fwd, want_flipped):
    n = w.numel()
    bf = torch.bfloat16
    return (
        w.new_empty(n if want_fwd else 0, dtype=bf),
        w.new_empty(n if want_flipped else 0, dtype=bf),
        w.new_empty(n if want_fwd else 0, dtype=bf),
    )


union_pair_packs = kernel_op(
    "adaptive_union_pair_packs(Tensor w, bool want_fwd, bool want_flipped) -> (Tensor, Tensor, Tensor)",
    _pair_packs_impl,
    _pair_packs_fake,
)
