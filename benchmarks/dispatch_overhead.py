"""Dispatch overhead: extra time of F.linear on a SparseTensor over calling the implementation directly.

Tiny shapes (so the kernel itself costs ~1-2 us) make the Python dispatch cost visible. Reports the
median over repetitions of the per-call difference, for inference (no grad) and training (grad
recorded: includes autograd.Function bookkeeping) on a Masked weight, and for a decode call
(``decode_bitmask``: one bf16 token, no grad) on a Bitmask weight, whose "direct" is the native stream
kernel called through ctypes with its arguments prepared: everything above it is Python a decoder pays
per linear per token. Writes benchmarks/results/<cpu class>/dispatch_overhead.json.

    python benchmarks/dispatch_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

import sparsa
from sparsa.kernels import bitmask as bm
from sparsa.layouts import Dense, Masked
from sparsa.ops import registry
from sparsa.ops.dispatch import _Ctx

from _results import results_dir

OUT = results_dir() / "dispatch_overhead.json"


def _per_call(fn, n):
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def _overhead_row(mode, direct, dispatched, x, w, reps, n) -> dict:
    """Median per-call times of ``direct`` and ``dispatched``, alternating, after a warm-up."""
    for _ in range(3):
        _per_call(direct, n // 4), _per_call(dispatched, n // 4)
    diffs, d_times, s_times = [], [], []
    for _ in range(reps):
        a = _per_call(direct, n)
        b = _per_call(dispatched, n)
        diffs.append(b - a)
        d_times.append(a)
        s_times.append(b)
    return {
        "mode": mode,
        "shape_x": list(x.shape),
        "shape_w": list(w.shape),
        "threads": 1,
        "direct_us": round(statistics.median(d_times) * 1e6, 2),
        "dispatched_us": round(statistics.median(s_times) * 1e6, 2),
        "overhead_us": round(statistics.median(diffs) * 1e6, 2),
    }


def decode_row(reps: int, n: int):
    """``F.linear`` of one bf16 token with a 64x64 Bitmask weight against the stream kernel's ctypes call;
    None where the native kernel does not run."""
    lib = bm.native_library()
    if lib is None:
        return None
    w = sparsa.to_sparse(torch.randn(64, 64).to(torch.bfloat16), "bitmask", sparsity=0.7)
    lay = w.sparse_layout
    x = torch.randn(1, 1, 64).to(torch.bfloat16)
    y = torch.empty(1, 64, dtype=torch.bfloat16)
    args = (x.data_ptr(), 1, 64, lay.bits.data_ptr(), lay.row_ptr.data_ptr(), lay.values.data_ptr(), 64, None, 0)
    kernel = lib.sparsa_bitmask_linear_bf16
    direct = lambda: kernel(*args, y.data_ptr(), 1, 0)  # noqa: E731 - the kernel alone
    dispatched = lambda: F.linear(x, w)  # noqa: E731
    with torch.no_grad():
        return _overhead_row("decode_bitmask", direct, dispatched, x, w, reps, n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    reps, n = (7, 2000) if args.quick else (21, 5000)
    impl = registry.lookup("linear", (Dense, Masked, Dense))
    if impl is None:
        raise SystemExit("no linear implementation registered for Masked weights")
    w = torch.randn(8, 8)
    sp = sparsa.to_sparse(w, Masked, mask=w.abs() > 0.5)
    x = torch.randn(4, 8)
    lay = sp.sparse_layout
    rows = []
    for mode in ("inference", "training"):
        xs = x.requires_grad_(mode == "training")
        spw = torch.nn.Parameter(sp.detach()) if mode == "training" else sp
        direct = lambda: impl.forward(_Ctx(), xs, lay, None)  # noqa: E731 - the implementation alone
        dispatched = lambda: F.linear(xs, spw)  # noqa: E731
        ctx = torch.enable_grad() if mode == "training" else torch.no_grad()
        with ctx:
            rows.append(_overhead_row(mode, direct, dispatched, x, w, reps, n))
    decode = decode_row(reps, n)
    if decode is not None:
        rows.append(decode)
    res = {
        "benchmark": "dispatch_overhead",
        "cpu": sparsa.cpu.cpu_info(),
        "target_us": 20.0,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "rows": rows,
        "note": "overhead = median(dispatched - direct) per call; training includes autograd.Function.",
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=2))
    for r in rows:
        print(
            f"{r['mode']:>9}: direct {r['direct_us']:.1f} us, dispatched {r['dispatched_us']:.1f} us, "
            f"overhead {r['overhead_us']:.1f} us (target < 20)"
        )


if __name__ == "__main__":
    main()
