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

The training step (``relu_conv2d``) uses three plain functions instead when the native library is
available: :func:`packed_weight` (the weight packed once per parameter version for the forward and
the input-gradient kernels), :func:`conv_fwd_packed` and :func:`conv_bwd_packed` (stride 1: pads dY
and writes the weight gradient in ``[O, C, KH, KW]`` inside the kernel, per-thread scratch reused).
When dY is sparse, :func:`conv_igrad_dy` computes a stride-1 input gradient as a forward conv of the
compacted dY with :func:`packed_weight_flipped` (cached like :func:`packed_weight`).

``geo`` is ``[N, C, H, W, O, KH, KW, Ho, Wo, sh, sw, ph, pw, dh, dw, slice]`` (see :func:`geometry`).
Weights travel transposed, ``Wt = W.permute(2, 3, 1, 0)`` (``[KH, KW, C, O]``).

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

__all__ = ["compact", "compact_signed", "conv_fwd", "conv_wgrad", "conv_igrad", "conv_bwd", "geometry", "densify",
           "sample_zeros", "native_library", "native_available", "packed_weight", "conv_fwd_packed", "conv_bwd_packed",
           "conv_wgrad_dy",
           "packed_weight_flipped", "igrad_dy_geometry", "conv_igrad_dy"]

_SOURCES = ["adaptive_compact.cpp", "adaptive_conv.cpp", "adaptive_bwd_s1.cpp", "adaptive_union.cpp",
            "adaptive_wgrad_lists.cpp", "adaptive_igrad_x.cpp"]
_PAD = 8  # tail room in idx/val (vector stores)


def native_library() -> Optional[ctypes.CDLL]:
    """The native kernel library, or None when the fallbacks must run."""
    lib = loader.load("adaptive", _SOURCES)
    if lib is not None and not getattr(lib, "_sparsa_typed", False):
        i64, vp, ci = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        lib.sparsa_adaptive_compact_f32.argtypes = [vp] + [i64] * 9 + [vp, vp, vp, ci]
        lib.sparsa_adaptive_compact_f32.restype = i64
        lib.sparsa_adaptive_compact_signed_f32.argtypes = [vp] + [i64] * 9 + [vp, vp, vp, ci]
        lib.sparsa_adaptive_compact_signed_f32.restype = i64
        lib.sparsa_adaptive_mask_f32.argtypes = [vp] + [i64] * 5 + [vp, vp, vp, vp, ci]
        lib.sparsa_adaptive_mask_f32.restype = None
        lib.sparsa_adaptive_conv_fwd_f32.argtypes = [vp] * 7 + [ci]
        lib.sparsa_adaptive_conv_fwd_f32.restype = ci
        lib.sparsa_adaptive_conv_wgrad_f32.argtypes = [vp] * 6 + [ci]
        lib.sparsa_adaptive_conv_wgrad_f32.restype = ci
        lib.sparsa_adaptive_conv_igrad_f32.argtypes = [vp] * 7 + [ci]
        lib.sparsa_adaptive_conv_igrad_f32.restype = ci
        lib.sparsa_adaptive_conv_bwd_s1_f32.argtypes = [vp] * 10 + [ci]
        lib.sparsa_adaptive_conv_bwd_s1_f32.restype = ci
        lib.sparsa_adaptive_conv_fwd_packed_f32.argtypes = [vp] * 7 + [ci]
        lib.sparsa_adaptive_conv_fwd_packed_f32.restype = ci
        lib.sparsa_adaptive_pack_weight_f32.argtypes = [vp, vp] + [i64] * 4 + [vp, vp, ci]
        lib.sparsa_adaptive_pack_weight_f32.restype = ci
        lib.sparsa_adaptive_pack_flipped_f32.argtypes = [vp] + [i64] * 4 + [vp, ci]
        lib.sparsa_adaptive_pack_flipped_f32.restype = ci
        lib.sparsa_adaptive_conv_bwd_s1_v2_f32.argtypes = [vp] * 10 + [ci]
        lib.sparsa_adaptive_conv_bwd_s1_v2_f32.restype = ci
        lib.sparsa_adaptive_sample_f32.argtypes = [vp, vp, i64, i64, i64, i64, vp]
        lib.sparsa_adaptive_sample_f32.restype = None
        lib._sparsa_typed = True
    return lib


def sample_zeros(x: Tensor, base: Tensor, slice: int) -> Optional[Tuple[int, int]]:
    """Native monitor sample of a logical ``[N, C, H, W]`` float32 tensor: ``(zero elements, empty
    (pixel, slice) lists)`` over the pixels whose channel-0 element offsets are ``base`` (int64).
    None when the native library is unavailable (the caller then samples with PyTorch ops)."""
    lib = _use_native(x)
    if lib is None or x.dtype != torch.float32 or x.dim() != 4:
        return None
    out = torch.zeros(2, dtype=torch.int64)
    lib.sparsa_adaptive_sample_f32(x.data_ptr(), base.data_ptr(), base.numel(), x.shape[1], x.stride(1),
                                   int(slice), out.data_ptr())
    return int(out[0]), int(out[1])


def native_available() -> bool:
    """True when the native kernels are built and enabled."""
    return native_library() is not None


def geometry(x_shape: Sequence[int], w_shape: Sequence[int], stride: Sequence[int],
             padding: Sequence[int], dilation: Sequence[int], slice: int = 64) -> List[int]:
    """The ``geo`` list of the conv ops for an input ``[N, C, H, W]`` and a weight ``[O, C, KH, KW]``."""
    N, C, H, W = (int(v) for v in x_shape)
    O, Cw, KH, KW = (int(v) for v in w_shape)
    if Cw != C:
        raise ValueError(f"weight has {Cw} input channels but the input has {C}; pass matching shapes")
    sh, sw = (int(v) for v in stride)
    ph, pw = (int(v) for v in padding)
    dh, dw = (int(v) for v in dilation)
    Ho = (H + 2 * ph - dh * (KH - 1) - 1) // sh + 1
    Wo = (W + 2 * pw - dw * (KW - 1) - 1) // sw + 1
    return [N, C, H, W, O, KH, KW, Ho, Wo, sh, sw, ph, pw, dh, dw, int(slice)]


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


def _compact_impl(x: Tensor, slice: int, signed: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`compact` (``signed=False``: keep ``x > 0``) or :func:`compact_signed` (keep ``x != 0``)."""
    if x.dim() != 4:
        raise ValueError(f"x must be 4-D [N, C, H, W], got shape {tuple(x.shape)}; view a matrix as [1, K, P, 1]")
    lib = _use_native(x)
    if lib is None or x.dtype != torch.float32:
        return _compact_reference(x, slice, signed=signed)
    cnt, idx, val = _compact_empty(x, slice, torch.float32)
    N, C, H, W = x.shape
    if cnt.numel() and C:
        sn, sc, sh, sw = x.stride()
        fn = lib.sparsa_adaptive_compact_signed_f32 if signed else lib.sparsa_adaptive_compact_f32
        fn(x.data_ptr(), N, C, H, W, sn, sc, sh, sw, slice, cnt.data_ptr(), idx.data_ptr(), val.data_ptr(),
           _nthreads())
    return cnt, idx, val


def _compact_empty(x: Tensor, slice: int, dtype: torch.dtype) -> Tuple[Tensor, Tensor, Tensor]:
    """Uninitialised ``(cnt, idx, val)`` for ``x`` (``new_empty``: fake tensors under tracing)."""
    N, C, H, W = x.shape
    P = N * H * W
    return (x.new_empty(P * -(-C // slice), dtype=torch.int32), x.new_empty(P * C + _PAD, dtype=torch.int32),
            x.new_empty(P * C + _PAD, dtype=dtype))


@torch.library.custom_op("sparsa::adaptive_compact", mutates_args=())
def compact(x: Tensor, slice: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Fused ReLU + compaction of ``x`` (logical ``[N, C, H, W]``) into ``(cnt, idx, val)``."""
    return _compact_impl(x, slice, signed=False)


@compact.register_fake
def _(x, slice):
    return _compact_empty(x, slice, x.dtype)


@torch.library.custom_op("sparsa::adaptive_compact_signed", mutates_args=())
def compact_signed(x: Tensor, slice: int) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`compact` without the ReLU: keeps every element ``!= 0`` of ``x`` (negative values, NaN
    and infinities too; ``-0.0 == 0`` is dropped like ``+0.0``). Used on the output gradient dY,
    whose zeros (behind the next layer's ReLU) the input-gradient path :func:`conv_igrad_dy` skips."""
    return _compact_impl(x, slice, signed=True)


@compact_signed.register_fake
def _(x, slice):
    return _compact_empty(x, slice, x.dtype)


def densify(cnt: Tensor, idx: Tensor, val: Tensor, geo: Sequence[int]) -> Tensor:
    """The dense NCHW (channels-last strided) activation an operand encodes (pure PyTorch)."""
    N, C, H, W, CS = geo[0], geo[1], geo[2], geo[3], geo[15]
    S = -(-C // CS)
    P = N * H * W
    c = cnt.reshape(P, S).long()
    j = torch.arange(CS).view(1, 1, CS)
    valid = j < c.unsqueeze(-1)
    base = (torch.arange(P).view(P, 1, 1) * C + torch.arange(S).view(1, S, 1) * CS + j)
    pos = base[valid]
    rows = torch.arange(P).view(P, 1, 1).expand(P, S, CS)[valid]
    out = torch.zeros(P, C, dtype=val.dtype)
    out[rows, idx[pos].long()] = val[pos]
    return out.view(N, H, W, C).permute(0, 3, 1, 2)


def _nchw_weight(wt: Tensor) -> Tensor:
    return wt.permute(3, 2, 0, 1)


def _conv_args(geo: Sequence[int]):
    """``F.conv2d`` keyword arguments of ``geo``. The dilation of a size-1 kernel dimension is set to 1
    (the same conv): torch 2.13's oneDNN conv segfaults on e.g. a 1x1 kernel with dilation 2, stride 2,
    padding 1, a width-1 channels-last input and a bias."""
    return dict(stride=(geo[9], geo[10]), padding=(geo[11], geo[12]),
                dilation=(geo[13] if geo[5] > 1 else 1, geo[14] if geo[6] > 1 else 1))


# ------------------------------------------------------------------------------------------ forward
@torch.library.custom_op("sparsa::adaptive_conv_fwd", mutates_args=())
def conv_fwd(cnt: Tensor, idx: Tensor, val: Tensor, wt: Tensor, bias: Optional[Tensor],
             geo: List[int], out_format: int = 0) -> Tensor:
    """``conv2d(A, W) + bias`` for the compacted ``A``; the memory is NHWC in every ``out_format``:
    0: ``[N, Ho, Wo, O]`` contiguous; 1: ``[N, O, Ho, Wo]`` channels-last; 2: ``[N*Ho*Wo, O]``."""
    O = geo[4]  # out_channels
    lib = _use_native(val, wt, bias)
    if lib is None or O % 8 or val.dtype != torch.float32:
        a = densify(cnt, idx, val, geo)
        y = F.conv2d(a, _nchw_weight(wt).to(a.dtype), bias, **_conv_args(geo))
        return _fwd_out(y.permute(0, 2, 3, 1).contiguous(), out_format)
    y = _fwd_empty(geo, out_format, torch.float32)
    g = torch.tensor(geo, dtype=torch.int64)
    wt = wt.contiguous()
    b = None if bias is None else bias.contiguous()
    rc = lib.sparsa_adaptive_conv_fwd_f32(g.data_ptr(), cnt.data_ptr(), idx.data_ptr(), val.data_ptr(),
                                          wt.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(),
                                          _nthreads())
    if rc:
        raise ValueError(f"adaptive_conv_fwd: out_channels={O} must be a multiple of 8 for the native kernel")
    return y


@conv_fwd.register_fake
def _(cnt, idx, val, wt, bias, geo, out_format=0):
    return _fwd_empty(geo, out_format, val.dtype, like=val)


def _fwd_empty(geo: Sequence[int], out_format: int, dtype: torch.dtype, like: Optional[Tensor] = None) -> Tensor:
    N, O, Ho, Wo = geo[0], geo[4], geo[7], geo[8]
    new = (lambda *s: like.new_empty(*s, dtype=dtype)) if like is not None else \
        (lambda *s: torch.empty(*s, dtype=dtype))
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
    out = _fwd_empty([y_nhwc.shape[0], 0, 0, 0, y_nhwc.shape[3], 0, 0, y_nhwc.shape[1], y_nhwc.shape[2]],
                     out_format, y_nhwc.dtype)
    if out_format == 1:
        out.copy_(y_nhwc.permute(0, 3, 1, 2))
    else:
        out.copy_(y_nhwc.reshape(out.shape))
    return out


# ------------------------------------------------------------------------------------------ weight grad
@torch.library.custom_op("sparsa::adaptive_conv_wgrad", mutates_args=())
def conv_wgrad(cnt: Tensor, idx: Tensor, val: Tensor, dy: Tensor, geo: List[int]) -> Tensor:
    """``dWt[KH, KW, C, O]`` from the compacted ``A`` and ``dy[N, Ho, Wo, O]`` (NHWC)."""
    C, O, KH, KW = geo[1], geo[4], geo[5], geo[6]
    lib = _use_native(val, dy)
    if lib is None or O % 8 or dy.dtype != torch.float32:
        a = densify(cnt, idx, val, geo).to(dy.dtype)
        dw = torch.nn.grad.conv2d_weight(a, (O, C, KH, KW), dy.permute(0, 3, 1, 2), **_conv_args(geo))
        return dw.permute(2, 3, 1, 0).contiguous()
    dwt = torch.empty(KH, KW, C, O, dtype=torch.float32)
    if _stride1(geo):
        _bwd_s1(lib, cnt, idx, val, dy, None, geo, dwt, None)
        return dwt
    g = torch.tensor(geo, dtype=torch.int64)
    dy = dy.contiguous()
    lib.sparsa_adaptive_conv_wgrad_f32(g.data_ptr(), cnt.data_ptr(), idx.data_ptr(), val.data_ptr(),
                                       dy.data_ptr(), dwt.data_ptr(), _nthreads())
    return dwt


@conv_wgrad.register_fake
def _(cnt, idx, val, dy, geo):
    return dy.new_empty(geo[5], geo[6], geo[1], geo[4])


# ------------------------------------------------------------------------------------------ input grad
@torch.library.custom_op("sparsa::adaptive_conv_igrad", mutates_args=())
def conv_igrad(cnt: Tensor, idx: Tensor, val: Tensor, dy: Tensor, wt: Tensor, geo: List[int],
               channels_last: bool) -> Tensor:
    """``dx[N, C, H, W]``: ``conv2d`` input gradient, computed only where ``A != 0`` (zero elsewhere).

    ``channels_last`` picks the memory format of the result.
    """
    N, C, H, W, O = geo[0], geo[1], geo[2], geo[3], geo[4]
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    lib = _use_native(val, dy, wt)
    if lib is None or O % 8 or dy.dtype != torch.float32:
        a = densify(cnt, idx, val, geo)
        dx = torch.nn.grad.conv2d_input((N, C, H, W), _nchw_weight(wt).to(dy.dtype), dy.permute(0, 3, 1, 2),
                                        **_conv_args(geo))
        return (dx * (a != 0)).contiguous(memory_format=fmt)
    dx = torch.empty(N, C, H, W, dtype=torch.float32, memory_format=fmt).zero_()
    if _stride1(geo):
        _bwd_s1(lib, cnt, idx, val, dy, wt, geo, None, dx)
        return dx
    g = torch.tensor(geo, dtype=torch.int64)
    s = torch.tensor(dx.stride(), dtype=torch.int64)
    dy = dy.contiguous()
    wt = wt.contiguous()
    lib.sparsa_adaptive_conv_igrad_f32(g.data_ptr(), cnt.data_ptr(), idx.data_ptr(), dy.data_ptr(),
                                       wt.data_ptr(), dx.data_ptr(), s.data_ptr(), _nthreads())
    return dx


@conv_igrad.register_fake
def _(cnt, idx, val, dy, wt, geo, channels_last):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return dy.new_empty(geo[0], geo[1], geo[2], geo[3]).contiguous(memory_format=fmt)


# ------------------------------------------------------------------------------------------ both grads
def _stride1(geo: Sequence[int]) -> bool:
    return geo[9] == 1 and geo[10] == 1


def _pad_dy(dy: Tensor, geo: Sequence[int]) -> Tuple[Tensor, Tensor]:
    """``dy`` ([N, Ho, Wo, O]) zero-padded so that every offset of every input pixel reads a valid
    pixel (stride 1), and ``pads = [pt, pl, Hp, Wp]``."""
    N, H, W, O, KH, KW, Ho, Wo, ph, pw, dh, dw = (geo[0], geo[2], geo[3], geo[4], geo[5], geo[6], geo[7],
                                                  geo[8], geo[11], geo[12], geo[13], geo[14])
    pt, pl = max(0, (KH - 1) * dh - ph), max(0, (KW - 1) * dw - pw)
    Hp, Wp = pt + max(Ho, H + ph), pl + max(Wo, W + pw)
    if pt == 0 and pl == 0 and Hp == Ho and Wp == Wo:
        dyp = dy.contiguous()
    else:
        dyp = dy.new_zeros(N, Hp, Wp, O)
        dyp[:, pt:pt + Ho, pl:pl + Wo].copy_(dy)
    return dyp, torch.tensor([pt, pl, Hp, Wp], dtype=torch.int64)


def _bwd_s1(lib, cnt, idx, val, dy, wt, geo, dwt: Optional[Tensor], dx: Optional[Tensor]) -> None:
    dyp, pads = _pad_dy(dy, geo)
    g = torch.tensor(geo, dtype=torch.int64)
    s = torch.tensor(dx.stride() if dx is not None else (0, 0, 0, 0), dtype=torch.int64)
    wt = wt.contiguous() if wt is not None else None
    rc = lib.sparsa_adaptive_conv_bwd_s1_f32(
        g.data_ptr(), cnt.data_ptr(), idx.data_ptr(), val.data_ptr(), dyp.data_ptr(), pads.data_ptr(),
        None if wt is None else wt.data_ptr(), None if dwt is None else dwt.data_ptr(),
        None if dx is None else dx.data_ptr(), s.data_ptr(), _nthreads())
    if rc:
        raise ValueError(f"adaptive_conv_bwd: geometry {list(geo)} needs stride 1 and out_channels % 8 == 0")


@torch.library.custom_op("sparsa::adaptive_conv_bwd", mutates_args=())
def conv_bwd(cnt: Tensor, idx: Tensor, val: Tensor, dy: Tensor, wt: Tensor, geo: List[int],
             channels_last: bool) -> Tuple[Tensor, Tensor]:
    """``(dx, dWt)``: :func:`conv_igrad` and :func:`conv_wgrad` in one call (stride 1 shares the work)."""
    N, C, H, W, O, KH, KW = geo[0], geo[1], geo[2], geo[3], geo[4], geo[5], geo[6]
    lib = _use_native(val, dy, wt)
    if lib is None or O % 8 or dy.dtype != torch.float32 or not _stride1(geo):
        return (conv_igrad(cnt, idx, val, dy, wt, geo, channels_last), conv_wgrad(cnt, idx, val, dy, geo))
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    dx = torch.empty(N, C, H, W, dtype=torch.float32, memory_format=fmt).zero_()
    dwt = torch.empty(KH, KW, C, O, dtype=torch.float32)
    _bwd_s1(lib, cnt, idx, val, dy, wt, geo, dwt, dx)
    return dx, dwt


@conv_bwd.register_fake
def _(cnt, idx, val, dy, wt, geo, channels_last):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return (dy.new_empty(geo[0], geo[1], geo[2], geo[3]).contiguous(memory_format=fmt),
            dy.new_empty(geo[5], geo[6], geo[1], geo[4]))


# ------------------------------------------------------------------------------------------ packed weights
# The training step's native path (used by ``relu_conv2d``): the weight is packed once per parameter
# version for both the forward and the input-gradient kernels (instead of transposed/re-packed by
# every call), padding of dY and the weight gradient's layout happen inside the kernel. These are
# plain functions (not custom ops): callers check :func:`packed_supported` first.

# id(weight) -> (weakref to the weight, key, (wf, wc)); an entry goes away with its weight. (Not an
# attribute on the Parameter: pickling a module would then carry the packs along.)
_PACKS: Dict[int, tuple] = {}


def packed_supported(*ts: Optional[Tensor]) -> bool:
    """True when the packed native path can run on these tensors (float32 CPU, native library)."""
    if torch.compiler.is_compiling():
        return False
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


def _pack(w: Tensor, want_wf: bool, want_wc: bool) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    lib = native_library()
    O, C, KH, KW = w.shape
    wf = torch.empty(O * C * KH * KW, dtype=torch.float32) if want_wf else None
    wc = torch.empty(O * C * KH * KW, dtype=torch.float32) if want_wc else None
    ws = torch.tensor(w.stride(), dtype=torch.int64)
    rc = lib.sparsa_adaptive_pack_weight_f32(w.data_ptr(), ws.data_ptr(), O, C, KH, KW,
                                             None if wf is None else wf.data_ptr(),
                                             None if wc is None else wc.data_ptr(), _nthreads())
    if rc:
        raise ValueError(f"packed_weight: out_channels={O} must be a multiple of 8")
    return wf, wc


def packed_weight(weight: Tensor) -> Tuple[Tensor, Tensor]:
    """``(wf, wc)``: ``weight`` ``[O, C, KH, KW]`` (any strides, ``O % 8 == 0``) packed for the forward
    (``[O/OB, KH, KW, C, OB]``) and the input-gradient (``[C, KH, KW, O]``) kernels. Cached per tensor
    (while it lives) and re-packed when it changes (its version counter or storage moves), i.e. once
    per optimizer step."""
    return _cached_pack(_PACKS, weight, lambda w: _pack(w, True, True))


def _pick_ob(O: int) -> int:
    """The output-channel block ``OB`` of the forward pack (``pick_ob`` in csrc/adaptive_conv.cpp):
    the largest multiple of 8 up to 64 that divides ``O``."""
    for b in range(64, 8, -8):
        if O % b == 0:
            return b
    return 8


# id(weight) -> (weakref, key, wf of the flipped transposed weight): the dY-sparse input gradient
_FLIP_PACKS: Dict[int, tuple] = {}


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
            wc = packed_weight(weight)[1]
            wfl = torch.empty(O * C * KH * KW, dtype=torch.float32)
            native_library().sparsa_adaptive_pack_flipped_f32(wc.data_ptr(), O, C, KH, KW, wfl.data_ptr(),
                                                              _nthreads())
            return wfl
        ob = _pick_ob(C)
        return (w.to(torch.float32).flip(2, 3).reshape(O, C // ob, ob, KH, KW).permute(1, 3, 4, 0, 2)
                .contiguous().view(-1))
    return _cached_pack(_FLIP_PACKS, weight, build)


def conv_wgrad_dy(gcnt: Tensor, gidx: Tensor, gval: Tensor, xr_nhwc: Tensor, geo: List[int], gslice: int,
                  w_stride: Optional[Sequence[int]] = None) -> Tensor:
    """``dW [O, C, KH, KW]`` of a stride-1 conv (native, ``C % 8 == 0``, ``padding <= dilation * (K - 1)``)
    from the compacted dY: the weight gradient of the flipped conv (input dY, output gradient
    ``relu(x)`` given as contiguous NHWC ``xr_nhwc``), written straight into ``dW``'s flipped,
    transposed positions (negative kernel strides into the weight-gradient kernel's output).
    Work ~ nnz(dY) * C instead of nnz(relu(x)) * O. ``w_stride``: the strides to give ``dW``."""
    lib = native_library()
    N, C, H, W, O, KH, KW = (int(v) for v in geo[:7])
    g2 = igrad_dy_geometry(geo, gslice)
    if g2[11] < 0 or g2[12] < 0:
        raise ValueError(f"conv_wgrad_dy needs padding <= dilation * (kernel - 1), got geometry {list(geo)}")
    shape = (O, C, KH, KW)
    dw = torch.empty_strided(shape, tuple(w_stride), dtype=torch.float32) \
        if w_stride is not None and _dense_strides(shape, w_stride) else torch.empty(shape, dtype=torch.float32)
    s0, s1, s2, s3 = dw.stride()
    # dW'[c, o, i, j] (the flipped conv's gradient) lives at dW[o, c, KH-1-i, KW-1-j]
    base = dw.data_ptr() + 4 * ((KH - 1) * s2 + (KW - 1) * s3)
    ws = torch.tensor((s1, s0, -s2, -s3), dtype=torch.int64)
    g = torch.tensor(g2, dtype=torch.int64)
    xr = xr_nhwc.contiguous()
    rc = lib.sparsa_adaptive_conv_bwd_s1_v2_f32(g.data_ptr(), gcnt.data_ptr(), gidx.data_ptr(), gval.data_ptr(),
                                                xr.data_ptr(), None, base, ws.data_ptr(), None, None, _nthreads())
    if rc:
        raise ValueError(f"conv_wgrad_dy: geometry {list(geo)} needs in_channels % 8 == 0")
    return dw


def igrad_dy_geometry(geo: Sequence[int], slice: Optional[int] = None) -> List[int]:
    """The ``geo`` of the forward conv (input dY ``[N, O, Ho, Wo]``, weight :func:`packed_weight_flipped`)
    whose output ``[N, H, W, C]`` is the input gradient of the stride-1 conv ``geo``:
    ``padding' = dilation * (K - 1) - padding`` (may be negative), same dilation, stride 1."""
    N, C, H, W, O, KH, KW, Ho, Wo, sh, sw, ph, pw, dh, dw, CS = (int(v) for v in geo)
    if sh != 1 or sw != 1:
        raise ValueError(f"igrad_dy_geometry needs a stride-1 geometry, got {list(geo)}")
    return [N, O, Ho, Wo, C, KH, KW, H, W, 1, 1, dh * (KH - 1) - ph, dw * (KW - 1) - pw, dh, dw,
            CS if slice is None else int(slice)]


def conv_igrad_dy(gcnt: Tensor, gidx: Tensor, gval: Tensor, wflip: Tensor, cnt: Tensor, idx: Tensor,
                  geo: List[int], gslice: int, channels_last: bool) -> Tensor:
    """:func:`conv_igrad` of a stride-1 conv (native, ``C % 8 == 0``) computed as a *forward* conv of
    the compacted dY (``(gcnt, gidx, gval)`` from :func:`compact_signed` with ``gslice`` channels a
    slice) with :func:`packed_weight_flipped`, then kept only at the nonzeros of the operand
    ``(cnt, idx)`` of ``relu(x)`` (the ReLU derivative). Work ~ nnz(dY) instead of nnz(relu(x))."""
    lib = native_library()
    N, C, H, W, CS = geo[0], geo[1], geo[2], geo[3], geo[15]
    g2 = igrad_dy_geometry(geo, gslice)
    y = conv_fwd_packed(gcnt, gidx, gval, wflip, None, g2, 0)       # [N, H, W, C]
    if channels_last:
        lib.sparsa_adaptive_mask_f32(y.data_ptr(), N, C, H, W, CS, cnt.data_ptr(), idx.data_ptr(), None, None,
                                     _nthreads())
        return y.permute(0, 3, 1, 2)
    dx = torch.zeros(N, C, H, W, dtype=torch.float32)
    s = torch.tensor(dx.stride(), dtype=torch.int64)
    lib.sparsa_adaptive_mask_f32(y.data_ptr(), N, C, H, W, CS, cnt.data_ptr(), idx.data_ptr(), dx.data_ptr(),
                                 s.data_ptr(), _nthreads())
    return dx


def conv_fwd_packed(cnt: Tensor, idx: Tensor, val: Tensor, wf: Tensor, bias: Optional[Tensor],
                    geo: List[int], out_format: int = 1) -> Tensor:
    """:func:`conv_fwd` from the forward pack of :func:`packed_weight`."""
    lib = native_library()
    y = _fwd_empty(geo, out_format, torch.float32)
    g = torch.tensor(geo, dtype=torch.int64)
    b = None if bias is None else bias.detach().contiguous()
    rc = lib.sparsa_adaptive_conv_fwd_packed_f32(g.data_ptr(), cnt.data_ptr(), idx.data_ptr(), val.data_ptr(),
                                                 wf.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(),
                                                 _nthreads())
    if rc:
        raise ValueError(f"adaptive_conv_fwd: out_channels={geo[4]} must be a multiple of 8 for the native kernel")
    return y


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


def conv_bwd_packed(cnt: Tensor, idx: Tensor, val: Tensor, dy: Tensor, wc: Tensor, geo: List[int],
                    channels_last: bool, need_dx: bool, need_dw: bool,
                    dw_stride: Optional[Sequence[int]] = None) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """``(dx, dw)`` of a stride-1 conv: ``dx`` as :func:`conv_igrad`, ``dw`` directly in the
    ``[O, C, KH, KW]`` layout (with the weight's strides ``dw_stride`` when given, so autograd keeps
    it without a copy). ``dy`` is NHWC; ``wc`` the input-gradient pack of :func:`packed_weight`."""
    N, C, H, W, O, KH, KW = geo[0], geo[1], geo[2], geo[3], geo[4], geo[5], geo[6]
    if not _stride1(geo):
        raise ValueError(f"conv_bwd_packed needs a stride-1 geometry, got {list(geo)}")
    lib = native_library()
    dx = dw = None
    if need_dx:
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        dx = torch.empty(N, C, H, W, dtype=torch.float32, memory_format=fmt).zero_()
    if need_dw:
        dw = torch.empty_strided((O, C, KH, KW), tuple(dw_stride), dtype=torch.float32) \
            if dw_stride is not None and _dense_strides((O, C, KH, KW), dw_stride) \
            else torch.empty(O, C, KH, KW, dtype=torch.float32)
    if dx is None and dw is None:
        return dx, dw
    dy = dy.contiguous()
    g = torch.tensor(geo, dtype=torch.int64)
    s = torch.tensor(dx.stride() if dx is not None else (0, 0, 0, 0), dtype=torch.int64)
    ws = torch.tensor(dw.stride() if dw is not None else (0, 0, 0, 0), dtype=torch.int64)
    rc = lib.sparsa_adaptive_conv_bwd_s1_v2_f32(
        g.data_ptr(), cnt.data_ptr(), idx.data_ptr(), val.data_ptr(), dy.data_ptr(), wc.data_ptr(),
        None if dw is None else dw.data_ptr(), ws.data_ptr(), None if dx is None else dx.data_ptr(),
        s.data_ptr(), _nthreads())
    if rc:
        raise ValueError(f"adaptive_conv_bwd: geometry {list(geo)} needs stride 1 and out_channels % 8 == 0")
    return dx, dw
