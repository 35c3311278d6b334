"""Where the bf16 activation-sparse conv spends its time: each GEMM of the sparse path against dense bf16.

``benchmarks/adaptive_bf16.py`` times a whole forward + backward of ``conv2d(relu(x), W)``. This script
splits it: for VGG-16-shaped stride-1 3x3 convs (batch 32, as there; relu(x) clustered like a ReLU output at
50 / 70 / 90% zeros, dY dense or as behind a 2x2 max-pool) it times, round-robin in one process (warm-up
first, medians, ``--threads`` threads):

- ``operand``: relu(x)'s bf16 operand (values and bitmask), and ``packs``: the weight's bf16 pair packs (one
  per weight version, as after an optimizer step);
- the forward on 1-, 2- and 4-pixel groups (``fwd_g1`` / ``fwd_g2`` / ``fwd_g4``);
- the input gradient at relu(x)'s nonzeros driven by relu(x) (``dx_x``) or by dY's mask (``dx_dy_g2`` /
  ``dx_dy_g4``);
- the weight gradient over relu(x)'s mask (``dw_x``: pixel pairs; ``dw_lists``: per-channel lists) and over
  dY's nonzeros (``dw_dy_lists``);
- dense bf16 (oneDNN, channels-last, as autocast runs it): ``dense_fwd``, ``dense_dx``, ``dense_dw``.

Each row also gives the densities that bound the union kernels' work: ``VDPBF16PS`` multiplies a pair of
channels, so a pair runs when either channel is set in the union of a group's pixels: ``x_elem`` (relu(x)'s
nonzeros), ``x_pair_g1`` / ``x_pair_g2`` / ``x_pair_g4`` (pairs set in a 1-, 2- and 4-pixel group: rows of
pixels, as the kernels' row runs; the forward on images of 16x16 and more takes 2x2 tiles, which share
slightly more) and the same for dY (``dy_*``). ``best_sparse_ms``: the sum of the fastest way of each GEMM
plus the operand and packs; ``speedup_best_sparse_vs_dense``: dense fwd + dx + dw over it (an upper bound
of what the runtime's choice per GEMM gives).

Writes ``benchmarks/results/<cpu class>/adaptive_bf16_gemms.json`` (``--out`` or ``$SPARSA_RESULTS_DIR`` move
it) with the CPU under ``cpu``. On a CPU without the bf16 union kernels it prints why and exits 0.

    flock /tmp/sparsa-bench.lock python benchmarks/adaptive_bf16_gemms.py [--quick]
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
import sparsa.cpu  # noqa: E402
from _results import write_results  # noqa: E402
from adaptive_bf16 import DYS, MAXPOOL_KEEP, SHAPES, SPARSITIES, maxpool_dy  # noqa: E402
from sparsa.adaptive.cost_fits_refit import _clustered  # noqa: E402
from sparsa.kernels import adaptive_union as U  # noqa: E402
from sparsa.kernels import adaptive_union_bf16 as B  # noqa: E402
from sparsa.kernels import adaptive_union_ops as O  # noqa: E402
from sparsa.timing import round_robin_ms  # noqa: E402

CL = torch.channels_last
BF16 = torch.bfloat16


def pair_densities(t: torch.Tensor, prefix: str) -> Dict[str, float]:
    """Of ``t`` ``[N, C, H, W]``: its nonzero fraction, and the fraction of (group, channel pair) with a
    nonzero for groups of 1, 2 and 4 consecutive pixels of a row-major image."""
    N, C, H, W = t.shape
    nz = (t != 0).permute(0, 2, 3, 1).reshape(N, H * W, C)
    pair = nz[..., 0::2] | nz[..., 1::2]
    out = {f"{prefix}_elem": nz.float().mean().item(), f"{prefix}_pair_g1": pair.float().mean().item()}
    for g in (2, 4):
        P = (H * W) // g * g
        out[f"{prefix}_pair_g{g}"] = pair[:, :P].reshape(N, P // g, g, C // 2).any(2).float().mean().item()
    return {k: round(v, 4) for k, v in out.items()}


def _cases(C: int, H: int, sparsity: float, dy: str, gen: torch.Generator):
    """The timed calls of one row and its densities."""
    N = 32
    a = torch.randn(N, C, H, H, generator=gen).abs() * _clustered((N, C, H, H), 1 - sparsity, gen)
    x = a.contiguous(memory_format=CL).to(BF16)
    w = torch.randn(C, C, 3, 3, generator=gen) / (9 * C) ** 0.5
    g = maxpool_dy(N, C, H, H, MAXPOOL_KEEP, gen) if dy == "maxpool" else torch.randn(N, C, H, H, generator=gen)
    gy = g.to(BF16).contiguous(memory_format=CL)
    geo = U.geometry(x.shape, w.shape, (1, 1), (1, 1), (1, 1))
    op = B.union_operand_bf16(x)
    gop = B.union_operand_bf16(gy, relu=False)
    packs = B.union_pair_packs(w, flipped=True)
    g_nhwc = O.nhwc_copy(gy)
    x_nhwc = op.values
    wb = w.to(BF16)
    w_stride = tuple(w.stride())

    def new_packs():
        w.mul_(1.0)  # a new weight version: the packs are built again
        return B.union_pair_packs(w, flipped=True)

    def dense_bwd(mask):
        return lambda: torch.ops.aten.convolution_backward(
            gy, x, wb, None, (1, 1), (1, 1), (1, 1), False, (0, 0), 1, mask
        )

    fns: Dict[str, Callable[[], object]] = {
        "operand": lambda: B.union_operand_bf16(x),
        "packs": new_packs,
        **{
            f"fwd_g{k}": (lambda k=k: B.union_conv_fwd_bf16(op, w, None, geo, group=k, wf2=packs.wf2))
            for k in (1, 2, 4)
        },
        "dx_x": lambda: B.union_conv_igrad_x_bf16(op, g_nhwc, geo, wc=packs.wc),
        **{
            f"dx_dy_g{k}": (lambda k=k: B.union_conv_igrad_bf16(gop, None, op, geo, wfl2=packs.wfl2, group=k))
            for k in (2, 4)
        },
        "dw_x": lambda: B.union_conv_wgrad_bf16(op, g_nhwc, geo, w_stride),
        "dw_lists": lambda: U.union_conv_wgrad(op, g_nhwc, geo, w_stride, lists=True),
        "dw_dy_lists": lambda: U.union_conv_wgrad_dy(gop, x_nhwc, geo, w_stride, lists=True),
        "dense_fwd": lambda: F.conv2d(x, wb, padding=1),
        "dense_dx": dense_bwd((True, False, False)),
        "dense_dw": dense_bwd((False, True, False)),
    }
    return fns, {**pair_densities(x, "x"), **pair_densities(gy, "dy")}


def summarize(ms: Dict[str, float]) -> Dict[str, float]:
    """The fastest way of each GEMM, their sum with the operand and packs, and dense over it."""
    best = {
        "fwd": min(ms[k] for k in ms if k.startswith("fwd_")),
        "dx": min(ms[k] for k in ms if k.startswith("dx_")),
        "dw": min(ms[k] for k in ms if k.startswith("dw_")),
    }
    sparse = sum(best.values()) + ms["operand"] + ms["packs"]
    dense = ms["dense_fwd"] + ms["dense_dx"] + ms["dense_dw"]
    out = {f"best_{k}": min((n for n in ms if n.startswith(k + "_")), key=ms.get) for k in best}
    out.update(
        {
            "best_sparse_ms": round(sparse, 3),
            "dense_ms": round(dense, 3),
            "speedup_best_sparse_vs_dense": round(dense / sparse, 3),
            **{f"{k}_vs_dense": round(ms["dense_" + k] / v, 3) for k, v in best.items()},
        }
    )
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="two shapes, 50%% and 90%%, 3 rounds")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--out", type=Path, default=None, help="output JSON (default: results dir, adaptive_bf16_gemms.json)"
    )
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error(f"--threads must be at least 1, got {args.threads}")
    if not B.union_dpbf16():
        print(
            "adaptive_bf16_gemms: this CPU does not run the bf16 union kernels (AVX-512 with AVX512-BF16); "
            "nothing to time"
        )
        return
    torch.set_num_threads(args.threads)
    shapes = SHAPES[:2] if args.quick else SHAPES
    sparsities = [0.5, 0.9] if args.quick else SPARSITIES
    rounds = 3 if args.quick else 7
    gen = torch.Generator().manual_seed(0)
    t0 = time.time()
    rows = []
    for C, H in shapes:
        for s in sparsities:
            for dy in DYS:
                fns, dens = _cases(C, H, s, dy, gen)
                ms = round_robin_ms(fns, rounds)
                row = {
                    "shape": [32, C, H, H],
                    "sparsity": s,
                    "dy": dy,
                    "threads": args.threads,
                    **dens,
                    **{k + "_ms": round(v, 3) for k, v in ms.items()},
                    **summarize(ms),
                }
                rows.append(row)
                print(
                    f"[32x{C}x{H}x{H}] {s:.0%} zeros, {dy} dY: fwd {row['best_fwd']} {row['fwd_vs_dense']:.2f}x, "
                    f"dx {row['best_dx']} {row['dx_vs_dense']:.2f}x, dw {row['best_dw']} {row['dw_vs_dense']:.2f}x "
                    f"(pairs set: x g1/g2/g4 {dens['x_pair_g1']:.2f}/{dens['x_pair_g2']:.2f}/{dens['x_pair_g4']:.2f}, "
                    f"dY {dens['dy_pair_g1']:.2f}/{dens['dy_pair_g2']:.2f}/{dens['dy_pair_g4']:.2f}) -> "
                    f"{row['speedup_best_sparse_vs_dense']:.2f}x",
                    flush=True,
                )
    res = {
        "benchmark": "adaptive_bf16_gemms",
        "cpu": sparsa.cpu.cpu_info(),
        "quick": args.quick,
        "method": "each GEMM of conv2d(relu(x), W)'s bf16 sparse path and of dense bf16 (channels-last), 3x3 "
        f"stride 1, batch 32, clustered zeros; dY dense or as behind a 2x2 max-pool (kept with probability "
        f"{MAXPOOL_KEEP}); round-robin medians of {rounds} rounds after a warm-up, {args.threads} threads",
        "rows": rows,
        "seconds": round(time.time() - t0, 1),
    }
    write_results(res, "adaptive_bf16_gemms", args.out)


if __name__ == "__main__":
    main()
