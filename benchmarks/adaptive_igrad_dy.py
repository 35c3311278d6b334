"""Input gradient of the activation-sparse conv: the x-sparse kernel (work ~ nnz(relu(x))) vs the
dY-sparse path (compact dY, forward conv with the flipped weight, ReLU mask; work ~ nnz(dY)) vs
oneDNN (``aten.convolution_backward``, input gradient only).

Batch 32, 3x3 pad 1, C = O; x- and dY-sparsity in {0.5, 0.75, 0.9} with clustered zeros (a
threshold on randn + a per-pixel offset). The three calls alternate in one process; medians.
The dY path's time includes compacting dY (it runs in every backward that takes it). Like
``sparsa.adaptive.enable`` the script keeps freed heap memory in the process (``--no-retain``: not).

    flock /tmp/sparsa-bench.lock .venv/bin/python benchmarks/adaptive_igrad_dy.py [--quick] [--threads 2]

Writes ``benchmarks/results/<cpu class>/adaptive_igrad_dy.json`` (``$SPARSA_RESULTS_DIR`` moves it), with
the CPU it ran on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import sparsa  # noqa: E402
from _results import results_dir  # noqa: E402
from sparsa.adaptive import conv as M  # noqa: E402
from sparsa.adaptive.memory import retain_freed_memory  # noqa: E402
from sparsa.kernels import adaptive as K  # noqa: E402

CL = torch.channels_last
SHAPES = [(32, 64, 32, 32), (32, 128, 16, 16), (32, 256, 8, 8), (32, 512, 4, 4)]
SPARSITIES = [0.5, 0.75, 0.9]


def clustered_mask(shape, sp, gen):
    a = torch.randn(*shape, generator=gen) + 0.5 * torch.randn(shape[0], 1, shape[2], shape[3], generator=gen)
    t = torch.quantile(a.reshape(-1)[:200000], sp)
    return a > t


def alternate(fns, reps):
    for _ in range(2):
        for f in fns:
            f()
    ts = [[] for _ in fns]
    for _ in range(reps):
        for i, f in enumerate(fns):
            t0 = time.perf_counter()
            f()
            ts[i].append(time.perf_counter() - t0)
    return [statistics.median(t) * 1e3 for t in ts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="two shapes, sparsities 0.5/0.9, fewer reps")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--slice", type=int, default=128)
    ap.add_argument(
        "--no-retain",
        action="store_true",
        help="leave glibc's malloc thresholds alone (enable() raises them: freed buffers are reused)",
    )
    args = ap.parse_args()
    retained = False if args.no_retain else retain_freed_memory()
    if not K.native_available():
        sys.exit("native adaptive kernels unavailable (SPARSA_NO_NATIVE set or build failed)")
    torch.set_num_threads(args.threads)
    shapes = SHAPES[1:3] if args.quick else SHAPES
    sps = [0.5, 0.9] if args.quick else SPARSITIES
    reps = args.reps or (5 if args.quick else 11)
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"threads={args.threads} slice={args.slice} retain_freed_memory={retained}; ms (median of {reps}).")
    print(
        "Input gradient: old = x-sparse kernel,"
        " new = dY path (incl. compacting dY), dnn = oneDNN. both = input + weight gradient (old: one call;"
        " new: dY path + weight-gradient-only call). rule = what relu_conv2d's backward picks"
    )
    print(
        f"{'shape':>18} {'x_sp':>5} {'dy_sp':>5} {'nnz dY/x':>8} {'old':>7} {'new':>7} {'onednn':>7}"
        f" {'old/new':>7} {'dnn/new':>7} {'dnn/old':>7} {'both o/n':>8} {'rule':>4}"
    )
    for shape in shapes:
        N, C, H, W = shape
        O = C
        w = torch.randn(O, C, 3, 3, generator=gen) * 0.05
        geo = K.geometry(shape, w.shape, (1, 1), (1, 1), (1, 1), args.slice)
        _, wc = K.packed_weight(w)
        wfl = K.packed_weight_flipped(w)
        for xs in sps:
            x = (torch.randn(*shape, generator=gen).abs() * clustered_mask(shape, xs, gen)).contiguous(memory_format=CL)
            cnt, idx, val = K.compact(x, args.slice)
            for ds in sps:
                gy = torch.randn(N, O, H, W, generator=gen) * clustered_mask((N, O, H, W), ds, gen)
                gy = gy.contiguous(memory_format=CL)
                g = gy.permute(0, 2, 3, 1).contiguous()
                gn = g.permute(0, 3, 1, 2)
                nnz_x, nnz_g = int(cnt.sum()), int((g != 0).sum())

                def old():
                    return K.conv_bwd_packed(cnt, idx, val, g, wc, geo, True, True, False)[0]

                def new():
                    gc, gi, gv = K.compact_signed(gn, args.slice)
                    return K.conv_igrad_dy(gc, gi, gv, wfl, cnt, idx, geo, args.slice, True)

                def dnn():
                    return torch.ops.aten.convolution_backward(
                        gy, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, False, False]
                    )[0]

                def old_both():
                    return K.conv_bwd_packed(cnt, idx, val, g, wc, geo, True, True, True, w.stride())

                def new_both():
                    return new(), K.conv_bwd_packed(cnt, idx, val, g, wc, geo, True, False, True, w.stride())[1]

                torch.testing.assert_close(new(), old(), atol=1e-4, rtol=1e-4)
                if not rows:  # the first measurement of the process runs on a cold machine: warm up
                    alternate([old, new, dnn, old_both, new_both], 3)
                to, tn, td = alternate([old, new, dnn], reps)
                tbo, tbn = alternate([old_both, new_both], max(3, reps // 2))
                rule = "dy" if M._dy_path_pays(g, cnt, geo) else "x"
                r = nnz_g / max(1, nnz_x)
                rows.append(
                    dict(
                        shape=list(shape),
                        x_sparsity=xs,
                        dy_sparsity=ds,
                        nnz_ratio=round(r, 4),
                        old_ms=round(to, 3),
                        new_ms=round(tn, 3),
                        onednn_ms=round(td, 3),
                        old_over_new=round(to / tn, 3),
                        onednn_over_new=round(td / tn, 3),
                        onednn_over_old=round(td / to, 3),
                        both_old_ms=round(tbo, 3),
                        both_new_ms=round(tbn, 3),
                        rule=rule,
                    )
                )
                print(
                    f"{str(shape):>18} {xs:5.2f} {ds:5.2f} {r:8.3f} {to:7.2f} {tn:7.2f} {td:7.2f}"
                    f" {to / tn:7.2f} {td / tn:7.2f} {td / to:7.2f} {tbo / tbn:8.2f} {rule:>4}",
                    flush=True,
                )
    out = results_dir() / "adaptive_igrad_dy.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            dict(
                cpu=sparsa.cpu.cpu_info(),
                threads=args.threads,
                slice=args.slice,
                quick=args.quick,
                reps=reps,
                retain_freed_memory=retained,
                torch=torch.__version__,
                rows=rows,
            ),
            indent=1,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
