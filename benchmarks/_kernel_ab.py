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
from pathlib import Path

from sparsa.kernels import abi, loader

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["old_library", "this_tree"]


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


def this_tree() -> str:
    """This tree's commit, with ``+changes`` when its kernel sources differ from it."""
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "sparsa/kernels/csrc"], cwd=ROOT).returncode
    return (sha or "unknown") + ("+changes" if dirty else "")
