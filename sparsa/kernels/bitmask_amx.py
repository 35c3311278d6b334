"""The ``"amx"`` strategy of :mod:`sparsa.kernels.bitmask`: bf16 Bitmask weights on AMX tiles.

The kernel (``csrc/bitmask_amx_bf16.cpp``) computes ``Y^T = W X^T`` on AMX tiles. It reads the weight
from the Bitmask components themselves, so it keeps no second copy of it and has nothing to build on a
first call:

- a work item takes 32 output rows and expands each from its bit row and packed values into dense A
  tiles (one expand-load per 32 columns);
- X is packed into AMX's pair layout (B tiles of 16 tokens x 32 columns): once per call by all threads
  together when it fits one token chunk (about 1 MiB), else by each thread for each chunk it works on;
- the sums, 16 outputs x 16 tokens per C tile, are transposed in registers and rounded to bf16 rows of Y
  with the bias added.

The work is dense, at AMX's rate, on the compressed bytes: the gain over dense bf16 is the weight's memory
traffic and the per-call weight reorder a BLAS GEMM does, not the skipped products (the ``"panel"``
strategy skips those).
"""

from __future__ import annotations

import ctypes
from typing import Optional

from torch import Tensor

from . import loader
from .operands import bitmask_rows_call

__all__ = ["run", "emulated_library", "AMX_STATUS"]

#: why the tiles cannot run, by ``sparsa_bitmask_amx_status`` code
AMX_STATUS = {
    -1: "this build has no bitmask AMX kernel (not GCC on x86-64)",
    0: "the AMX tiles run here",
    1: "this CPU lacks AMX-BF16, AVX-512, AVX512-BF16 or VBMI2",
    2: "Linux refused this process AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM)",
    3: "the bitmask AMX kernel's self-check gave a wrong product on this CPU",
}


def run(
    lib: ctypes.CDLL,
    x2: Tensor,
    bits: Tensor,
    row_ptr: Tensor,
    values: Tensor,
    bias: Optional[Tensor],
    R: int,
    act: int = 0,
) -> Optional[Tensor]:
    """``x2 @ W.T + bias`` (GELU applied where ``act`` is 1) for bf16 ``x2`` (2-D, contiguous) and bf16
    Bitmask components (contiguous) on the AMX tiles of ``lib``, in bf16; None where they do not run here
    (CPU, build, ``SPARSA_ISA``)."""
    if not lib.sparsa_bitmask_has_amx():
        return None
    rc, y = bitmask_rows_call(lib.sparsa_bitmask_amx_bf16, x2, bits, row_ptr, values, bias, R, act)
    return y if rc == 0 else None


def emulated_library() -> Optional[ctypes.CDLL]:
    """The kernel on software tiles (a test build: AMX's data layout and arithmetic in plain C++, scalar
    expand, pack and epilogue), so the row expansion, the X pack, tails and bias are checked on any CPU."""
    return loader.load("bitmask_amx_bf16_emu", ["bitmask_amx_bf16_emu.cpp"])
