"""The ``"amx"`` strategy of :mod:`sparsa.kernels.bitmask`: bf16 Bitmask weights on AMX tiles.

The kernel (``csrc/bitmask_amx_bf16.cpp``) reads a copy of the weight in the order of AMX's tiles, made
once per weight here and kept while the weight is unchanged:

- the weight, padded to whole 16-row blocks and 32-column chunks, is cut into tiles of 16 rows x 32
  columns, block-major (tile ``b * nkc + c`` holds rows ``16b..`` and columns ``32c..``);
- ``masks`` int32 ``(tiles, 16)``: bit ``j`` of word ``i`` of a tile is set when the value at row
  ``16b + j // 2``, column ``32c + 2i + j % 2`` is nonzero (AMX's pair layout: a tile row holds the column
  pair ``2i, 2i + 1`` of the 16 rows);
- ``values`` bf16: each tile's nonzero values in that order; ``offsets`` int64 ``(tiles + 1,)``: where each
  tile's values start.

The kernel expands the tiles back to dense ones and multiplies every token with them, so it does dense
work at AMX's rate on the compressed bytes: its gain over dense bf16 is the weight's memory traffic and
the per-call weight reorder a BLAS GEMM does, not the skipped products (the ``"panel"`` strategy skips
those). A kept value that is exactly zero is dropped from the copy, which changes nothing: the kernel
multiplies every column.

Example::

    >>> import torch
    >>> from sparsa.layouts import Bitmask
    >>> from sparsa.kernels import bitmask_tiles
    >>> b = Bitmask.from_dense(torch.randn(20, 40).bfloat16(), sparsity=0.5)
    >>> masks, offsets, values = bitmask_tiles.tile_order(b.bits, b.row_ptr, b.values, 20, 40)
    >>> masks.shape, offsets.shape, values.numel() == b.values.count_nonzero().item()
    (torch.Size([4, 16]), torch.Size([5]), True)
"""

from __future__ import annotations

import ctypes
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..layouts.bitmask import unpack_bits
from . import loader

__all__ = ["tile_order", "tile_copy", "run", "emulated_library", "AMX_STATUS"]

#: why the tiles cannot run, by ``sparsa_bitmask_amx_status`` code
AMX_STATUS = {
    -1: "this build has no bitmask AMX kernel (not GCC on x86-64)",
    0: "the AMX tiles run here",
    1: "this CPU lacks AMX-BF16, AVX-512, AVX512-BF16 or VBMI2",
    2: "Linux refused this process AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM)",
    3: "the bitmask AMX kernel's self-check gave a wrong product on this CPU",
}

_PIECE_ELEMENTS = 1 << 22  # dense elements converted at a time: a large weight's copy needs no dense twin


def tile_order(bits: Tensor, row_ptr: Tensor, values: Tensor, R: int, K: int) -> Tuple[Tensor, Tensor, Tensor]:
    """``(masks, offsets, values)`` of the tile order above for the Bitmask components of an ``(R, K)`` weight;
    the values in bf16."""
    n16, nkc = -(-R // 16), -(-K // 32)
    kept = unpack_bits(bits, K)
    rows = max(16, _PIECE_ELEMENTS // (32 * nkc) // 16 * 16)
    bit = torch.ones(32, dtype=torch.int64) << torch.arange(32)
    masks, vals, counts = [], [], []
    for r0 in range(0, 16 * n16, rows):
        r1 = min(16 * n16, r0 + rows)
        dense = torch.zeros(r1 - r0, 32 * nkc, dtype=torch.bfloat16)
        v1 = min(R, r1)
        if v1 > r0:
            a, b = int(row_ptr[r0]), int(row_ptr[v1])
            dense[: v1 - r0, :K][kept[r0:v1]] = values[a:b].to(torch.bfloat16)
        # (block, row, chunk, pair, column of pair) -> (block, chunk, pair, row, column of pair)
        tiles = dense.view(-1, 16, nkc, 16, 2).permute(0, 2, 3, 1, 4).reshape(-1, 16, 32)
        nonzero = tiles != 0
        vals.append(tiles[nonzero])
        counts.append(nonzero.sum((1, 2)))
        words = (nonzero.to(torch.int64) * bit).sum(-1)
        masks.append(torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32))
    offsets = torch.zeros(n16 * nkc + 1, dtype=torch.int64)
    torch.cumsum(torch.cat(counts), 0, out=offsets[1:])
    return torch.cat(masks), offsets, torch.cat(vals)


#: the tile-ordered copy per ``values`` tensor: (library, validity key, masks, offsets, values)
_COPIES: "torch.utils.weak.WeakIdKeyDictionary" = torch.utils.weak.WeakIdKeyDictionary()


def tile_copy(bits: Tensor, row_ptr: Tensor, values: Tensor, R: int, K: int) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`tile_order` of these components, made once and kept while ``values`` and ``bits`` are
    unchanged (their data pointers and versions are the key, so an in-place update makes a new copy).
    Inference tensors, which have no version counter, get a fresh copy on every call."""
    try:
        key = (values.data_ptr(), values._version, bits.data_ptr(), bits._version, R, K)
    except RuntimeError:  # an inference tensor
        key = None
    hit = _COPIES.get(values) if key is not None else None
    if hit is not None and hit[0] == key:
        return hit[1]
    with torch.no_grad():
        copy = tile_order(bits, row_ptr, values, R, K)
    if key is not None:
        _COPIES[values] = (key, copy)
    return copy


def run(
    lib: ctypes.CDLL, x2: Tensor, bits: Tensor, row_ptr: Tensor, values: Tensor, bias: Optional[Tensor], R: int
) -> Optional[Tensor]:
    """``x2 @ W.T + bias`` for bf16 ``x2`` (2-D, contiguous) on the AMX tiles of ``lib``, in bf16; None where
    they do not run here (CPU, build, ``SPARSA_ISA``)."""
    if not lib.sparsa_bitmask_has_amx():
        return None
    T, K = x2.shape
    masks, offsets, vals = tile_copy(bits, row_ptr, values, R, K)
    y = torch.empty(T, R, dtype=torch.bfloat16)
    b = None if bias is None else bias.to(torch.float32).contiguous()
    rc = lib.sparsa_bitmask_amx_bf16(
        x2.data_ptr(),
        T,
        K,
        masks.data_ptr(),
        offsets.data_ptr(),
        vals.data_ptr(),
        R,
        None if b is None else b.data_ptr(),
        y.data_ptr(),
        torch.get_num_threads(),
    )
    return y if rc == 0 else None


def emulated_library() -> Optional[ctypes.CDLL]:
    """The kernel on software tiles (a test build: AMX's data layout and arithmetic in plain C++, scalar
    expand and epilogue), so the tile order, tails and bias are checked on any CPU."""
    return loader.load("bitmask_amx_bf16_emu", ["bitmask_amx_bf16_emu.cpp"])
