"""``sparsa::nm24_linear``: Y = X W^T + b for a 2:4 weight, by a kernel that only a 2:4 pattern allows.

In every group of four input columns a 2:4 row keeps one of six column pairs. Its weight is given by
``values`` (the kept pairs' values in column order, ``[R, K / 4, 2]`` or flat: the N:M layout's values,
and the Bitmask layout's of a 2:4 pattern) and ``slots`` (uint8 ``[R, K / 4]``, which pair:
:data:`SLOT_PAIRS`, built once per weight by :func:`nm24_slots` or :func:`bitmask_slots`). For many
bfloat16 tokens on a CPU with AVX512-BF16, ``csrc/nm24_panel_bf16.cpp`` packs the tokens once into the
six pair vectors of every group, so each kept pair costs one ``VDPBF16PS`` per 16 tokens against a
vector that stays in L1 while a block of rows reads it: half the dense GEMM's products, where the bitmask
panel kernel (any pattern) is bound by loading X for every pair.

Every other call runs the bitmask kernels on the same weight (``bits``, ``row_ptr``: the Bitmask layout's
terms of the same pattern, :func:`sparsa.ops.nm_linear.nm_bitmask_components`): the stream kernel for a
few tokens (decoding), and :func:`sparsa.kernels.bitmask.choose_strategy`'s choice elsewhere.
:func:`uses_panel` says which: bfloat16 above the token crossover ``nm24.panel_bf16`` (:mod:`sparsa.crossovers`,
measured per CPU by ``sparsa cost --refit``; off where unmeasured, since a dense bf16 GEMM on AMX tiles
can win).

Semantics as :mod:`sparsa.kernels.bitmask`: the dense product with the logical weight, so an X holding a
NaN or Inf runs the bitmask strategies, whose result spreads it as ``F.linear`` does; bfloat16 operands
accumulate in float32 and round once.

Example::

    >>> import torch
    >>> from sparsa.layouts import NM
    >>> from sparsa.kernels.nm24 import nm24_slots, nm24_linear_reference
    >>> w = NM.from_dense(torch.randn(6, 8), n=2, m=4)
    >>> y = nm24_linear_reference(torch.randn(3, 8), nm24_slots(w.indices), w.values, None, 6)
    >>> y.shape
    torch.Size([3, 6])
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..crossovers import CROSSOVERS, token_crossover
from . import bitmask as _bm
from .operands import compute_dtype, native_kind
from .opdef import kernel_op

__all__ = [
    "SLOT_PAIRS",
    "PANEL_CROSSOVER",
    "nm24_slots",
    "bitmask_slots",
    "nm24_dense_weight",
    "nm24_linear_reference",
    "has_nm24_panel",
    "panel_min_tokens",
    "uses_panel",
    "nm24_linear",
    "nm24_linear_kernel",
    "nm24_linear_impl",
    "linear_forward",
]

#: the column pair (within a group of four) each slot keeps: the kernel's SLOT_A / SLOT_B
SLOT_PAIRS = ((0, 1), (2, 3), (0, 2), (1, 3), (0, 3), (1, 2))
#: the token crossover (sparsa.crossovers) holding the most tokens the 2:4 panel kernel takes
PANEL_CROSSOVER = "nm24.panel_bf16"

_SLOT_OF = torch.full((16,), 255, dtype=torch.uint8)
for _s, (_a, _b) in enumerate(SLOT_PAIRS):
    _SLOT_OF[_a * 4 + _b] = _s


def nm24_slots(indices: Tensor) -> Tensor:
    """The slot (uint8 ``[R, K / 4]``) of each group's kept pair, from a 2:4 weight's ``indices``
    (``[R, K / 4, 2]``, ascending positions in each group, as :class:`~sparsa.layouts.NM` stores them)."""
    if indices.dim() != 3 or indices.shape[-1] != 2:
        raise ValueError(f"nm24_slots: indices must be [R, K / 4, 2] (a 2:4 weight's), got {tuple(indices.shape)}")
    idx = indices.to(torch.int64)
    a, b = idx[..., 0], idx[..., 1]
    if bool(((a < 0) | (b > 3) | (a >= b)).any()):
        raise ValueError("nm24_slots: indices must hold two ascending positions in 0..3 per group")
    return _SLOT_OF.to(indices.device)[a * 4 + b].contiguous()


_NIBBLE_SLOT = torch.full((16,), 255, dtype=torch.uint8)
for _s, (_a, _b) in enumerate(SLOT_PAIRS):
    _NIBBLE_SLOT[(1 << _a) | (1 << _b)] = _s


def bitmask_slots(bits: Tensor, in_features: int) -> Optional[Tensor]:
    """The slots of a Bitmask pattern (``bits``: uint8 ``[R, ceil(K / 8)]``, bit ``j % 8`` of byte ``j // 8``)
    that keeps exactly two of every four columns, else None: a 2:4 weight in the Bitmask layout, whose
    packed values are then already the pairs the 2:4 kernel takes."""
    K = in_features
    if bits.dim() != 2 or K % 4 or K == 0:
        return None
    nib = torch.stack((bits & 15, bits >> 4), dim=-1).reshape(bits.shape[0], -1)[:, : K // 4]
    slots = _NIBBLE_SLOT.to(bits.device)[nib.to(torch.int64)]
    return None if bool((slots == 255).any()) else slots.contiguous()


def nm24_dense_weight(slots: Tensor, values: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """The logical ``(R, K)`` weight (pure PyTorch)."""
    R, G = slots.shape
    pairs = torch.tensor(SLOT_PAIRS, dtype=torch.int64, device=slots.device)[slots.to(torch.int64)]  # [R, G, 2]
    w = torch.zeros(R, G, 4, dtype=dtype or values.dtype, device=values.device)
    w.scatter_(2, pairs, values.reshape(R, G, 2).to(w.dtype))
    return w.reshape(R, 4 * G)


def nm24_linear_reference(
    x: Tensor, slots: Tensor, values: Tensor, bias: Optional[Tensor], out_features: int
) -> Tensor:
    """Pure-PyTorch semantics of the kernel; bfloat16/float16 inputs compute in float32 and round once."""
    ct = compute_dtype(x.dtype)
    w = nm24_dense_weight(slots, values, ct)
    y = torch.nn.functional.linear(x.to(ct), w, None if bias is None else bias.to(ct))
    return y.to(x.dtype)


def has_nm24_panel() -> bool:
    """Whether the 2:4 panel kernel runs here (AVX512-BF16, build and ``SPARSA_ISA``)."""
    lib = _bm.native_library()
    return lib is not None and bool(lib.sparsa_nm24_has_panel_bf16())


def panel_min_tokens() -> Optional[int]:
    """The fewest tokens the 2:4 panel kernel takes on this CPU: one above its crossover (the most tokens
    the bitmask strategies keep); None where the crossover is at the top of its grid (never: the default
    where unmeasured)."""
    c = CROSSOVERS[PANEL_CROSSOVER]
    t = token_crossover(PANEL_CROSSOVER)
    return None if c.low_beyond_top and t >= c.grid[-1] else t + 1


def uses_panel(tokens: int, dtype: torch.dtype) -> bool:
    """Whether a call of ``tokens`` tokens of ``dtype`` on a 2:4 weight runs the 2:4 panel kernel (else the
    bitmask strategies): bfloat16, at least :func:`panel_min_tokens`, on a CPU where the kernel runs."""
    if dtype != torch.bfloat16:
        return False
    low = panel_min_tokens()
    return low is not None and tokens >= low and has_nm24_panel()


def nm24_linear_impl(
    x: Tensor,
    slots: Tensor,
    values: Tensor,
    bits: Tensor,
    row_ptr: Tensor,
    bias: Optional[Tensor],
    out_features: int,
    strategy: str = "auto",
) -> Tensor:
    """Eager implementation (what the ops run). ``strategy``: ``"auto"`` (:func:`uses_panel`, else the
    bitmask strategies' own choice), ``"panel"`` (the 2:4 kernel where it runs: bfloat16 on a CPU with
    AVX512-BF16, an X without NaN or Inf; else as ``"auto"``), or ``"bitmask"``."""
    if strategy not in ("auto", "panel", "bitmask"):
        raise ValueError(f"strategy must be 'auto', 'panel' or 'bitmask', got {strategy!r}")
    K = x.shape[-1]
    if K % 4:
        raise ValueError(f"nm24_linear: in_features must be a multiple of 4 (groups of 4), got {K}")
    flat_values = values.reshape(-1)
    T = x.numel() // K if K else 0
    kind = native_kind(x, values, bias)
    want = strategy == "panel" or (strategy == "auto" and T > 0 and uses_panel(T, x.dtype))
    if want and kind == "bf16" and T > 0 and out_features > 0 and has_nm24_panel():
        x2 = x.reshape(-1, K).contiguous()
        y = torch.empty(T, out_features, dtype=x.dtype)
        b = None if bias is None else bias.to(torch.float32).contiguous()
        v = values.contiguous()
        s = slots.contiguous()
        rc = _bm.native_library().sparsa_nm24_panel_bf16(
            x2.data_ptr(),
            T,
            K,
            s.data_ptr(),
            v.data_ptr(),
            out_features,
            None if b is None else b.data_ptr(),
            y.data_ptr(),
            torch.get_num_threads(),
        )
        if rc == 0:
            return y.reshape(*x.shape[:-1], out_features)
        # 1: X holds NaN or Inf (the bitmask strategies spread it); -1: no kernel here
    return _bm.bitmask_linear_impl(x, bits, row_ptr, flat_values, bias, out_features)


def _forward_fake(x, slots, values, bits, row_ptr, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


# forward-only, low per-call cost (kernels/opdef.py): the hot path of NMLinear, which owns the backward
nm24_linear_kernel = kernel_op(
    "nm24_linear_kernel(Tensor x, Tensor slots, Tensor values, Tensor bits, Tensor row_ptr, Tensor? bias, "
    "int out_features) -> Tensor",
    nm24_linear_impl,
    _forward_fake,
)


@torch.library.custom_op("sparsa::nm24_linear", mutates_args=())
def nm24_linear(
    x: Tensor, slots: Tensor, values: Tensor, bits: Tensor, row_ptr: Tensor, bias: Optional[Tensor], out_features: int
) -> Tensor:
    """``y[..., R] = x[..., K] @ W.T + bias`` for the 2:4 weight W given by ``slots`` and ``values`` (and
    its Bitmask terms ``bits``, ``row_ptr``), differentiable in ``x``, ``values`` and ``bias``."""
    return nm24_linear_impl(x, slots, values, bits, row_ptr, bias, out_features)


nm24_linear.register_fake(_forward_fake)


def linear_forward(
    x: Tensor, slots: Tensor, values: Tensor, bits: Tensor, row_ptr: Tensor, bias: Optional[Tensor], out_features: int
) -> Tensor:
    """The forward of the dispatcher's N:M and Bitmask linears on a 2:4 weight (``values`` flat): the stream
    kernel's eager decode path (:func:`sparsa.kernels.bitmask.stream_decode`) where it takes the call, else
    :data:`nm24_linear_kernel`. Trusts its arguments as :func:`sparsa.kernels.bitmask.linear_forward` does."""
    y = _bm.stream_decode(x, bits, row_ptr, values, bias, out_features)
    return y if y is not None else nm24_linear_kernel(x, slots, values, bits, row_ptr, bias, out_features)


# ---------------------------------------------------------------------------------------------- autograd
def _setup_context(ctx, inputs, output):
    x, slots, values, bits, row_ptr, bias, out_features = inputs
    ctx.save_for_backward(x, slots, values)
    ctx.out_features = out_features
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, gy):
    x, slots, values = ctx.saved_tensors
    K = x.shape[-1]
    ct = compute_dtype(gy.dtype, x.dtype, values.dtype)
    g2 = gy.reshape(-1, ctx.out_features).to(ct)
    gx = gv = gb = None
    if ctx.needs_input_grad[0]:
        gx = (g2 @ nm24_dense_weight(slots, values, ct)).reshape(x.shape).to(x.dtype)
    if ctx.needs_input_grad[2]:
        gw = (g2.t() @ x.reshape(-1, K).to(ct)).reshape(ctx.out_features, K // 4, 4)
        pairs = torch.tensor(SLOT_PAIRS, dtype=torch.int64, device=slots.device)[slots.to(torch.int64)]
        gv = gw.gather(2, pairs).reshape(values.shape).to(values.dtype)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[5]:
        gb = g2.sum(0).to(ctx.bias_dtype)
    return gx, None, gv, None, None, gb, None


nm24_linear.register_autograd(_backward, setup_context=_setup_context)
