"""Union vs list kernels, GEMM by GEMM, on real VGG-16 activations (relu_conv2d's building blocks).

For each stride-1 3x3 conv of a VGG-16 (no BatchNorm) trained briefly on upsampled digits, with the
layer's real input and real output gradient, at the input's own sparsity and thresholded to 75% / 90%:

- forward: dense ``F.conv2d`` vs the list kernel (compaction + forward) vs the union kernel (bitmask
  operand + forward) on 4- and on 2-pixel groups (``fwd_union2``);
- input gradient: dense vs the list kernel over relu(x)'s nonzeros vs the union kernel over dY's mask,
  4- and 2-pixel groups, vs the dot products at relu(x)'s nonzeros over 4-pixel unions (``dx_union_x``,
  including the rebuild of its weight rows);
- weight gradient: dense vs the list kernel vs the per-channel list kernel (``dw_lists``) vs the union
  kernel over relu(x)'s mask and over dY's.

Times are medians of round-robin repetitions after a warm-up (2 threads unless ``--threads``); every
ratio is dense time / sparse time measured side by side in this run.

    python benchmarks/adaptive_union.py            # 6 layers, 3 sparsities, 9 repetitions
    python benchmarks/adaptive_union.py --quick    # 3 layers, < 1 minute

Writes ``benchmarks/results/<cpu class>/adaptive_union.json`` (``--out`` or ``$SPARSA_RESULTS_DIR`` move it),
with the CPU it ran on.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import adaptive_training as B  # noqa: E402
import sparsa  # noqa: E402
import sparsa.adaptive as sa  # noqa: E402
from _results import results_dir  # noqa: E402
from sparsa.adaptive.memory import retain_freed_memory  # noqa: E402
from sparsa.kernels import adaptive as K  # noqa: E402
from sparsa.kernels import adaptive_union as U  # noqa: E402
from sparsa.timing import round_robin_ms  # noqa: E402

CL = torch.channels_last


def layer_rows(lname, a, gy, reps):
    N, C, H, W = a.shape
    O = gy.shape[1]
    w = (torch.randn(O, C, 3, 3, generator=torch.Generator().manual_seed(0)) * 0.05).contiguous(memory_format=CL)
    geo = K.geometry(a.shape, w.shape, (1, 1), (1, 1), (1, 1), 128)
    wf, wc = K.packed_weight(w)
    ar = a.relu().contiguous(memory_format=CL)
    g = gy.contiguous(memory_format=CL)
    gn = g.permute(0, 2, 3, 1)
    op = U.union_operand(ar)
    gop = U.union_operand(g, relu=False)
    wfu = U.union_packs(w, flipped=False)[0]
    cnt, idx, val = K.compact(ar, 128)

    def bw(mask):
        return torch.ops.aten.convolution_backward(g, ar, w, None, (1, 1), (1, 1), (1, 1), False, (0, 0), 1, mask)

    fns = {
        "fwd_dense": lambda: torch.nn.functional.conv2d(ar, w, None, 1, 1),
        "fwd_list": lambda: K.conv_fwd_packed(*K.compact(ar, 128), wf, None, geo, 1),
        "fwd_union": lambda: U.union_conv_fwd(U.union_operand(ar), w, None, geo),
        "fwd_union2": lambda: U.union_conv_fwd(U.union_operand(ar), w, None, geo, group=2),
        "dx_dense": lambda: bw([True, False, False]),
        "dx_list": lambda: K.conv_bwd_packed(cnt, idx, val, gn, wc, geo, True, True, False),
        "dx_union_dy": lambda: U.union_conv_igrad(U.union_operand(g, relu=False), w, op, geo),
        "dx_union_dy2": lambda: U.union_conv_igrad(U.union_operand(g, relu=False), w, op, geo, group=2),
        "dx_union_x": lambda: U.union_conv_igrad_x(op, gn, geo, wc=U.union_wc(wfu, O, C, 3, 3)),
        "dw_dense": lambda: bw([False, True, False]),
        "dw_list": lambda: K.conv_bwd_packed(cnt, idx, val, gn, wc, geo, True, False, True, w.stride()),
        "dw_union_x": lambda: U.union_conv_wgrad(op, gn, geo, w.stride()),
        "dw_lists": lambda: U.union_conv_wgrad(op, gn, geo, w.stride(), lists=True),
        "dw_union_dy": lambda: U.union_conv_wgrad_dy(U.union_operand(g, relu=False), op.values, geo, w.stride()),
    }
    t = round_robin_ms(fns, reps, min_seconds=0)
    row = {
        "layer": lname,
        "shape": list(a.shape),
        "out_channels": O,
        "activation_sparsity": 1.0 - op.nnz / ar.numel(),
        "grad_sparsity": 1.0 - gop.nnz / g.numel(),
        # fraction of (run of 4 pixels, channel) pairs with a nonzero: what the 4-pixel kernels still
        # compute (independent zeros at density d would give 1 - (1 - d)^4)
        "union4_density": op.union4 / (N * ((H * W + 3) // 4) * C),
        "ms": t,
    }
    for gemm in ("fwd", "dx", "dw"):
        for k in t:
            if k.startswith(gemm + "_") and k != gemm + "_dense":
                row[f"{k}_vs_dense"] = t[gemm + "_dense"] / t[k]
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="default: <results dir of this CPU class>/adaptive_union.json")
    args = ap.parse_args(argv)
    out = args.out or str(results_dir() / "adaptive_union.json")
    if not U.union_native():
        print("the union kernels need AVX-512 and the native build; nothing to measure here")
        return
    torch.set_num_threads(args.threads)
    retain_freed_memory()
    t0 = time.time()
    torch.manual_seed(0)
    model = B.build("vgg16").to(memory_format=CL)
    sa.enable(model, every=10, policy=sa.Policy(force="dense"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = B.digits_batches(32, 31)
    for x, y in data[:30]:
        B.train_step(model, opt, x.contiguous(memory_format=CL), y)
    x, y = data[-1]
    acts = B.capture_inputs(model, x.contiguous(memory_format=CL), y)
    names = ["2", "7", "14"] if args.quick else ["2", "5", "7", "12", "14", "19"]
    reps = 3 if args.quick else 9
    rows = []
    for lname in names:
        _, a, gy = acts[lname]
        for s in (None, 0.75, 0.9):
            at = a if s is None else B.thresholded(a, s)
            r = layer_rows(lname, at, gy, reps)
            r["thresholded_to"] = s
            rows.append(r)
            print(
                f"[{lname} x{tuple(a.shape)} sparsity {r['activation_sparsity']:.2f} dY {r['grad_sparsity']:.2f}] "
                + " ".join(f"{k[:-9]} {v:.2f}x" for k, v in r.items() if k.endswith("_vs_dense")),
                flush=True,
            )
    res = {
        "cpu": sparsa.cpu.cpu_info(),
        # the dense side of every ratio; the bf16 union kernels against dense bf16: adaptive_bf16.py
        "baseline": "dense float32 F.conv2d (channels_last), forward / input gradient / weight gradient",
        "config": {
            "threads": args.threads,
            "quick": args.quick,
            "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(),
            "batch": 32,
            "data": "VGG-16 (no BN) after 30 SGD steps on sklearn digits upsampled to 32x32",
            "seconds": time.time() - t0,
        },
        "rows": rows,
    }
    B.write_results(res, out)


if __name__ == "__main__":
    main()
