"""Before/after for the bf16 row_group kernel, in one process: an older commit's kernel against this tree's.

On a host whose speed drifts from process to process (the same call can take 1.5x longer in the next
process), ``ab_commits.py``'s alternating processes need many rounds to see a 20% change. This builds
the row_group kernel library of ``OLD`` (its ``sparsa/kernels/csrc`` from ``git archive``, compiled under
another library name) beside this tree's, and times both, with dense bf16 ``F.linear`` on the same pruned
weight, round-robin in one process (warm-up first, median of the rounds). Both kernels go through this
tree's ``row_group_linear_impl``, so OLD must have the same C ABI for ``sparsa_row_group_linear_*`` (a
function it lacks, such as the AMX pack entry points, is not used for it).
Outputs are compared as well: ``max_abs_diff`` between the two kernels.

Rows: ``out_features, in_features, tokens, sparsity, group, threads, old_ms, new_ms, dense_bf16_ms,
new_over_old`` (old time / new time), ``old_vs_dense, new_vs_dense`` (dense time / kernel time),
``max_abs_diff``. Writes ``row_group_ab.json`` (with the CPU and both commits) to ``--out``, else
``$SPARSA_RESULTS_DIR`` or the CPU class's results folder.

    flock /tmp/sparsa-bench.lock python benchmarks/row_group_ab.py 3cdf23c [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import _kernel_ab  # noqa: E402
from sparsa.kernels import loader  # noqa: E402
from sparsa.kernels import row_group as rgk  # noqa: E402
from sparsa.layouts import RowGroup  # noqa: E402
from sparsa.timing import round_robin_ms  # noqa: E402

SHAPES = [(768, 768), (3072, 768), (768, 3072)]  # (out_features, in_features), BERT-base
SPARSITIES = [0.5, 0.75, 0.9]
TOKENS = [1024, 128]


def old_library(rev: str, where: Path):
    """The row_group kernel library built from ``rev``'s sources (an error naming ``rev`` if git lacks it)."""
    return _kernel_ab.old_library(rev, where, "row_group_linear", "row_group_ab")


def _shapes(text: str):
    """``"768x768,384x1536"`` as ``[(768, 768), (384, 1536)]`` (out_features x in_features)."""
    try:
        return [tuple(int(n) for n in item.split("x")) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shapes: expected OUTxIN[,...], e.g. 384x1536, got {text!r}") from None


def run(old_lib, quick: bool, threads: int, rounds: int, group: int, shapes=None, sparsities=None):
    torch.set_num_threads(threads)
    new_lib = rgk.native_library()
    if new_lib is None:
        raise SystemExit("row_group_ab: this tree's native kernels do not run here (SPARSA_NO_NATIVE or no compiler)")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for R, K in shapes or (SHAPES[:1] if quick else SHAPES):
        w = torch.randn(R, K, generator=gen)
        for s in sparsities or ([0.5, 0.9] if quick else SPARSITIES):
            lay = RowGroup.from_dense(w, group=group, sparsity=s)
            v = lay.values.bfloat16()
            dense = RowGroup(lay.columns, v, lay.shape, lay.row_perm, validate=False).to_dense()
            for T in [1024] if quick else TOKENS:
                x = torch.randn(T, K, generator=gen).bfloat16()

                def kernel(lib, x=x, lay=lay, v=v, R=R):
                    def call():
                        loader._LIBS["row_group_linear"] = lib
                        try:
                            return rgk.row_group_linear_impl(x, lay.columns, v, None, R, lay.row_perm)
                        finally:
                            loader._LIBS["row_group_linear"] = new_lib

                    return call

                # each side its own copy of the values: the AMX pack kept on a values tensor is keyed by library
                fns = {
                    "old": kernel(old_lib, v=v.clone()),
                    "new": kernel(new_lib, v=v.clone()),
                    "dense": lambda x=x, d=dense: F.linear(x, d),
                }
                diff = (fns["old"]().float() - fns["new"]().float()).abs().max().item()
                ms = round_robin_ms(fns, rounds)
                row = {
                    "out_features": R,
                    "in_features": K,
                    "tokens": T,
                    "sparsity": s,
                    "group": group,
                    "threads": threads,
                    **_kernel_ab.timing_fields(ms, diff),
                }
                rows.append(row)
                _kernel_ab.progress(f"{R}x{K} T={T:<5} {s:.2f}", row)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old", help="the commit whose kernel is the 'before'")
    ap.add_argument("--quick", action="store_true", help="768x768, 1024 tokens, 50%% and 90%%")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--group", type=int, default=16, choices=(4, 8, 16, 32))
    ap.add_argument("--rounds", type=int, default=None, help="round-robin rounds (default 9; quick 5)")
    ap.add_argument("--shapes", type=_shapes, default=None, help="OUTxIN[,...] (default: BERT-base's three)")
    ap.add_argument("--sparsities", default=None, help="comma-separated, e.g. 0.8,0.9 (default 0.5,0.75,0.9)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    sparsities = None if args.sparsities is None else [float(v) for v in args.sparsities.split(",")]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="row_group_ab_") as tmp:
        sha, old_lib = old_library(args.old, Path(tmp))
        rounds = args.rounds or (5 if args.quick else 9)
        rows = run(old_lib, args.quick, args.threads, rounds, args.group, args.shapes, sparsities)
    _kernel_ab.write("row_group_ab", sha, args.quick, rows, t0, args.out)


if __name__ == "__main__":
    main()
