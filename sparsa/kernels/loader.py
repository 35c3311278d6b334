"""JIT build and load of sparsa's native (C++/AVX2/OpenMP) kernel libraries.

Kernels are plain C++ (no torch headers, so a build takes seconds) exposing ``extern "C"`` functions
that take raw pointers. They are built with :func:`torch.utils.cpp_extension.load` (ninja) into a cache directory
keyed by the source hash, under an exclusive file lock on that directory, and a library is opened with
:mod:`ctypes` only once its build has finished (a ``.done`` marker written after the link), so
processes starting together never load a half-written ``.so``. On opening, the library's typed table in
:mod:`sparsa.kernels.abi` is bound (argument and return types); a function the table names but the library
lacks is a RuntimeError naming the library and the fix. Python wrappers register the kernels as
``torch.library`` custom ops, their only callers.

- ``SPARSA_NO_NATIVE=1`` (or ``SPARSA_ISA=portable``) forces the pure-PyTorch fallbacks.
- ``SPARSA_CACHE_DIR`` overrides the cache (default ``~/.cache/sparsa/kernels``).
- If the build fails (no compiler, no ninja) the fallback runs and a warning says so once.

Example::

    >>> from sparsa.kernels import loader
    >>> lib = loader.load("spmm")          # doctest: +SKIP
    >>> lib is None or lib.sparsa_probe_version() == 1  # doctest: +SKIP
    True
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import re
import threading
import time
import warnings
from pathlib import Path
from typing import Dict, Optional, Sequence

from ..environ import raw

__all__ = ["load", "native_enabled", "cache_dir", "CSRC", "build_info", "kernels_digest", "hashed_files"]

CSRC = Path(__file__).parent / "csrc"
_LIBS: Dict[str, Optional[ctypes.CDLL]] = {}
_INFO: Dict[str, dict] = {}
_LOCK = threading.Lock()
_WARNED: set = set()
_ENABLED: Dict[tuple, bool] = {}

CFLAGS = ["-O3", "-std=c++17", "-march=haswell", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno"]
LDFLAGS = ["-fopenmp"]


def native_enabled() -> bool:
    """False when ``SPARSA_NO_NATIVE`` is set to a true value, or the kernel path is ``portable`` (a CPU
    without AVX2/FMA, or ``SPARSA_ISA=portable``). An unknown ``SPARSA_ISA`` raises ValueError."""
    env = (raw(b"SPARSA_NO_NATIVE"), raw(b"SPARSA_ISA"), raw(b"SPARSA_NO_AVX512"))
    hit = _ENABLED.get(env)
    if hit is None:  # memoised per environment: every kernel call asks, tests flip the variables
        from .. import cpu

        hit = _ENABLED[env] = env[0].lower() not in (b"1", b"true", b"yes", b"on") and cpu.isa() != "portable"
    return hit


def cache_dir() -> Path:
    d = os.environ.get("SPARSA_CACHE_DIR")
    base = Path(d) if d else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sparsa" / "kernels"
    base.mkdir(parents=True, exist_ok=True)
    return base


def build_info() -> Dict[str, dict]:
    """Per library: build seconds (0 if cached), path, or the error that forced the fallback."""
    return dict(_INFO)


@functools.lru_cache(maxsize=1)
def kernels_digest() -> str:
    """12 hex digits of a hash over every native kernel source and the Python kernel wrappers: cached
    timings (``sparsa.cost_model``) name it, so a kernel change is re-measured, never answered from a table
    measured with the old code."""
    h = hashlib.sha256()
    for f in sorted(list(CSRC.iterdir()) + list(CSRC.parent.glob("*.py"))):
        if f.is_file():
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def _warn_once(key: str, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def load(name: str, sources: Optional[Sequence[str]] = None) -> Optional[ctypes.CDLL]:
    """Build (if needed) and open the native library ``name``; None means "use the fallback".

    ``sources`` are file names under ``csrc/`` (default ``[name + ".cpp"]``); headers in ``csrc/``
    are part of the hash. The functions of ``abi.SIGNATURES[name]`` are typed before it is returned.
    """
    if not native_enabled():
        return None
    lib = _LIBS.get(name)
    if lib is not None:
        return lib
    with _LOCK:
        if name in _LIBS:
            return _LIBS[name]
        lib = None
        try:
            lib = _build(name, list(sources or [f"{name}.cpp"]))
        except Exception as e:  # pragma: no cover - depends on the machine
            _INFO[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            _warn_once(
                name,
                f"sparsa: could not build native kernels {name!r} ({type(e).__name__}); "
                "using the pure-PyTorch fallback (slower). Install a C++ compiler and "
                "`pip install ninja` to enable them.",
            )
        if lib is not None:
            _bind(name, lib)  # outside the fallback: a stale library is an error to fix, not to hide
        _LIBS[name] = lib
        return lib


def _bind(name: str, lib: ctypes.CDLL) -> None:
    """Set the argument and return types of every function of ``abi.SIGNATURES[name]`` on ``lib``."""
    from .abi import SIGNATURES

    for fn, sig in SIGNATURES.get(name, {}).items():
        try:
            f = getattr(lib, fn)
        except AttributeError:
            where = _INFO.get(name, {}).get("path", "?")
            raise RuntimeError(
                f"sparsa: native library {name!r} ({where}) has no function {fn!r} that "
                f"sparsa.kernels.abi declares; the cached build is stale or incomplete. Delete "
                f"{Path(where).parent if where != '?' else cache_dir()} (or the whole cache "
                f"{cache_dir()}) and run again to rebuild it."
            ) from None
        f.restype = sig.restype
        f.argtypes = [t for _, t in sig.args]


def hashed_files(paths: Sequence[Path]) -> list:
    """What a build's cache key hashes: its sources, the ``.cpp`` files they include (a build variant of
    another source, e.g. ``row_group_linear_amxemu.cpp``) and every header in ``csrc/``."""
    included = set()
    for p in paths:
        included.update(CSRC / m.decode() for m in re.findall(rb'#include "([^"]+\.cpp)"', p.read_bytes()))
    return sorted(set(paths) | included) + sorted(CSRC.glob("*.h"))


def _build(name: str, sources: Sequence[str]) -> ctypes.CDLL:
    paths = [CSRC / s for s in sources]
    h = hashlib.sha256()
    for p in hashed_files(paths):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(" ".join(CFLAGS + LDFLAGS).encode())
    digest = h.hexdigest()[:16]
    out_dir = cache_dir() / f"{name}_{digest}"
    so, done = out_dir / f"sparsa_{name}.so", out_dir / f"sparsa_{name}.done"
    if done.exists():  # fast path: a finished build (the marker is written after the link)
        _INFO[name] = {"seconds": 0.0, "path": str(so), "cached": True}
        return ctypes.CDLL(str(so))
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building this very library
        if not done.exists():
            from torch.utils import cpp_extension

            t0 = time.perf_counter()
            _warn_once(name + ":build", f"sparsa: building native kernels {name!r} (first use; cached afterwards)...")
            cpp_extension.load(
                name=f"sparsa_{name}",
                sources=[str(p) for p in paths],
                extra_cflags=CFLAGS,
                extra_ldflags=LDFLAGS,
                build_directory=str(out_dir),
                is_python_module=False,
                verbose=False,
            )
            done.write_text(f"{time.perf_counter() - t0:.2f}\n")
            _INFO[name] = {"seconds": round(time.perf_counter() - t0, 2), "path": str(so), "cached": False}
        else:
            _INFO[name] = {"seconds": 0.0, "path": str(so), "cached": True}
    return ctypes.CDLL(str(so))


def ptr(t) -> ctypes.c_void_p:
    """Raw data pointer of a tensor for a ctypes call."""
    return ctypes.c_void_p(t.data_ptr())
