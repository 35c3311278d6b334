"""The bf16 dot-product kernel paths (``VDPBF16PS``, AMX tiles) against the path below them and against dense.

For each bf16 kernel that has a dot-product path (``has_dpbf16()`` in ``sparsa.kernels.row_group``,
``.sliced_ell`` and ``.bitmask``), the same call is timed round-robin in one process (warm-up first,
median of the rounds) on its dot-product path and on the path it replaces, beside dense ``F.linear``
in bf16 and fp32 on the same (pruned) weight:

- row_group (groups of 16 and 4) and sliced_ell: ``SPARSA_ISA=avx512`` (``VDPBF16PS``) against
  ``SPARSA_ISA=avx2`` (the widening kernels: bf16 operands widened to fp32 in registers);
- ``sliced_ell_fma``: sliced_ell's FMA rows (``rows="fma"``, path ``fma512``: widened operands in 16-float
  vectors under ``SPARSA_ISA=avx512``) against the same rows in 8-float vectors (``SPARSA_ISA=avx2``);
- row_group16 where the AMX tiles run (``has_amx()``): the default path (AMX) against ``SPARSA_ISA=avx512``;
- bitmask (the decode kernel, few tokens): ``STREAM_PATH="dpbf16"`` against ``"avx512"``.

Rows: ``kernel, path, out_features, in_features, tokens, sparsity, threads, dp_ms`` (the path's time),
``below_ms, below_path, dense_bf16_ms, dense_fp32_ms, speedup_vs_below, speedup_vs_best_dense``. Writes
``benchmarks/results/<cpu class>/bf16_paths.json`` (``--out`` or ``$SPARSA_RESULTS_DIR`` move it) with
the CPU under ``cpu``. On a CPU without AVX512-BF16 it prints why and exits 0.

    flock /tmp/sparsa-bench.lock python benchmarks/bf16_paths.py [--quick]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sparsa.cpu  # noqa: E402
from _results import results_dir  # noqa: E402
from sparsa.kernels import bitmask as bm  # noqa: E402
from sparsa.kernels import row_group as rgk  # noqa: E402
from sparsa.kernels import sliced_ell as sek  # noqa: E402
from sparsa.layouts import Bitmask, RowGroup, SlicedELL  # noqa: E402
from sparsa.timing import round_robin_ms  # noqa: E402

SHAPES = [(768, 768), (3072, 768), (768, 3072)]  # (out_features, in_features), BERT-base
DECODE_SHAPES = [(4096, 1536), (1536, 4096)]  # the 0.5B Llama config's MLP
SPARSITIES = [0.5, 0.75, 0.9]


def _with_isa(isa: str, fn: Callable[[], object]) -> Callable[[], object]:
    def run():
        old = os.environ.get("SPARSA_ISA")
        os.environ["SPARSA_ISA"] = isa
        try:
            fn()
        finally:  # the caller's own setting back, if it had one
            if old is None:
                os.environ.pop("SPARSA_ISA", None)
            else:
                os.environ["SPARSA_ISA"] = old

    return run


def _with_stream_path(path: str, fn: Callable[[], object]) -> Callable[[], object]:
    def run():
        old, bm.STREAM_PATH = bm.STREAM_PATH, path
        try:
            fn()
        finally:
            bm.STREAM_PATH = old

    return run


def _cases(quick: bool):
    """(kernel, shape, call, dense bf16 weight, sparsity, tokens, path, below path); a path is a
    ``SPARSA_ISA`` value, or a bitmask ``STREAM_PATH``."""
    gen = torch.Generator().manual_seed(0)
    shapes = SHAPES[:1] if quick else SHAPES
    sparsities = [0.75] if quick else SPARSITIES
    for R, K in shapes:
        w = torch.randn(R, K, generator=gen)
        for s in sparsities:
            for group in (16, 4):
                lay = RowGroup.from_dense(w, group=group, sparsity=s)
                v = lay.values.bfloat16()
                dense = RowGroup(lay.columns, v, lay.shape, lay.row_perm, validate=False).to_dense()

                def call(x, lay=lay, v=v, R=R):
                    return rgk.row_group_linear_impl(x, lay.columns, v, None, R, lay.row_perm)

                yield f"row_group{group}", (R, K), call, dense, s, [1024, 128], "avx512", "avx2"
                if group == 16 and rgk.has_amx():
                    yield f"row_group{group}", (R, K), call, dense, s, [1024, 128], "amx", "avx512"
            se = SlicedELL.from_dense(w, sparsity=s)
            sv = se.values.bfloat16()

            def se_call(x, rows, se=se, sv=sv, R=R):
                return sek.sliced_ell_linear_impl(x, se.slice_ptr, se.columns, sv, None, R, rows=rows)

            dense = SlicedELL(se.slice_ptr, se.columns, sv, se.row_nnz, se.shape).to_dense()
            dp_call, fma_call = functools.partial(se_call, rows="dp"), functools.partial(se_call, rows="fma")
            yield "sliced_ell", (R, K), dp_call, dense, s, [1024, 128], "avx512", "avx2"
            yield "sliced_ell_fma", (R, K), fma_call, dense, s, [1024, 128], "avx512", "avx2"
    for R, K in DECODE_SHAPES[:1] if quick else DECODE_SHAPES:
        w = torch.randn(R, K, generator=gen)
        for s in [0.5] if quick else [0.5, 0.7]:
            b = Bitmask.from_dense(w.bfloat16(), sparsity=s)

            def bm_call(x, b=b, R=R):
                return bm.bitmask_linear_impl(x, b.bits, b.row_ptr, b.values, None, R, "stream")

            yield "bitmask", (R, K), bm_call, b.to_dense(), s, [1, 4], "dpbf16", "avx512"


def run(quick: bool, threads: int, rounds: int) -> List[Dict]:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for kernel, (R, K), call, dense, s, tokens, top, below in _cases(quick):
        for T in tokens:
            x = torch.randn(T, K, generator=gen).bfloat16()
            x32, d32 = x.float(), dense.float()
            if kernel == "bitmask":
                dp = _with_stream_path(top, lambda: call(x))
                lower = _with_stream_path(below, lambda: call(x))
            else:
                dp = _with_isa(top, lambda: call(x))
                lower = _with_isa(below, lambda: call(x))
            fns = {"dp": dp, "below": lower, "bf16": lambda: F.linear(x, dense), "fp32": lambda: F.linear(x32, d32)}
            ms = round_robin_ms(fns, rounds)
            best = min(ms["bf16"], ms["fp32"])
            row = {
                "kernel": kernel,
                "path": "amx" if top == "amx" else "fma512" if kernel.endswith("_fma") else "dpbf16",
                "out_features": R,
                "in_features": K,
                "tokens": T,
                "sparsity": s,
                "threads": threads,
                "dp_ms": round(ms["dp"], 4),
                "below_ms": round(ms["below"], 4),
                "below_path": f"STREAM_PATH={below}" if kernel == "bitmask" else f"SPARSA_ISA={below}",
                "dense_bf16_ms": round(ms["bf16"], 4),
                "dense_fp32_ms": round(ms["fp32"], 4),
                "speedup_vs_below": round(ms["below"] / ms["dp"], 3),
                "speedup_vs_best_dense": round(best / ms["dp"], 3),
            }
            rows.append(row)
            print(
                f"{kernel:>12} {R}x{K} T={T:<5} {s:.2f}: {row['path']} {row['dp_ms']:8.3f} ms  "
                f"x{row['speedup_vs_below']:.2f} vs {row['below_path']}  "
                f"x{row['speedup_vs_best_dense']:.2f} vs best dense",
                flush=True,
            )
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one shape, 75%% (bitmask 50%%), fewer rounds")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=None, help="round-robin rounds (default 7; quick 3)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    if not (rgk.has_dpbf16() and sek.has_dpbf16() and bm.has_dpbf16()):
        print(
            f"bf16_paths: no AVX512-BF16 dot-product paths on this CPU or build (class {sparsa.cpu.cpu_class()}, "
            f"kernel path {sparsa.cpu.isa()}); nothing to compare"
        )
        return
    t0 = time.time()
    rows = run(a.quick, a.threads, a.rounds or (3 if a.quick else 7))
    res = {
        "benchmark": "bf16_paths",
        "cpu": sparsa.cpu.cpu_info(),
        "threads": a.threads,
        "quick": a.quick,
        "torch": torch.__version__,
        "seconds": round(time.time() - t0, 1),
        "rows": rows,
    }
    out = a.out or results_dir() / "bf16_paths.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"wrote {out} ({res['seconds']} s)")


if __name__ == "__main__":
    main()
