"""Keep freed memory inside the process, so per-step buffers do not page-fault on every step.

A training step allocates and frees the same large buffers every step (activations, compacted
operands, gradients). glibc serves blocks above its mmap threshold with fresh ``mmap`` pages and
returns them on ``free``, so each step pays a page fault per 4 KiB touched, which can dominate a
memory-bound pass such as the compaction; dense PyTorch pays the same toll. :func:`retain_freed_memory`
raises glibc's mmap and trim thresholds (``mallopt``) so freed blocks are reused. The process keeps its
peak heap instead of returning it to the OS between steps.
It is a no-op on other C libraries and when ``SPARSA_NO_MALLOPT=1``. Nothing in sparsa calls it unless
asked: ``sparsa.adaptive.enable(model, retain_memory=True)`` or a direct call (it changes the allocator
of the whole process, for the rest of its life).

Example::

    >>> from sparsa.adaptive.memory import retain_freed_memory
    >>> retain_freed_memory() in (True, False)   # True where glibc accepted the setting
    True
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import Optional

__all__ = ["retain_freed_memory"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_state: Optional[bool] = None


def retain_freed_memory(threshold: int = 1 << 30) -> bool:
    """Serve blocks below ``threshold`` bytes from the heap and keep freed memory (glibc only).

    Applied once per process (later calls return the first result). Returns whether it took effect.
    """
    global _state
    if _state is not None:
        return _state
    if not isinstance(threshold, int) or threshold <= 0:
        raise ValueError(f"threshold must be a positive number of bytes, got {threshold!r}")
    _state = False
    if os.environ.get("SPARSA_NO_MALLOPT", "0") not in ("", "0") or not sys.platform.startswith("linux"):
        return _state
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # glibc only (musl has no tunable thresholds)
    except (OSError, AttributeError):
        return _state
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    value = min(threshold, 2**31 - 1)
    # glibc may cap the mmap threshold (32 MiB on 64-bit); fall back to the cap when refused
    ok = mallopt(_M_MMAP_THRESHOLD, value) or mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    _state = bool(ok) and bool(mallopt(_M_TRIM_THRESHOLD, value))
    return _state
