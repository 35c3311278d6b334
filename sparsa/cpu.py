"""What CPU this is, and which kernel instruction set sparsa runs on it.

Kernels choose their path at run time from the CPU's flags. ``SPARSA_ISA`` forces a *lower* path
(for tests and side-by-side comparisons); it never enables an instruction set the CPU lacks:

- ``SPARSA_ISA=avx2``   AVX2 + FMA tiles only;
- ``SPARSA_ISA=avx512`` AVX-512 tiles (and AVX512-BF16 where present), no AMX;
- ``SPARSA_ISA=amx``    everything the CPU has (the default).

The older ``SPARSA_NO_AVX512=1`` still means ``avx2``.

Example::

    >>> from sparsa import cpu
    >>> cpu.isa() in ("portable", "avx2", "avx512", "amx")
    True
    >>> isinstance(cpu.cpu_info()["flags"]["avx2"], bool)
    True
"""

from __future__ import annotations

import functools
import os
import platform
import re
from typing import Dict, Tuple

import torch

__all__ = [
    "ISA_LEVELS",
    "FLAGS",
    "cpu_info",
    "cpu_class",
    "cpu_model",
    "cpu_flags",
    "isa",
    "hardware_isa",
    "check_isa_env",
]

#: kernel paths from lowest to highest
ISA_LEVELS: Tuple[str, ...] = ("portable", "avx2", "avx512", "amx")
#: the CPU flags every results JSON records (True/False each)
FLAGS: Tuple[str, ...] = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_bf16",
    "avx512_vnni",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


@functools.lru_cache(maxsize=1)
def _proc_cpuinfo() -> Tuple[str, frozenset]:
    try:
        text = open("/proc/cpuinfo", encoding="utf-8", errors="replace").read()
    except OSError:
        return platform.processor() or platform.machine(), frozenset()
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    return (
        model.group(1).strip() if model else platform.machine(),
        frozenset(flags.group(1).split()) if flags else frozenset(),
    )


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), e.g. ``AMD EPYC``."""
    return _proc_cpuinfo()[0]


def cpu_flags() -> Dict[str, bool]:
    """``{flag: present}`` for :data:`FLAGS`."""
    have = _proc_cpuinfo()[1]
    return {f: f in have for f in FLAGS}


def hardware_isa() -> str:
    """The highest kernel path this CPU supports, ignoring ``SPARSA_ISA``."""
    f = cpu_flags()
    if not (f["avx2"] and f["fma"]):
        return "portable"
    if not all(f[k] for k in ("avx512f", "avx512bw", "avx512vl", "avx512dq")):
        return "avx2"
    return "amx" if f["amx_bf16"] and f["amx_tile"] else "avx512"


def check_isa_env() -> str:
    """The ``SPARSA_ISA`` value ('' when unset), raising a one-line error for an unknown one."""
    v = os.environ.get("SPARSA_ISA", "").strip().lower()
    if v and v not in ISA_LEVELS:
        raise ValueError(
            f"SPARSA_ISA={v!r} is not a kernel path; use one of {', '.join(ISA_LEVELS)} "
            "(or unset it to use the best this CPU has)"
        )
    return v


def isa() -> str:
    """The kernel path in force: the CPU's best, lowered by ``SPARSA_ISA`` / ``SPARSA_NO_AVX512``."""
    hw = ISA_LEVELS.index(hardware_isa())
    want = check_isa_env()
    level = hw if not want else min(hw, ISA_LEVELS.index(want))
    off = os.environ.get("SPARSA_NO_AVX512", "")
    if off and off != "0":
        level = min(level, ISA_LEVELS.index("avx2"))
    return ISA_LEVELS[level]


def cpu_class() -> str:
    """A short name for this kind of CPU, used to keep benchmark results apart: vendor + best ISA,
    e.g. ``amd-avx2`` or ``intel-amx``."""
    model = _proc_cpuinfo()[0].lower()
    vendor = "amd" if "amd" in model else "intel" if "intel" in model else platform.machine().lower()
    return f"{vendor}-{hardware_isa()}"


def _onednn_version() -> str:
    try:
        v = torch.backends.mkldnn.version() if hasattr(torch.backends.mkldnn, "version") else None
        if v:
            return str(v)
    except Exception:  # pragma: no cover - depends on the build
        pass
    m = re.search(r"oneDNN v([\d.]+)", torch.__config__.show())
    return m.group(1) if m else "unknown"


def _mkl_version() -> str:
    m = re.search(r"Intel\(R\) (?:oneAPI )?Math Kernel Library Version ([\d.]+)", torch.__config__.show())
    return m.group(1) if m else ("none" if not torch.backends.mkl.is_available() else "unknown")


def cpu_info() -> Dict[str, object]:
    """The CPU facts every results JSON records: model, class, flags, cores, ISA path in force, versions."""
    return {
        "model": _proc_cpuinfo()[0],
        "class": cpu_class(),
        "flags": cpu_flags(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "isa": isa(),
        "hardware_isa": hardware_isa(),
        "torch": torch.__version__,
        "onednn": _onednn_version(),
        "mkl": _mkl_version(),
    }
