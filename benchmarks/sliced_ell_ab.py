"""Before/after for the sliced_ell kernel, in one process: an older commit's kernel against this tree's.

Builds the sliced_ell kernel library of ``OLD`` beside this tree's (``_kernel_ab.py``) and times both, with
dense bf16 ``F.linear`` on the same pruned weight, round-robin in one process (warm-up first, median of the
rounds). Weights are row-balanced magnitude-pruned BERT-base shapes; fp32 and bf16 operands. Both kernels go
through this tree's ``sliced_ell`` wrapper, so both get the same row choice for bf16 (``rows``: the
``sliced_ell.fma_rows_bf16`` crossover of this tree, or ``--rows``) and OLD must share the C ABI of
``sparsa_sliced_ell_linear_*``. Outputs are compared: ``max_abs_diff`` between the two kernels.

Rows: ``out_features, in_features, tokens, sparsity, dtype, rows, threads, old_ms, new_ms, dense_bf16_ms,
new_over_old`` (old time / new time), ``old_vs_dense, new_vs_dense`` (dense time / kernel time),
``max_abs_diff``. Writes ``sliced_ell_ab.json`` (with the CPU and both commits) to ``--out``, else
``$SPARSA_RESULTS_DIR`` or the CPU class's results folder.

    flock /tmp/sparsa-bench.lock python benchmarks/sliced_ell_ab.py 1e2af68 [--quick] [--runs 1024x1 128x2]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import _kernel_ab  # noqa: E402
from sparsa.kernels import sliced_ell as sek  # noqa: E402
from sparsa.layouts import SlicedELL  # noqa: E402
from sparsa.sparsifiers import Magnitude  # noqa: E402
from sparsa.timing import round_robin_ms  # noqa: E402

SHAPES = [(768, 768), (3072, 768), (768, 3072)]  # (out_features, in_features), BERT-base
SPARSITIES = [0.75, 0.9]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def old_library(rev: str, where: Path):
    """The sliced_ell kernel library built from ``rev``'s sources (an error naming ``rev`` if git lacks it)."""
    return _kernel_ab.old_library(rev, where, "sliced_ell_linear", "sliced_ell_ab")


def run(old_lib, quick: bool, runs, rounds: int, rows_choice):
    """Rows for every shape, sparsity and dtype, at each (tokens, threads) of ``runs``."""
    new_lib = sek.native_library()
    if new_lib is None:
        raise SystemExit("sliced_ell_ab: this tree's native kernels do not run here (SPARSA_NO_NATIVE or no compiler)")
    gen = torch.Generator().manual_seed(0)
    out = []
    for (tokens, threads), (R, K) in itertools.product(runs, SHAPES[:1] if quick else SHAPES):
        torch.set_num_threads(threads)
        w = torch.randn(R, K, generator=gen)
        for s in [0.9] if quick else SPARSITIES:
            pruned = w * Magnitude(s, per="row").mask(w)
            lay = SlicedELL.from_dense(pruned)
            dense = pruned.bfloat16()
            for dname, dt in DTYPES.items():
                x = torch.randn(tokens, K, generator=gen).to(dt)
                v = lay.values.to(dt)
                rows = None
                if dt == torch.bfloat16:
                    rows = rows_choice or sek.bf16_rows(v.numel() / (R * K))

                def kernel(lib, x=x, v=v, R=R, rows=rows, sp=lay.slice_ptr, cols=lay.columns):
                    kind = "bf16" if x.dtype == torch.bfloat16 else "f32"
                    return lambda: sek._native_forward(lib, kind, x, sp, cols, v, None, R, 0, rows=rows)

                xb = x.bfloat16()
                fns = {"old": kernel(old_lib), "new": kernel(new_lib), "dense": lambda xb=xb, d=dense: F.linear(xb, d)}
                diff = (fns["old"]().float() - fns["new"]().float()).abs().max().item()
                ms = round_robin_ms(fns, rounds)
                row = {
                    "out_features": R,
                    "in_features": K,
                    "tokens": tokens,
                    "sparsity": s,
                    "dtype": dname,
                    "rows": rows or "fma",
                    "threads": threads,
                    **_kernel_ab.timing_fields(ms, diff),
                }
                out.append(row)
                _kernel_ab.progress(f"{R}x{K} T={tokens:<5} {s:.2f} {dname:8} {row['rows']:3}", row)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old", help="the commit whose kernel is the 'before'")
    ap.add_argument("--quick", action="store_true", help="768x768 at 90%% only")
    ap.add_argument(
        "--runs",
        nargs="+",
        default=None,
        help="TOKENSxTHREADS each (default 1024x1 128x2: one layer's tokens on a core, BERT-base batch 1 on 2)",
    )
    ap.add_argument("--rows", choices=("fma", "dp"), default=None, help="bf16 rows (default: this tree's crossover)")
    ap.add_argument("--rounds", type=int, default=None, help="round-robin rounds (default 11; quick 5)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    runs = []
    for r in args.runs or (["1024x1"] if args.quick else ["1024x1", "128x2"]):
        t, _, n = r.partition("x")
        if not (t.isdigit() and n.isdigit() and int(t) > 0 and int(n) > 0):
            ap.error(f"--runs: {r!r} is not TOKENSxTHREADS with positive integers, e.g. 128x2")
        runs.append((int(t), int(n)))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sliced_ell_ab_") as tmp:
        sha, old_lib = old_library(args.old, Path(tmp))
        rows = run(old_lib, args.quick, runs, args.rounds or (5 if args.quick else 11), args.rows)
    _kernel_ab.write("sliced_ell_ab", sha, args.quick, rows, t0, args.out)


if __name__ == "__main__":
    main()
