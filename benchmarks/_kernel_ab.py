"""An older commit's native kernel library built beside this tree's, for before/after timings in one process.

On a host whose speed drifts from process to process, a before/after comparison is only trustworthy when
both kernels run round-robin in one process. :func:`old_library` builds ``rev``'s version of one kernel
library (its ``sparsa/kernels/csrc`` from ``git archive``, compiled under another library name) and types
the functions it defines with this tree's ABI table; :func:`this_tree` names the tree the new side comes from.
"""

from __future__ import annotations

import io
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import sparsa.cpu
from _results import write_results
from sparsa.kernels import abi, loader

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["old_library", "this_tree", "timing_fields", "progress", "write"]


def old_library(rev: str, where: Path, library: str, tool: str):
    """``(sha, lib)``: the kernel library ``library`` (e.g. ``"row_group_linear"``, built from
    ``csrc/<library>.cpp``) of commit ``rev``, extracted under ``where``. ``tool`` names the caller in errors
    (an unknown commit, a build that fails). Only the functions ``rev``'s source defines are typed: this
    tree's wrappers use what a library has, so ``rev`` must share the ABI of the functions they call."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout.strip()
    except subprocess.CalledProcessError:
        raise SystemExit(f"{tool}: {rev!r} is not a commit of {ROOT}; pass a commit, tag or branch") from None
    tar = subprocess.run(["git", "archive", sha, "sparsa/kernels/csrc"], cwd=ROOT, check=True, capture_output=True)
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as t:
        t.extractall(where, filter="data")
    name = f"{library}_{sha[:12]}"
    src = (where / f"sparsa/kernels/csrc/{library}.cpp").read_text()
    abi.SIGNATURES[name] = {f: s for f, s in abi.SIGNATURES[library].items() if f + "(" in src}
    # an absolute source path: its own csrc/ beside it resolves the includes
    lib = loader.load(name, [str(where / f"sparsa/kernels/csrc/{library}.cpp")])
    if lib is None:
        raise SystemExit(f"{tool}: the kernels of {rev} did not build ({loader.build_info().get(name)})")
    return sha, lib


def timing_fields(ms: Dict[str, float], diff: float) -> Dict[str, Any]:
    """The row fields of one side-by-side timing ``ms`` (``old``, ``new``, ``dense`` ms) and the largest
    difference between the two kernels' outputs."""
    # four significant digits, not decimals: a small shape's call takes a few microseconds, where four
    # decimals of a millisecond would leave the ratios below off by several percent
    return {
        "old_ms": float(f"{ms['old']:.4g}"),
        "new_ms": float(f"{ms['new']:.4g}"),
        "dense_bf16_ms": float(f"{ms['dense']:.4g}"),
        "new_over_old": round(ms["old"] / ms["new"], 3),
        "old_vs_dense": round(ms["dense"] / ms["old"], 3),
        "new_vs_dense": round(ms["dense"] / ms["new"], 3),
        "max_abs_diff": diff,
    }


def progress(label: str, row: Dict[str, Any]) -> None:
    """One line for a finished row, after ``label`` (its shape and case)."""
    print(
        f"{label}: old {row['old_ms']:8.3f} new {row['new_ms']:8.3f} dense bf16 {row['dense_bf16_ms']:8.3f} ms  "
        f"new/old x{row['new_over_old']:.2f}  vs dense {row['old_vs_dense']:.2f} -> {row['new_vs_dense']:.2f}  "
        f"max diff {row['max_abs_diff']:.3g}",
        flush=True,
    )


def write(name: str, old_sha: str, quick: bool, rows: List[Dict[str, Any]], t0: float, out: Optional[Path]) -> Path:
    """Write the results JSON ``name`` (with the CPU and both commits) to ``out`` or the CPU class's folder."""
    res = {
        "benchmark": name,
        "cpu": sparsa.cpu.cpu_info(),
        "old": old_sha,
        "new": this_tree(),
        "quick": quick,
        "timing": "one process, old kernel / new kernel / dense bf16 F.linear round-robin, warm-up first, medians",
        "rows": rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return write_results(res, name, out)


def this_tree() -> str:
    """This tree's commit, with ``+changes`` when its kernel sources differ from it."""
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "sparsa/kernels/csrc"], cwd=ROOT).returncode
    return (sha or "unknown") + ("+changes" if dirty else "")
