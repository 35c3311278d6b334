"""Custom ops of the activation-sparse training runtime (``sparsa.adaptive``).

``torch.library`` custom ops (each with a fake implementation and a pure-PyTorch fallback that
runs when the native library in ``csrc/adaptive_*.cpp`` cannot be built or ``SPARSA_NO_NATIVE=1``):

- ``sparsa::adaptive_compact(x, slice)``: fused ReLU + compaction of ``x`` (logical NCHW, any
  strides) into the *sliced padded CSR* operand ``(cnt, idx, val)``: for pixel ``q = (n*H+h)*W+w``
  and channel slice ``s`` (``slice`` channels each), ``cnt[q*S+s]`` nonzeros whose ascending channel
  indices and values sit at ``idx/val[q*C + s*slice : ... + cnt]``. Entries past a count are undefined.
- ``sparsa::adaptive_compact_signed(x, slice)``: the same operand without the ReLU (every element
  ``!= 0``, NaN included), for the output gradient dY.
- ``sparsa::adaptive_conv_fwd``: ``y[N,Ho,Wo,O] = conv2d(relu(x), W) + b`` from the operand.
- ``sparsa::adaptive_conv_wgrad``: ``dWt[KH,KW,C,O]`` from the same operand and ``dy`` (NHWC).
- ``sparsa::adaptive_conv_igrad``: ``dx`` only where ``relu(x) != 0`` (zero elsewhere): exactly the
  gradient of ``conv2d(relu(x), W)`` with respect to ``x``.
- ``sparsa::adaptive_conv_bwd``: both gradients in one call (stride-1 convolutions share one
  per-channel view of the operand, built once; see ``csrc/adaptive_bwd_s1.cpp``).

The training step (``relu_conv2d``) uses the packed ops instead when the native library is
available (native only, no fallback: callers check :func:`packed_supported`):
``sparsa::adaptive_pack_weight`` (the weight packed once per parameter version for the forward and
the input-gradient kernels; :func:`packed_weight` caches it), ``sparsa::adaptive_conv_fwd_packed``
and ``sparsa::adaptive_conv_bwd_packed`` (stride 1: pads dY and writes the weight gradient in
``[O, C, KH, KW]`` inside the kernel, per-thread scratch reused). When dY is sparse,
``sparsa::adaptive_conv_igrad_dy`` computes a stride-1 input gradient as a forward conv of the
compacted dY with ``sparsa::adaptive_pack_flipped`` (cached by :func:`packed_weight_flipped`), and
``sparsa::adaptive_conv_wgrad_dy`` the weight gradient; ``sparsa::adaptive_sample_zeros`` samples a
density. Every op is forward-only: the autograd.Functions of ``sparsa.adaptive`` own the backward.

``geo`` is a :class:`~sparsa.kernels.geometry.ConvGeometry` (see :func:`geometry`); the ops take it
as its flat ``int[]`` and name it again inside. Weights travel transposed,
``Wt = W.permute(2, 3, 1, 0)`` (``[KH, KW, C, O]``).

Example::

    >>> import torch
    >>> from sparsa.kernels import adaptive as K
    >>> x = torch.randn(2, 8, 5, 5); w = torch.randn(16, 8, 3, 3)
    >>> geo = K.geometry(x.shape, w.shape, stride=(1, 1), padding=(1, 1), dilation=(1, 1))
    >>> cnt, idx, val = K.compact(x, 64)
    >>> y = K.conv_fwd(cnt, idx, val, w.permute(2, 3, 1, 0).contiguous(), None, geo)
    >>> ref = torch.nn.functional.conv2d(x.relu(), w, padding=1).permute(0, 2, 3, 1)
    >>> torch.allclose(y, ref, atol=1e-4)
    True
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import loader
from .geometry import ConvGeometry
from .opdef import kernel_op

__all__ = [
    "compact",
    "conv_backward",
    "compact_zeroed",
    "compact_signed",
    "restrict",
    "to_dense",
    "conv_fwd",
    "conv_wgrad",
    "conv_igrad",
    "conv_bwd",
    "geometry",
    "densify",
    "sample_zeros",
    "native_library",
    "native_available",
    "packed_weight",
    "conv_fwd_packed",
    "conv_bwd_packed",
    "conv_wgrad_dy",
    "packed_weight_flipped",
    "igrad_dy_geometry",
    "conv_igrad_dy",
    "pack_weight",
    "pack_flipped",
    "sample_zeros_op",
    "ConvGeometry",
]

_SOURCES = [
    "adaptive_compact.cpp",
    "adaptive_conv.cpp",
    "adaptive_bwd_s1.cpp",
    "adaptive_union.cpp",
    "adaptive_union_bf16.cpp",
    "adaptive_wgrad_lists.cpp",
    "adaptive_igrad_x.cpp",
]
_PAD = 8  # tail room in idx/val (vector stores)


def native_library() -> Optional[ctypes.CDLL]:
    """The native kernel library (typed by ``abi.SIGNATURES["adaptive"]``), or None when the fallbacks
    must run."""
    return loader.load("adaptive", _SOURCES)


def _i64s(*vals: int):
    """A few int64 (strides, pads) for a ``const int64_t*`` argument."""
    return (ctypes.c_int64 * len(vals))(*vals)


def _native_only(op: str) -> ctypes.CDLL:
    lib = native_library()
    if lib is None:
        raise RuntimeError(
            f"sparsa::{op} has no fallback and the native kernels are unavailable (or "
            "SPARSA_NO_NATIVE is set); check packed_supported() before calling it"
        )
    return lib


def sample_zeros(x: Tensor, base: Tensor, slice: int) -> Optional[Tuple[int, int]]:
    """Native monitor sample of a logical ``[N, C, H, W]`` float32 tensor: ``(zero elements, empty
    (pixel, slice) lists)`` over the pixels whose channel-0 element offsets are ``base`` (int64).
    None when the native library is unavailable (the caller then samples with PyTorch ops)."""
    if _use_native(x) is None or x.dtype != torch.float32 or x.dim() != 4:
        return None
    z, e = sample_zeros_op(x, base, int(slice)).tolist()
    return z, e


def _sample_zeros_op_impl(x: Tensor, base: Tensor, slice: int) -> Tensor:
    """``[zero elements, empty lists]`` (int64) of :func:`sample_zeros`; native only."""
    lib = _native_only("adaptive_sample_zeros")
    if x.dim() != 4 or x.dtype != torch.float32 or base.dtype != torch.int64:
        raise TypeError(
            f"adaptive_sample_zeros needs a 4-D float32 x and int64 base, got {x.dtype} "
            f"{tuple(x.shape)} and {base.dtype}"
        )
    base = base.contiguous()
    out = torch.zeros(2, dtype=torch.int64)
    lib.sparsa_adaptive_sample_f32(
        x.data_ptr(), base.data_ptr(), base.numel(), x.shape[1], x.stride(1), int(slice), out.data_ptr()
    )
    return out


def _sample_zeros_op_fake(x, base, slice):
    return base.new_empty(2)


sample_zeros_op = kernel_op(
    "adaptive_sample_zeros(Tensor x, Tensor base, int slice) -> Tensor", _sample_zeros_op_impl, _sample_zeros_op_fake
)


def native_available() -> bool:
    """True when the native kernels are built and enabled."""
    return native_library() is not None


def geometry(
    x_shape: Sequence[int],
    w_shape: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    slice: int = 64,
) -> ConvGeometry:
    """The ``geo`` of the conv ops for an input ``[N, C, H, W]`` and a weight ``[O, C, KH, KW]``."""
    return ConvGeometry.of_conv(x_shape, w_shape, stride, padding, dilation, slice)


def _nthreads() -> int:
    return max(1, torch.get_num_threads())


def _use_native(*ts: Optional[Tensor]) -> Optional[ctypes.CDLL]:
    for t in ts:
        if t is not None and (t.device.type != "cpu" or (t.is_floating_point() and t.dtype != torch.float32)):
            return None
    return native_library()


# ------------------------------------------------------------------------------------------ compact
def _compact_reference(x: Tensor, slice: int, signed: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    N, C, H, W = x.shape
    S = -(-C // slice)
    P = N * H * W
    xh = x.permute(0, 2, 3, 1).reshape(P, C)
    xp = xh.new_zeros(P, S * slice)
    xp[:, :C] = xh
    xp = xp.view(P, S, slice)
    m = (xp != 0) | xp.isnan() if signed else xp > 0
    cnt = m.sum(-1, dtype=torch.int32).reshape(-1)
    pos = torch.cumsum(m, -1, dtype=torch.int64) - 1
    q, s, c = m.nonzero(as_tuple=True)
    flat = q * C + s * slice + pos[q, s, c]
    idx = torch.zeros(P * C + _PAD, dtype=torch.int32)
    val = torch.zeros(P * C + _PAD, dtype=x.dtype)
    idx[flat] = (s * slice + c).to(torch.int32)
    val[flat] = xp[q, s, c]
    return cnt, idx, val


def _compact_any(x: Tensor, slice: int, signed: bool, zeroed: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`compact` (``signed=False``: keep ``x > 0``) or :func:`compact_signed` (keep ``x != 0``);
    ``zeroed``: every entry past a count, and the tail room, 0 (the reference always writes them)."""
    if x.dim() != 4:
        raise ValueError(f"x must be 4-D [N, C, H, W], got shape {tuple(x.shape)}; view a matrix as [1, K, P, 1]")
    lib = _use_native(x)
    if lib is None or x.dtype != torch.float32:
        return _compact_reference(x, slice, signed=signed)
    cnt, idx, val = _compact_empty(x, slice, torch.float32)
    N, C, H, W = x.shape
    if cnt.numel() and C:
        sn, sc, sh, sw = x.stride()
        if signed:
            fn = lib.sparsa_adaptive_compact_signed_f32
        else:
            fn = lib.sparsa_adaptive_compact_zeroed_f32 if zeroed else lib.sparsa_adaptive_compact_f32
        fn(x.data_ptr(), N, C, H, W, sn, sc, sh, sw, slice, cnt.data_ptr(), idx.data_ptr(), val.data_ptr(), _nthreads())
    if zeroed:  # the tail room; everything when the kernel had nothing to write
        start = N * H * W * C if cnt.numel() and C else 0
        idx[start:] = 0
        val[start:] = 0
    return cnt, idx, val


def _compact_empty(x: Tensor, slice: int, dtype: torch.dtype) -> Tuple[Tensor, Tensor, Tensor]:
    """Uninitialised ``(cnt, idx, val)`` for ``x`` (``new_empty``: fake tensors under tracing)."""
    N, C, H, W = x.shape
    P = N * H * W
    return (
        x.new_empty(P * -(-C // slice), dtype=torch.int32),
        x.new_empty(P * C + _PAD, dtype=torch.int32),
        x.new_empty(P * C + _PAD, dtype=dtype),
    )


def _compact_impl(x: Tensor, slice: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Fused ReLU + compaction of ``x`` (logical ``[N, C, H, W]``) into ``(cnt, idx, val)``."""
    return _compact_any(x, slice, signed=False)


def _compact_fake(x, slice):
    return _compact_empty(x, slice, x.dtype)


compact = kernel_op("adaptive_compact(Tensor x, int slice) -> (Tensor, Tensor, Tensor)", _compact_impl, _compact_fake)


def _compact_zeroed_impl(x: Tensor, slice: int) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`compact` with every entry past a count (and the tail room) 0: canonical components."""
    return _compact_any(x, slice, signed=False, zeroed=True)


compact_zeroed = kernel_op(
    "adaptive_compact_zeroed(Tensor x, int slice) -> (Tensor, Tensor, Tensor)", _compact_zeroed_impl, _compact_fake
)


def _compact_signed_impl(x: Tensor, slice: int) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`compact` without the ReLU: keeps every element ``!= 0`` of ``x`` (negative values, NaN
    and infinities too; ``-0.0 == 0`` is dropped like ``+0.0``). Used on the output gradient dY,
    whose zeros (behind the next layer's ReLU) the input-gradient path :func:`conv_igrad_dy` skips."""
    return _compact_any(x, slice, signed=True)


def _compact_signed_fake(x, slice):
    return _compact_empty(x, slice, x.dtype)


compact_signed = kernel_op(
    "adaptive_compact_signed(Tensor x, int slice) -> (Tensor, Tensor, Tensor)",
    _compact_signed_impl,
    _compact_signed_fake,
)


def _entries(cnt: Tensor, P: int, C: int, slice: int) -> Tensor:
    """Bool ``[P, C]``: which idx/val entries of the operand lie inside their list's count (pure PyTorch)."""
    e = torch.arange(C, device=cnt.device)
    return (e % slice).view(1, C) < cnt.reshape(P, -(-C // slice))[:, e // slice]


def _scatter_rows(cnt: Tensor, idx: Tensor, src: Optional[Tensor], P: int, C: int, slice: int) -> Tensor:
    """``[P, C]``: each kept entry's value (``src``; True when None) at its channel, 0 elsewhere."""
    out = torch.zeros(P, C, dtype=torch.bool if src is None else src.dtype, device=cnt.device)
    if P * C:
        valid = _entries(cnt, P, C, slice)
        rows = torch.arange(P, device=cnt.device).view(P, 1).expand(P, C)[valid]
        out[rows, idx[: P * C].view(P, C)[valid].long()] = True if src is None else src[: P * C].view(P, C)[valid]
    return out


def _native_operand(lib, *ts: Tensor) -> bool:
    """Whether the native kernels take the operand tensors: CPU, int32 ``cnt``/``idx``, float32 values."""
    return lib is not None and all(t.dtype in (torch.int32, torch.float32) for t in ts)


def _to_dense_impl(cnt: Tensor, idx: Tensor, val: Tensor, shape: List[int], slice: int) -> Tensor:
    """The dense ``[N, C, H, W]`` (channels-last strided) activation the operand ``(cnt, idx, val)`` of the
    image ``shape`` encodes; entries past a count are not read."""
    N, C, H, W = shape
    P = N * H * W
    lib = _use_native(val, cnt, idx)
    if not _native_operand(lib, cnt, idx, val):
        return _scatter_rows(cnt, idx, val, P, C, slice).view(N, H, W, C).permute(0, 3, 1, 2)
    out = val.new_empty(N, H, W, C)
    if out.numel():
        cnt, idx, val = cnt.contiguous(), idx.contiguous(), val.contiguous()
        lib.sparsa_adaptive_to_dense_f32(
            N, C, H, W, slice, cnt.data_ptr(), idx.data_ptr(), val.data_ptr(), out.data_ptr(), _nthreads()
        )
    return out.permute(0, 3, 1, 2)


def _to_dense_fake(cnt, idx, val, shape, slice):
    N, C, H, W = shape
    return val.new_empty(N, H, W, C).permute(0, 3, 1, 2)


to_dense = kernel_op(
    "adaptive_to_dense(Tensor cnt, Tensor idx, Tensor val, int[] shape, int slice) -> Tensor",
    _to_dense_impl,
    _to_dense_fake,
)


def _restrict_impl(cnt: Tensor, idx: Tensor, y: Tensor, slice: int) -> Tensor:
    """``y`` (logical ``[N, C, H, W]``, any strides) at the positions the operand ``(cnt, idx)`` holds, 0
    elsewhere (a selection: NaN or inf outside the pattern become 0); a new tensor, channels-last strided."""
    if y.dim() != 4:
        raise ValueError(f"y must be 4-D [N, C, H, W], got shape {tuple(y.shape)}; view a matrix as [1, K, P, 1]")
    N, C, H, W = y.shape
    lib = _use_native(y, cnt, idx)
    if not _native_operand(lib, cnt, idx, y):
        keep = _scatter_rows(cnt, idx, None, N * H * W, C, slice).view(N, H, W, C)
        zero = torch.zeros((), dtype=y.dtype, device=y.device)
        return torch.where(keep, y.permute(0, 2, 3, 1), zero).permute(0, 3, 1, 2)
    out = y.new_empty(N, H, W, C)
    if out.numel():
        cnt, idx = cnt.contiguous(), idx.contiguous()
        lib.sparsa_adaptive_restrict_f32(
            y.data_ptr(),
            N,
            C,
            H,
            W,
            _i64s(*y.stride()),
            slice,
            cnt.data_ptr(),
            idx.data_ptr(),
            out.data_ptr(),
            _nthreads(),
        )
    return out.permute(0, 3, 1, 2)


def _restrict_fake(cnt, idx, y, slice):
    N, C, H, W = y.shape
    return y.new_empty(N, H, W, C).permute(0, 3, 1, 2)


restrict = kernel_op(
    "adaptive_restrict(Tensor cnt, Tensor idx, Tensor y, int slice) -> Tensor", _restrict_impl, _restrict_fake
)


def densify(cnt: Tensor, idx: Tensor, val: Tensor, geo: Sequence[int]) -> Tensor:
    """The dense NCHW (channels-last strided) activation an operand encodes (pure PyTorch)."""
    G = ConvGeometry.of(geo)
    P = G.N * G.H * G.W
    return _scatter_rows(cnt, idx, val, P, G.C, G.slice).view(G.N, G.H, G.W, G.C).permute(0, 3, 1, 2)


def _nchw_weight(wt: Tensor) -> Tensor:
    return wt.permute(3, 2, 0, 1)


def safe_dilation(KH: int, KW: int, dh: int, dw: int) -> Tuple[int, int]:
    """The dilation to give ``F.conv2d`` for a ``KH x KW`` kernel: 1 for a size-1 kernel dimension (the same
    conv). torch 2.13's oneDNN conv segfaults on e.g. a 1x1 kernel with dilation 2, stride 2, padding 1, a
    width-1 channels-last input and a bias."""
    return (dh if KH > 1 else 1, dw if KW > 1 else 1)


def _conv_args(geo: Sequence[int]):
    """``F.conv2d`` keyword arguments of ``geo`` (dilation from :func:`safe_dilation`)."""
    G = ConvGeometry.of(geo)
    return dict(stride=(G.sh, G.sw), padding=(G.ph, G.pw), dilation=safe_dilation(G.KH, G.KW, G.dh, G.dw))


def conv_backward(gy: Tensor, x: Tensor, weight: Tensor, geo: Sequence[int], output_mask) -> tuple:
    """``aten.convolution_backward`` of the dense conv ``geo`` (no bias): ``(dx, dW, None)``, each computed only
    where ``output_mask`` (three bools) asks for it."""
    a = _conv_args(geo)
    return torch.ops.aten.convolution_backward(
        gy, x, weight, None, a["stride"], a["padding"], a["dilation"], False, (0, 0), 1, list(output_mask)
    )


# ------------------------------------------------------------------------------------------ forward
def _conv_fwd_impl(
    cnt: Tensor, idx: Tensor, val: Tensor, wt: Tensor, bias: Optional[Tensor], geo: List[int], out_format: int = 0
) -> Tensor:
    """``conv2d(A, W) + bias`` for the compacted ``A``; the memory is NHWC in every ``out_format``:
    0: ``[N, Ho, Wo, O]`` contiguous; 1: ``[N, O, Ho, Wo]`` channels-last; 2: ``[N*Ho*Wo, O]``."""
    G = ConvGeometry.of(geo)
    O = G.O
    lib = _use_native(val, wt, bias)
    if lib is None or O % 8 or val.dtype != torch.float32:
        a = densify(cnt, idx, val, G)
        y = F.conv2d(a, _nchw_weight(wt).to(a.dtype), bias, **_conv_args(G))
        return _fwd_out(y.permute(0, 2, 3, 1).contiguous(), out_format)
    y = _fwd_empty(G, out_format, torch.float32)
    wt = wt.contiguous()
    b = None if bias is None else bias.contiguous()
    rc = lib.sparsa_adaptive_conv_fwd_f32(
        G.c(),
        cnt.data_ptr(),
        idx.data_ptr(),
        val.data_ptr(),
        wt.data_ptr(),
        None if b is None else b.data_ptr(),
        y.data_ptr(),
        _nthreads(),
    )
    if rc:
        raise ValueError(f"adaptive_conv_fwd: out_channels={O} must be a multiple of 8 for the native kernel")
    return y


def _conv_fwd_fake(cnt, idx, val, wt, bias, geo, out_format=0):
    return _fwd_empty(geo, out_format, val.dtype, like=val)


conv_fwd = kernel_op(
    "adaptive_conv_fwd(Tensor cnt, Tensor idx, Tensor val, Tensor wt, Tensor? bias, int[] geo, "
    "int out_format=0) -> Tensor",
    _conv_fwd_impl,
    _conv_fwd_fake,
)


def _fwd_empty(geo: Sequence[int], out_format: int, dtype: torch.dtype, like: Optional[Tensor] = None) -> Tensor:
    G = ConvGeometry.of(geo)
    N, O, Ho, Wo = G.N, G.O, G.Ho, G.Wo
    new = (
        (lambda *s: like.new_empty(*s, dtype=dtype)) if like is not None else (lambda *s: torch.empty(*s, dtype=dtype))
    )
    if out_format == 0:
        return new(N, Ho, Wo, O)
    if out_format == 1:  # [N, O, Ho, Wo] with channels-last strides, allocated as such (not a view: in-place
        # ops on a custom Function's output must be allowed; not a copy of an uninitialised tensor either)
        dev = like.device if like is not None else None
        return torch.empty(N, O, Ho, Wo, dtype=dtype, device=dev, memory_format=torch.channels_last)
    if out_format == 2:
        return new(N * Ho * Wo, O)
    raise ValueError(f"out_format must be 0, 1 or 2, got {out_format!r}")


def _fwd_out(y_nhwc: Tensor, out_format: int) -> Tensor:
    N, Ho, Wo, O = y_nhwc.shape
    out = _fwd_empty(ConvGeometry(N, 0, 0, 0, O, 0, 0, Ho, Wo, 1, 1, 0, 0, 1, 1, 1), out_format, y_nhwc.dtype)
    if out_format == 1:
        out.copy_(y_nhwc.permute(0, 3, 1, 2))
    else:
        out.copy_(y_nhwc.reshape(out.shape))
    return out


# ------------------------------------------------------------------------------------------ weight grad
def _conv_wgrad_impl(cnt: Tensor, idx: Tensor, val: Tensor, dy: Tensor, geo: List[int]) -> Tensor:
    """``dWt[KH, KW, C, O]`` from the compacted ``A`` and ``dy[N, Ho, Wo, O]`` (NHWC)."""
    G = ConvGeometry.of(geo)
    C, O, KH, KW = G.C, G.O, G.KH, G.KW
    lib = _use_native(val, dy)
    if lib is None or O % 8 or dy.dtype != torch.float32:
        a = densify(cnt, idx, val, G).to(dy.dtype)
        dw = torch.nn.grad.conv2d_weight(a, (O, C, KH, KW), dy.permute(0, 3, 1, 2), **_conv_args(G))
        return dw.permute(2, 3, 1, 0).contiguous()
    dwt = torch.empty(KH, KW, C, O, dtype=torch.float32)
    if G.stride1:
        _bwd_s1(lib, cnt, idx, val, dy, None, G, dwt, None)
        return dwt
    dy = dy.contiguous()
    lib.sparsa_adaptive_conv_wgrad_f32(
        G.c(), cnt.data_ptr(), idx.data_ptr(), val.data_ptr(), dy.data_ptr(), dwt.data_ptr(), _nthreads()
    )
    return dwt


def _conv_wgrad_fake(cnt, idx, val, dy, geo):
    G = ConvGeometry.of(geo)
    return dy.new_empty(G.KH, G.KW, G.C, G.O)


conv_wgrad = kernel_op(
    "adaptive_conv_wgrad(Tensor cnt, Tensor idx, Tensor val, Tensor dy, int[] geo) -> Tensor",
    _conv_wgrad_impl,
    _conv_wgrad_fake,
)


# ------------------------------------------------------------------------------------------ input grad
def _conv_igrad_impl(
    cnt: Tensor, idx: Tensor, val: Tensor, dy: Tensor, wt: Tensor, geo: List[int], channels_last: bool
) -> Tensor:
    """``dx[N, C, H, W]``: ``conv2d`` input gradient, computed only where ``A != 0`` (zero elsewhere).

    ``channels_last`` picks the memory format of the result.
    """
    G = ConvGeometry.of(geo)
    N, C, H, W, O = G.N, G.C, G.H, G.W, G.O
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    lib = _use_native(val, dy, wt)
    if lib is None or O % 8 or dy.dtype != torch.float32:
        a = densify(cnt, idx, val, G)
        dx = torch.nn.grad.conv2d_input(
            (N, C, H, W), _nchw_weight(wt).to(dy.dtype), dy.permute(0, 3, 1, 2), **_conv_args(G)
        )
        return (dx * (a != 0)).contiguous(memory_format=fmt)
    dx = torch.empty(N, C, H, W, dtype=torch.float32, memory_format=fmt).zero_()
    if G.stride1:
        _bwd_s1(lib, cnt, idx, val, dy, wt, G, None, dx)
        return dx
    dy = dy.contiguous()
    wt = wt.contiguous()
    lib.sparsa_adaptive_conv_igrad_f32(
        G.c(),
        cnt.data_ptr(),
        idx.data_ptr(),
        dy.data_ptr(),
        wt.data_ptr(),
        dx.data_ptr(),
        _i64s(*dx.stride()),
        _nthreads(),
    )
    return dx


def _conv_igrad_fake(cnt, idx, val, dy, wt, geo, channels_last):
    G = ConvGeometry.of(geo)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return dy.new_empty(G.N, G.C, G.H, G.W).contiguous(memory_format=fmt)


conv_igrad = kernel_op(
    "adaptive_conv_igrad(Tensor cnt, Tensor idx, Tensor val, Tensor dy, Tensor wt, "
    "int[] geo, bool channels_last) -> Tensor",
    _conv_igrad_impl,
    _conv_igrad_fake,
)


# ------------------------------------------------------------------------------------------ both grads
def _stride1(geo: Sequence[int]) -> bool:
    return ConvGeometry.of(geo).stride1


def _pad_dy(dy: Tensor, G: ConvGeometry) -> Tuple[Tensor, Tuple[int, int, int, int]]:
    """``dy`` ([N, Ho, Wo, O]) zero-padded so that every offset of every input pixel reads a valid
    pixel (stride 1), and ``pads = (pt, pl, Hp, Wp)``."""
    pt, pl = max(0, (G.KH - 1) * G.dh - G.ph), max(0, (G.KW - 1) * G.dw - G.pw)
    Hp, Wp = pt + max(G.Ho, G.H + G.ph), pl + max(G.Wo, G.W + G.pw)
    if pt == 0 and pl == 0 and Hp == G.Ho and Wp == G.Wo:
        dyp = dy.contiguous()
    else:
        dyp = dy.new_zeros(G.N, Hp, Wp, G.O)
        dyp[:, pt : pt + G.Ho, pl : pl + G.Wo].copy_(dy)
    return dyp, (pt, pl, Hp, Wp)


def _bwd_s1(lib, cnt, idx, val, dy, wt, G: ConvGeometry, dwt: Optional[Tensor], dx: Optional[Tensor]) -> None:
    dyp, pads = _pad_dy(dy, G)
    wt = wt.contiguous() if wt is not None else None
    rc = lib.sparsa_adaptive_conv_bwd_s1_f32(
        G.c(),
        cnt.data_ptr(),
        idx.data_ptr(),
        val.data_ptr(),
        dyp.data_ptr(),
        _i64s(*pads),
        None if wt is None else wt.data_ptr(),
        None if dwt is None else dwt.data_ptr(),
        None if dx is None else dx.data_ptr(),
        _i64s(*(dx.stride() if dx is not None else (0, 0, 0, 0))),
        _nthreads(),
    )
    if rc:
        raise ValueError(f"adaptive_conv_bwd: geometry {G} needs stride 1 and out_channels % 8 == 0")


def _conv_bwd_impl(
    cnt: Tensor, idx: Tensor, val: Tensor, dy: Tensor, wt: Tensor, geo: List[int], channels_last: bool
) -> Tuple[Tensor, Tensor]:
    """``(dx, dWt)``: :func:`conv_igrad` and :func:`conv_wgrad` in one call (stride 1 shares the work)."""
    G = ConvGeometry.of(geo)
    lib = _use_native(val, dy, wt)
    if lib is None or G.O % 8 or dy.dtype != torch.float32 or not G.stride1:
        return (_conv_igrad_impl(cnt, idx, val, dy, wt, G, channels_last), _conv_wgrad_impl(cnt, idx, val, dy, G))
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    dx = torch.empty(G.N, G.C, G.H, G.W, dtype=torch.float32, memory_format=fmt).zero_()
    dwt = torch.empty(G.KH, G.KW, G.C, G.O, dtype=torch.float32)
    _bwd_s1(lib, cnt, idx, val, dy, wt, G, dwt, dx)
    return dx, dwt


def _conv_bwd_fake(cnt, idx, val, dy, wt, geo, channels_last):
    G = ConvGeometry.of(geo)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return (dy.new_empty(G.N, G.C, G.H, G.W).contiguous(memory_format=fmt), dy.new_empty(G.KH, G.KW, G.C, G.O))


conv_bwd = kernel_op(
    "adaptive_conv_bwd(Tensor cnt, Tensor idx, Tensor val, Tensor dy, Tensor wt, int[] geo, "
    "bool channels_last) -> (Tensor, Tensor)",
    _conv_bwd_impl,
    _conv_bwd_fake,
)


# ------------------------------------------------------------------------------------------ packed weights
# The training step's native path (used by ``relu_conv2d``): the weight is packed once per parameter
# version for both the forward and the input-gradient kernels (instead of transposed/re-packed by
# every call), padding of dY and the weight gradient's layout happen inside the kernel. These ops have
# no fallback: callers check :func:`packed_supported` first.

# id(weight) -> (weakref to the weight, key, (wf, wc)); an entry goes away with its weight. (Not an
# attribute on the Parameter: pickling a module would then carry the packs along.)
_PACKS: Dict[int, tuple] = {}


def packed_supported(*ts: Optional[Tensor]) -> bool:
    """True when the packed native path can run on these tensors (float32 CPU, native library)."""
    for t in ts:
        if t is not None and (t.device.type != "cpu" or t.dtype != torch.float32):
            return False
    return native_library() is not None


def _cached_pack(store: Dict[int, tuple], weight: Tensor, build):
    """``build(w)`` for the detached ``weight``, cached in ``store`` per tensor (while it lives) and
    rebuilt when it changes (its version counter or storage moves)."""
    w = weight.detach()
    key = (w._version, w.data_ptr(), tuple(w.shape), tuple(w.stride()))
    wid = id(weight)
    hit = store.get(wid)
    if hit is not None and hit[0]() is weight and hit[1] == key:
        return hit[2]
    packs = build(w)

    def _drop(ref, wid=wid, store=store):
        ent = store.get(wid)
        if ent is not None and ent[0] is ref:
            del store[wid]

    store[wid] = (weakref.ref(weight, _drop), key, packs)
    return packs


def _pack_weight_impl(w: Tensor) -> Tuple[Tensor, Tensor]:
    """``(wf, wc)`` of :func:`packed_weight`, uncached (native only)."""
    lib = _native_only("adaptive_pack_weight")
    if w.dim() != 4 or w.dtype != torch.float32:
        raise TypeError(f"adaptive_pack_weight needs a float32 [O, C, KH, KW] weight, got {w.dtype} {tuple(w.shape)}")
    O, C, KH, KW = w.shape
    wf = torch.empty(O * C * KH * KW, dtype=torch.float32)
    wc = torch.empty(O * C * KH * KW, dtype=torch.float32)
    rc = lib.sparsa_adaptive_pack_weight_f32(
        w.data_ptr(), _i64s(*w.stride()), O, C, KH, KW, wf.data_ptr(), wc.data_ptr(), _nthreads()
    )
    if rc:
        raise ValueError(f"packed_weight: out_channels={O} must be a multiple of 8")
    return wf, wc


def _pack_weight_fake(w):
    return w.new_empty(w.numel()), w.new_empty(w.numel())


pack_weight = kernel_op("adaptive_pack_weight(Tensor w) -> (Tensor, Tensor)", _pack_weight_impl, _pack_weight_fake)


def packed_weight(weight: Tensor) -> Tuple[Tensor, Tensor]:
    """``(wf, wc)``: ``weight`` ``[O, C, KH, KW]`` (any strides, ``O % 8 == 0``) packed for the forward
    (``[O/OB, KH, KW, C, OB]``) and the input-gradient (``[C, KH, KW, O]``) kernels. Cached per tensor
    (while it lives) and re-packed when it changes (its version counter or storage moves), i.e. once
    per optimizer step."""
    return _cached_pack(_PACKS, weight, pack_weight)


def _pick_ob(O: int) -> int:
    """The output-channel block ``OB`` of the forward pack (``pick_ob`` in csrc/adaptive_conv.cpp):
    the largest multiple of 8 up to 64 that divides ``O``."""
    for b in range(64, 8, -8):
        if O % b == 0:
            return b
    return 8


# id(weight) -> (weakref, key, wf of the flipped transposed weight): the dY-sparse input gradient
_FLIP_PACKS: Dict[int, tuple] = {}


def _pack_flipped_impl(wc: Tensor, w_shape: List[int]) -> Tensor:
    """The flipped forward pack of :func:`packed_weight_flipped` from the input-gradient pack ``wc`` of
    a weight of shape ``w_shape`` (native only)."""
    lib = _native_only("adaptive_pack_flipped")
    O, C, KH, KW = (int(v) for v in w_shape)
    if wc.numel() != O * C * KH * KW or wc.dtype != torch.float32:
        raise ValueError(
            f"adaptive_pack_flipped: wc must hold {O * C * KH * KW} float32 values (the wc of "
            f"packed_weight for shape {list(w_shape)}), got {wc.numel()} {wc.dtype}"
        )
    wc = wc.contiguous()
    wfl = torch.empty(O * C * KH * KW, dtype=torch.float32)
    lib.sparsa_adaptive_pack_flipped_f32(wc.data_ptr(), O, C, KH, KW, wfl.data_ptr(), _nthreads())
    return wfl


def _pack_flipped_fake(wc, w_shape):
    return wc.new_empty(wc.numel())


pack_flipped = kernel_op(
    "adaptive_pack_flipped(Tensor wc, int[] w_shape) -> Tensor", _pack_flipped_impl, _pack_flipped_fake
)


def packed_weight_flipped(weight: Tensor) -> Tensor:
    """The forward pack (as :func:`packed_weight`'s ``wf``) of ``W'[c, o, i, j] = W[o, c, KH-1-i,
    KW-1-j]``: the weight of the forward conv that computes a stride-1 conv's input gradient from dY
    (see :func:`conv_igrad_dy`). Needs ``C % 8 == 0``; cached and re-packed like :func:`packed_weight`."""

    def build(w: Tensor) -> Tensor:
        O, C, KH, KW = w.shape
        if C % 8:
            raise ValueError(f"packed_weight_flipped: in_channels={C} must be a multiple of 8")
        if O % 8 == 0 and w.dtype == torch.float32 and _use_native(w) is not None:
            # tiled transposes of the input-gradient pack, which the forward of this step already made
            # (far cheaper than a strided PyTorch copy)
            return pack_flipped(packed_weight(weight)[1], [O, C, KH, KW])
        ob = _pick_ob(C)
        return (
            w.to(torch.float32).flip(2, 3).reshape(O, C // ob, ob, KH, KW).permute(1, 3, 4, 0, 2).contiguous().view(-1)
        )

    return _cached_pack(_FLIP_PACKS, weight, build)


def _dw_empty(shape: Sequence[int], stride: Optional[Sequence[int]], like: Optional[Tensor] = None) -> Tensor:
    """A float32 weight gradient of ``shape`` with ``stride`` when that lays it out densely, else contiguous."""
    dev = like.device if like is not None else None
    if stride is not None and _dense_strides(shape, stride):
        return torch.empty_strided(tuple(shape), tuple(stride), dtype=torch.float32, device=dev)
    return torch.empty(tuple(shape), dtype=torch.float32, device=dev)


def _conv_wgrad_dy_impl(
    gcnt: Tensor,
    gidx: Tensor,
    gval: Tensor,
    xr_nhwc: Tensor,
    geo: List[int],
    gslice: int,
    w_stride: Optional[List[int]] = None,
) -> Tensor:
    """``dW [O, C, KH, KW]`` of a stride-1 conv (native, ``C % 8 == 0``, ``padding <= dilation * (K - 1)``)
    from the compacted dY: the weight gradient of the flipped conv (input dY, output gradient
    ``relu(x)`` given as contiguous NHWC ``xr_nhwc``), written straight into ``dW``'s flipped,
    transposed positions (negative kernel strides into the weight-gradient kernel's output).
    Work ~ nnz(dY) * C instead of nnz(relu(x)) * O. ``w_stride``: the strides to give ``dW``."""
    lib = _native_only("adaptive_conv_wgrad_dy")
    G = ConvGeometry.of(geo)
    g2 = igrad_dy_geometry(G, gslice)
    if g2.ph < 0 or g2.pw < 0:
        raise ValueError(f"conv_wgrad_dy needs padding <= dilation * (kernel - 1), got geometry {G}")
    dw = _dw_empty((G.O, G.C, G.KH, G.KW), w_stride)
    s0, s1, s2, s3 = dw.stride()
    # dW'[c, o, i, j] (the flipped conv's gradient) lives at dW[o, c, KH-1-i, KW-1-j]
    base = dw.data_ptr() + 4 * ((G.KH - 1) * s2 + (G.KW - 1) * s3)
    xr = xr_nhwc.contiguous()
    rc = lib.sparsa_adaptive_conv_bwd_s1_v2_f32(
        g2.c(),
        gcnt.data_ptr(),
        gidx.data_ptr(),
        gval.data_ptr(),
        xr.data_ptr(),
        None,
        base,
        _i64s(s1, s0, -s2, -s3),
        None,
        None,
        _nthreads(),
    )
    if rc:
        raise ValueError(f"conv_wgrad_dy: geometry {G} needs in_channels % 8 == 0")
    return dw


def _conv_wgrad_dy_fake(gcnt, gidx, gval, xr_nhwc, geo, gslice, w_stride=None):
    G = ConvGeometry.of(geo)
    return _dw_empty((G.O, G.C, G.KH, G.KW), w_stride, like=gval)


conv_wgrad_dy = kernel_op(
    "adaptive_conv_wgrad_dy(Tensor gcnt, Tensor gidx, Tensor gval, Tensor xr_nhwc, "
    "int[] geo, int gslice, int[]? w_stride=None) -> Tensor",
    _conv_wgrad_dy_impl,
    _conv_wgrad_dy_fake,
)


def igrad_dy_geometry(geo: Sequence[int], slice: Optional[int] = None) -> ConvGeometry:
    """The ``geo`` of the forward conv (input dY ``[N, O, Ho, Wo]``, weight :func:`packed_weight_flipped`)
    whose output ``[N, H, W, C]`` is the input gradient of the stride-1 conv ``geo``:
    ``padding' = dilation * (K - 1) - padding`` (may be negative), same dilation, stride 1."""
    G = ConvGeometry.of(geo)
    if not G.stride1:
        raise ValueError(f"igrad_dy_geometry needs a stride-1 geometry, got {G}")
    return ConvGeometry(
        G.N,
        G.O,
        G.Ho,
        G.Wo,
        G.C,
        G.KH,
        G.KW,
        G.H,
        G.W,
        1,
        1,
        G.dh * (G.KH - 1) - G.ph,
        G.dw * (G.KW - 1) - G.pw,
        G.dh,
        G.dw,
        G.slice if slice is None else int(slice),
    )


def _conv_igrad_dy_impl(
    gcnt: Tensor,
    gidx: Tensor,
    gval: Tensor,
    wflip: Tensor,
    cnt: Tensor,
    idx: Tensor,
    geo: List[int],
    gslice: int,
    channels_last: bool,
) -> Tensor:
    """:func:`conv_igrad` of a stride-1 conv (native, ``C % 8 == 0``) computed as a *forward* conv of
    the compacted dY (``(gcnt, gidx, gval)`` from :func:`compact_signed` with ``gslice`` channels a
    slice) with :func:`packed_weight_flipped`, then kept only at the nonzeros of the operand
    ``(cnt, idx)`` of ``relu(x)`` (the ReLU derivative). Work ~ nnz(dY) instead of nnz(relu(x))."""
    lib = _native_only("adaptive_conv_igrad_dy")
    G = ConvGeometry.of(geo)
    y = _conv_fwd_packed_native(lib, gcnt, gidx, gval, wflip, None, igrad_dy_geometry(G, gslice), 0)  # [N, H, W, C]
    if channels_last:
        lib.sparsa_adaptive_mask_f32(
            y.data_ptr(), G.N, G.C, G.H, G.W, G.slice, cnt.data_ptr(), idx.data_ptr(), None, None, _nthreads()
        )
        return y.permute(0, 3, 1, 2)
    dx = torch.zeros(G.N, G.C, G.H, G.W, dtype=torch.float32)
    lib.sparsa_adaptive_mask_f32(
        y.data_ptr(),
        G.N,
        G.C,
        G.H,
        G.W,
        G.slice,
        cnt.data_ptr(),
        idx.data_ptr(),
        dx.data_ptr(),
        _i64s(*dx.stride()),
        _nthreads(),
    )
    return dx


def _conv_igrad_dy_fake(gcnt, gidx, gval, wflip, cnt, idx, geo, gslice, channels_last):
    G = ConvGeometry.of(geo)
    if channels_last:
        return gval.new_empty(G.N, G.H, G.W, G.C).permute(0, 3, 1, 2)
    return gval.new_empty(G.N, G.C, G.H, G.W)


conv_igrad_dy = kernel_op(
    "adaptive_conv_igrad_dy(Tensor gcnt, Tensor gidx, Tensor gval, Tensor wflip, "
    "Tensor cnt, Tensor idx, int[] geo, int gslice, bool channels_last) -> Tensor",
    _conv_igrad_dy_impl,
    _conv_igrad_dy_fake,
)


def _conv_fwd_packed_native(
    lib, cnt: Tensor, idx: Tensor, val: Tensor, wf: Tensor, bias: Optional[Tensor], G: ConvGeometry, out_format: int
) -> Tensor:
    y = _fwd_empty(G, out_format, torch.float32)
    b = None if bias is None else bias.contiguous()
    rc = lib.sparsa_adaptive_conv_fwd_packed_f32(
        G.c(),
        cnt.data_ptr(),
        idx.data_ptr(),
        val.data_ptr(),
        wf.data_ptr(),
        None if b is None else b.data_ptr(),
        y.data_ptr(),
        _nthreads(),
    )
    if rc:
        raise ValueError(f"adaptive_conv_fwd: out_channels={G.O} must be a multiple of 8 for the native kernel")
    return y


def _conv_fwd_packed_impl(
    cnt: Tensor, idx: Tensor, val: Tensor, wf: Tensor, bias: Optional[Tensor], geo: List[int], out_format: int = 1
) -> Tensor:
    """:func:`conv_fwd` from the forward pack of :func:`packed_weight` (native only)."""
    return _conv_fwd_packed_native(
        _native_only("adaptive_conv_fwd_packed"), cnt, idx, val, wf, bias, ConvGeometry.of(geo), out_format
    )


def _conv_fwd_packed_fake(cnt, idx, val, wf, bias, geo, out_format=1):
    return _fwd_empty(geo, out_format, torch.float32, like=val)


conv_fwd_packed = kernel_op(
    "adaptive_conv_fwd_packed(Tensor cnt, Tensor idx, Tensor val, Tensor wf, "
    "Tensor? bias, int[] geo, int out_format=1) -> Tensor",
    _conv_fwd_packed_impl,
    _conv_fwd_packed_fake,
)


def _dense_strides(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """True when ``stride`` lays ``shape`` out densely (a permutation of a contiguous layout)."""
    if len(stride) != len(shape):
        return False
    expect = 1
    for st, sz in sorted(zip(stride, shape)):
        if sz != 1 and st != expect:
            return False
        expect *= sz
    return True


def _bwd_packed_empty(
    G: ConvGeometry,
    channels_last: bool,
    need_dx: bool,
    need_dw: bool,
    dw_stride: Optional[Sequence[int]],
    like: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """The op's outputs: ``(dx, dw)``, an empty ``[0]`` tensor for one not asked for."""
    dev = like.device if like is not None else None
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    dx = (
        torch.empty(G.N, G.C, G.H, G.W, dtype=torch.float32, device=dev, memory_format=fmt)
        if need_dx
        else torch.empty(0, dtype=torch.float32, device=dev)
    )
    dw = (
        _dw_empty((G.O, G.C, G.KH, G.KW), dw_stride, like)
        if need_dw
        else torch.empty(0, dtype=torch.float32, device=dev)
    )
    return dx, dw


def _conv_bwd_packed_op_impl(
    cnt: Tensor,
    idx: Tensor,
    val: Tensor,
    dy: Tensor,
    wc: Tensor,
    geo: List[int],
    channels_last: bool,
    need_dx: bool,
    need_dw: bool,
    dw_stride: Optional[List[int]] = None,
) -> Tuple[Tensor, Tensor]:
    """:func:`conv_bwd_packed` with an empty ``[0]`` tensor for a gradient not asked for (native only)."""
    lib = _native_only("adaptive_conv_bwd_packed")
    G = ConvGeometry.of(geo)
    dx, dw = _bwd_packed_empty(G, channels_last, need_dx, need_dw, dw_stride)
    if not (need_dx or need_dw):
        return dx, dw
    if need_dx:
        dx.zero_()
    dy = dy.contiguous()
    rc = lib.sparsa_adaptive_conv_bwd_s1_v2_f32(
        G.c(),
        cnt.data_ptr(),
        idx.data_ptr(),
        val.data_ptr(),
        dy.data_ptr(),
        wc.data_ptr(),
        dw.data_ptr() if need_dw else None,
        _i64s(*(dw.stride() if need_dw else (0, 0, 0, 0))),
        dx.data_ptr() if need_dx else None,
        _i64s(*(dx.stride() if need_dx else (0, 0, 0, 0))),
        _nthreads(),
    )
    if rc:
        raise ValueError(f"adaptive_conv_bwd: geometry {G} needs stride 1 and out_channels % 8 == 0")
    return dx, dw


def _conv_bwd_packed_op_fake(cnt, idx, val, dy, wc, geo, channels_last, need_dx, need_dw, dw_stride=None):
    return _bwd_packed_empty(ConvGeometry.of(geo), channels_last, need_dx, need_dw, dw_stride, like=dy)


_conv_bwd_packed_op = kernel_op(
    "adaptive_conv_bwd_packed(Tensor cnt, Tensor idx, Tensor val, Tensor dy, "
    "Tensor wc, int[] geo, bool channels_last, bool need_dx, bool need_dw, "
    "int[]? dw_stride=None) -> (Tensor, Tensor)",
    _conv_bwd_packed_op_impl,
    _conv_bwd_packed_op_fake,
)


def conv_bwd_packed(
    cnt: Tensor,
    idx: Tensor,
    val: Tensor,
    dy: Tensor,
    wc: Tensor,
    geo: List[int],
    channels_last: bool,
    need_dx: bool,
    need_dw: bool,
    dw_stride: Optional[Sequence[int]] = None,
) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """``(dx, dw)`` of a stride-1 conv: ``dx`` as :func:`conv_igrad`, ``dw`` directly in the
    ``[O, C, KH, KW]`` layout (with the weight's strides ``dw_stride`` when given, so autograd keeps
    it without a copy). ``dy`` is NHWC; ``wc`` the input-gradient pack of :func:`packed_weight`.
    None for a gradient not asked for."""
    G = ConvGeometry.of(geo)
    if not G.stride1:
        raise ValueError(f"conv_bwd_packed needs a stride-1 geometry, got {G}")
    if not (need_dx or need_dw):
        return None, None
    dx, dw = _conv_bwd_packed_op(
        cnt,
        idx,
        val,
        dy,
        wc,
        G,
        bool(channels_last),
        bool(need_dx),
        bool(need_dw),
        None if dw_stride is None else [int(v) for v in dw_stride],
    )
    return (dx if need_dx else None), (dw if need_dw else None)
