"""The 2:4 bf16 kernel: the ``"nm24"`` strategy of ``sparsa::bitmask_linear`` for a weight whose pattern
keeps two of every four columns.

In every group of four input columns a 2:4 row keeps one of six column pairs, so the Bitmask layout's
packed values of such a row are already the pairs, in column order. Which pair is the row's *slot* in the
group (uint8 ``[R, K / 4]``, :data:`SLOT_PAIRS`), which the kernel reads from the bit rows; whether a
pattern is 2:4 is found once per weight (:func:`is_2_4`, cached per ``bits`` tensor, so compiled graphs
find it too). For many bfloat16 tokens on a
CPU with AVX512-BF16, ``csrc/nm24_panel_bf16.cpp`` packs the tokens once into the six pair vectors of every
group, so each kept pair costs one ``VDPBF16PS`` per 16 tokens against a vector that stays in L1 while a
block of rows reads it: half the dense GEMM's products, where the bitmask panel kernel (any pattern) is
bound by loading X for every pair.

:func:`wants_panel` says when the op's automatic choice takes it: bfloat16 above the token crossover
``nm24.panel_bf16`` (:mod:`sparsa.crossovers`, measured per CPU by ``sparsa cost --refit``; never where
unmeasured, since a dense bf16 GEMM on AMX tiles can win). Weights in the ``nm`` layout reach it through
their Bitmask terms (:func:`sparsa.ops.nm_linear.nm_bitmask_components`).

Example::

    >>> import torch
    >>> from sparsa.layouts import Bitmask, nm_mask
    >>> from sparsa.kernels.nm24 import bitmask_slots, is_2_4, nm24_dense_weight
    >>> d = torch.randn(6, 8)
    >>> w = Bitmask.from_dense(d, mask=nm_mask(d, 2, 4))
    >>> is_2_4(w.bits, 8), torch.equal(nm24_dense_weight(bitmask_slots(w.bits, 8), w.values), w.to_dense())
    (True, True)
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from ..crossovers import CROSSOVERS, token_crossover
from .operands import float_bias

__all__ = [
    "SLOT_PAIRS",
    "PANEL_CROSSOVER",
    "bitmask_slots",
    "is_2_4",
    "nm24_dense_weight",
    "panel_min_tokens",
    "wants_panel",
    "run_panel",
]

#: the column pair (within a group of four) each slot keeps: the kernel's SLOT_A / SLOT_B
SLOT_PAIRS = ((0, 1), (2, 3), (0, 2), (1, 3), (0, 3), (1, 2))
#: the token crossover (sparsa.crossovers) holding the most tokens the bitmask strategies keep on a 2:4 weight
PANEL_CROSSOVER = "nm24.panel_bf16"

_NIBBLE_SLOT = torch.full((16,), 255, dtype=torch.uint8)  # the group's 4 mask bits -> slot
for _s, (_a, _b) in enumerate(SLOT_PAIRS):
    _NIBBLE_SLOT[(1 << _a) | (1 << _b)] = _s


def bitmask_slots(bits: Tensor, in_features: int) -> Optional[Tensor]:
    """The slots of a Bitmask pattern (``bits``: uint8 ``[R, ceil(K / 8)]``, bit ``j % 8`` of byte ``j // 8``)
    that keeps exactly two of every four columns, else None."""
    K = in_features
    if bits.dim() != 2 or K % 4 or K == 0:
        return None
    nib = torch.stack((bits & 15, bits >> 4), dim=-1).reshape(bits.shape[0], -1)[:, : K // 4]
    slots = _NIBBLE_SLOT.to(bits.device)[nib.to(torch.int64)]
    return None if bool((slots == 255).any()) else slots.contiguous()


# id(bits) -> (a weak reference to bits, its version, in_features, whether the pattern is 2:4)
_IS_2_4: Dict[int, Tuple[weakref.ref, int, int, bool]] = {}
_IS_2_4_LOCK = threading.Lock()


def is_2_4(bits: Tensor, in_features: int) -> bool:
    """Whether ``bits`` keep exactly two of every four columns (:func:`bitmask_slots` is not None), found once
    per bits tensor (while it lives and is not modified in place): every call of a weight in a model, eager
    or compiled, passes the same tensor. The kernel reads each group's slot from the bits itself."""
    key = id(bits)
    hit = _IS_2_4.get(key)
    if hit is not None and hit[0]() is bits and hit[1] == bits._version and hit[2] == in_features:
        return hit[3]
    found = bitmask_slots(bits, in_features) is not None
    with _IS_2_4_LOCK:
        if key not in _IS_2_4:
            weakref.finalize(bits, _IS_2_4.pop, key, None)
        _IS_2_4[key] = (weakref.ref(bits), bits._version, in_features, found)
    return found


def nm24_dense_weight(slots: Tensor, values: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """The logical ``(R, K)`` weight of ``slots`` and the pairs' ``values`` (flat or ``[R, K / 4, 2]``)."""
    R, G = slots.shape
    pairs = torch.tensor(SLOT_PAIRS, dtype=torch.int64, device=slots.device)[slots.to(torch.int64)]  # [R, G, 2]
    w = torch.zeros(R, G, 4, dtype=dtype or values.dtype, device=values.device)
    w.scatter_(2, pairs, values.reshape(R, G, 2).to(w.dtype))
    return w.reshape(R, 4 * G)


def panel_min_tokens() -> Optional[int]:
    """The fewest tokens the automatic choice sends to the 2:4 kernel on this CPU: one above its crossover
    (the most tokens the bitmask strategies keep); None where the crossover is at the top of its grid (never:
    the default where unmeasured)."""
    c = CROSSOVERS[PANEL_CROSSOVER]
    t = token_crossover(PANEL_CROSSOVER)
    return None if c.low_beyond_top and t >= c.grid[-1] else t + 1


def wants_panel(tokens: int, dtype: torch.dtype) -> bool:
    """Whether the crossover sends a call of ``tokens`` tokens of ``dtype`` on a 2:4 weight to the 2:4
    kernel: bfloat16, at least :func:`panel_min_tokens` (whether the kernel runs here is the caller's
    question: ``sparsa.kernels.bitmask.has_nm24_panel``)."""
    if dtype != torch.bfloat16:
        return False
    low = panel_min_tokens()
    return low is not None and tokens >= low


def run_panel(
    lib: ctypes.CDLL, x2: Tensor, bits: Tensor, values: Tensor, bias: Optional[Tensor], R: int
) -> Optional[Tensor]:
    """The kernel on contiguous bf16 ``x2`` ``[T, K]`` and ``values`` and the contiguous ``bits`` of a 2:4
    pattern (:func:`is_2_4`: the kernel trusts it); None where it did not run (an X holding NaN or Inf,
    whose dense product spreads it to every output; no kernel on this CPU or build)."""
    T, K = x2.shape
    y = torch.empty(T, R, dtype=x2.dtype)
    b = None if bias is None else float_bias(bias, holder=values)  # held until the call returns
    rc = lib.sparsa_nm24_panel_bf16(
        x2.data_ptr(),
        T,
        K,
        bits.data_ptr(),
        values.data_ptr(),
        R,
        None if b is None else b.data_ptr(),
        y.data_ptr(),
        torch.get_num_threads(),
    )
    return y if rc == 0 else None
