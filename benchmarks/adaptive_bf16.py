"""Activation-sparse convs on bf16 inputs (under autocast) against dense bf16 and dense fp32, per layer.

For VGG-16-shaped stride-1 3x3 convs (batch 32 on 32x32 images), with relu(x) clustered like a ReLU output
at 50 / 70 / 90% zeros, one forward + backward of ``conv2d(relu(x), W)`` is timed round-robin in one process
(warm-up first, medians, ``--threads`` threads, 2 by default), each call on a new weight version (as after an
optimizer step: the sparse path packs the weight again), with two output gradients (``dy``): ``dense``
(random), and ``maxpool``, as behind a 2x2 max-pool and the next ReLU (one pixel of each window, kept with
probability 0.55: about 86% zeros, what VGG-16's runtime monitors before its max-pools), on:

- ``bf16_kernels``: ``relu_conv2d`` on the bf16 input, as the adaptive runtime runs it under bf16 autocast
  where the CPU has AVX512-BF16 (the bf16 union kernels, each backward GEMM priced by ``conv_union_bf16.*``);
- ``fp32_kernels``: the path before, ``relu_conv2d`` on the input widened to fp32, rounded once at the end;
- ``dense_bf16`` / ``dense_fp32``: ``F.conv2d`` under bf16 autocast / in fp32, both memory formats: the
  fastest of the four is ``best_dense``.

Rows: ``shape, sparsity, dy, threads, *_ms, best_dense, speedup_vs_best_dense`` (of the bf16 kernels) and
``speedup_fp32_kernels_vs_best_dense``. Writes ``benchmarks/results/<cpu class>/adaptive_bf16.json`` (``--out``
or ``$SPARSA_RESULTS_DIR`` move it) with the CPU under ``cpu``. On a CPU without the bf16 union kernels it
prints why and exits 0.

    flock /tmp/sparsa-bench.lock python benchmarks/adaptive_bf16.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, Dict

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sparsa.cpu  # noqa: E402
from _results import write_results  # noqa: E402
from sparsa.adaptive import relu_conv2d  # noqa: E402
from sparsa.adaptive.cost_fits_refit import _clustered  # noqa: E402
from sparsa.kernels import adaptive_union_bf16 as B  # noqa: E402
from sparsa.timing import best_dense, round_robin_ms  # noqa: E402

CL = torch.channels_last
#: (channels in = out, image side) of VGG-16's stride-1 3x3 convs at 32x32 input, one per stage
SHAPES = [(64, 32), (128, 16), (256, 8), (512, 4)]
SPARSITIES = [0.5, 0.7, 0.9]
DYS = ["dense", "maxpool"]
#: the chance that a max-pool window's gradient survives the next layer's ReLU (VGG-16: about half)
MAXPOOL_KEEP = 0.55


def maxpool_dy(N: int, C: int, H: int, W: int, keep: float, gen: torch.Generator) -> torch.Tensor:
    """An output gradient as behind a 2x2 max-pool and a ReLU: one pixel of each window, kept with probability
    ``keep``, zeros elsewhere."""
    h, w = -(-H // 2), -(-W // 2)
    g = torch.randn(N, C, h, w, generator=gen) * (torch.rand(N, C, h, w, generator=gen) < keep)
    at = torch.randint(0, 4, (N, C, h, w), generator=gen)
    full = torch.zeros(N, C, h, w, 4).scatter_(4, at.unsqueeze(-1), g.unsqueeze(-1))
    return full.view(N, C, h, w, 2, 2).permute(0, 1, 2, 4, 3, 5).reshape(N, C, 2 * h, 2 * w)[:, :, :H, :W]


def _step(fn: Callable, x: torch.Tensor, gy: torch.Tensor, w: torch.Tensor) -> Callable[[], None]:
    def run():
        with torch.no_grad():
            w.mul_(1.0)  # a new weight version, as after an optimizer step
        xi = x.detach().requires_grad_(True)
        fn(xi).backward(gy)

    return run


def _cases(
    C: int, H: int, sparsity: float, batch: int, gen: torch.Generator, dy: str = "dense"
) -> Dict[str, Callable[[], None]]:
    a = torch.randn(batch, C, H, H, generator=gen).abs() * _clustered((batch, C, H, H), 1 - sparsity, gen)
    x32 = a.contiguous(memory_format=CL)
    x16 = x32.bfloat16()
    w = (torch.randn(C, C, 3, 3, generator=gen) / (9 * C) ** 0.5).requires_grad_(True)
    if dy == "maxpool":
        gy = maxpool_dy(batch, C, H, H, MAXPOOL_KEEP, gen)
    else:
        gy = torch.randn(batch, C, H, H, generator=gen)
    gy16 = gy.bfloat16().contiguous(memory_format=CL)
    gy32 = gy16.float()

    def dense(dtype, fmt):
        x = (x16 if dtype == "bf16" else x32).contiguous(memory_format=fmt)
        g = (gy16 if dtype == "bf16" else gy32).contiguous(memory_format=fmt)

        def f(xi):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
                return F.conv2d(xi.relu(), w, padding=1)

        return _step(f, x, g, w)

    return {
        "bf16_kernels": _step(lambda xi: relu_conv2d(xi, w, None, padding=1), x16, gy16, w),
        "fp32_kernels": _step(lambda xi: relu_conv2d(xi.float(), w, None, padding=1).bfloat16(), x16, gy16, w),
        "dense_bf16_nchw": dense("bf16", torch.contiguous_format),
        "dense_bf16_cl": dense("bf16", CL),
        "dense_fp32_nchw": dense("fp32", torch.contiguous_format),
        "dense_fp32_cl": dense("fp32", CL),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="two shapes, 70%% and 90%%, 5 rounds")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dy", nargs="+", choices=DYS, default=DYS, help="output gradients to time (default: both)")
    ap.add_argument("--out", type=Path, default=None, help="output JSON (default: results dir, adaptive_bf16.json)")
    args = ap.parse_args(argv)
    if not B.union_dpbf16():
        print("adaptive_bf16: this CPU does not run the bf16 union kernels (AVX-512 with AVX512-BF16); nothing to time")
        return
    torch.set_num_threads(args.threads)
    shapes = SHAPES[1:3] if args.quick else SHAPES
    sparsities = [0.7, 0.9] if args.quick else SPARSITIES
    rounds = 5 if args.quick else 9
    batch = 32
    gen = torch.Generator().manual_seed(0)
    t0 = time.time()
    rows = []
    for C, H in shapes:
        for s in sparsities:
            for dy in args.dy:
                ms = round_robin_ms(_cases(C, H, s, batch, gen, dy), rounds)
                dense = {k: v for k, v in ms.items() if k.startswith("dense")}
                best = best_dense(dense)
                row = {
                    "shape": [batch, C, H, H],
                    "sparsity": s,
                    "dy": dy,
                    "threads": args.threads,
                    **{k + "_ms": round(v, 3) for k, v in ms.items()},
                    "best_dense": best,
                    "speedup_vs_best_dense": round(dense[best] / ms["bf16_kernels"], 3),
                    "speedup_fp32_kernels_vs_best_dense": round(dense[best] / ms["fp32_kernels"], 3),
                }
                rows.append(row)
                print(
                    f"[{batch}x{C}x{H}x{H}] {s:.0%} zeros, {dy} dY: bf16 kernels {ms['bf16_kernels']:.2f} ms, fp32 "
                    f"kernels {ms['fp32_kernels']:.2f} ms, best dense {best} {dense[best]:.2f} ms -> "
                    f"{row['speedup_vs_best_dense']:.2f}x (fp32 kernels "
                    f"{row['speedup_fp32_kernels_vs_best_dense']:.2f}x)",
                    flush=True,
                )
    res = {
        "benchmark": "adaptive_bf16",
        "cpu": sparsa.cpu.cpu_info(),
        "quick": args.quick,
        "method": "fwd+bwd of conv2d(relu(x), W), 3x3 stride 1, clustered zeros, a new weight version per call; "
        f"dY dense or as behind a 2x2 max-pool (one pixel per window, kept with probability {MAXPOOL_KEEP}); "
        f"round-robin medians of {rounds} rounds after a warm-up, {args.threads} threads",
        "rows": rows,
        "seconds": round(time.time() - t0, 1),
    }
    write_results(res, "adaptive_bf16", args.out)


if __name__ == "__main__":
    main()
