"""``F.conv2d`` / ``F.linear`` on a ``relu_compact`` input, forward + backward, against the dense paths.

The ``relu_compact`` layout stores ``relu(x)`` already compacted for the activation-sparse kernels, so
its ops run from the layout's components. Timed side by side (round-robin, warm-up, medians), at each
activation sparsity, with gradients for the input and the weight:

- ``fp32`` / ``fp32_cl`` / ``bf16``: the dense op on ``relu(x)`` (NCHW, channels-last, bf16 autocast);
  the fastest is ``best_dense``;
- ``relu_kernels``: :func:`sparsa.adaptive.relu_conv2d` / ``relu_linear`` on the dense ``x`` (they compact
  ``relu(x)`` themselves);
- ``op``: the op on a prebuilt layout, what a model that keeps its activations in the layout runs: the
  kernels, or the dense op where relu(x) is denser than the op's crossover (``op_route`` in each row);
- ``op_from_dense``: the same with ``sparsa.to_sparse(x, "relu_compact")`` inside the timing;
- ``op_via_dense``: the route the op took before it read the layout's components (``to_dense``, then
  ``relu_conv2d`` compacting again), kept as the within-run reference for that change.

Writes ``benchmarks/results/<cpu class>/relu_compact_ops.json`` (rows ``op, shape, sparsity, <route>_ms,
speedup_vs_best_dense`` per route, ``best_dense``) with the CPU under ``cpu``.

    python benchmarks/relu_compact_ops.py [--quick] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sparsa  # noqa: E402
import sparsa.cpu  # noqa: E402
from _results import results_dir  # noqa: E402
from sparsa.adaptive import relu_conv2d, relu_linear  # noqa: E402
from sparsa.crossovers import crossover  # noqa: E402
from sparsa.timing import best_dense, round_robin_ms  # noqa: E402

DENSE = ("fp32", "fp32_cl", "bf16")


def _activation(shape, sparsity: float, gen: torch.Generator) -> torch.Tensor:
    """``x`` whose ``relu`` has about ``sparsity`` zeros (a shifted normal)."""
    shift = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(sparsity)).item()
    return torch.randn(shape, generator=gen) - shift


def _fwd_bwd(fn, *leaves):
    """One forward + backward of ``fn``; returns the leaves' gradients."""

    def run():
        for t in leaves:
            t.grad = None
        y = fn()
        y.backward(torch.ones_like(y))
        return tuple(t.grad for t in leaves)

    return run


def _routes(op: str, x: torch.Tensor, w: torch.Tensor, kw: dict) -> dict:
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    dense_op = F.conv2d if op == "conv2d" else F.linear
    sparse_fn = relu_conv2d if op == "conv2d" else relu_linear
    layout = sparsa.to_sparse(xg, "relu_compact")  # keeps the graph to xg: gradients reach x
    fns = {
        "fp32": _fwd_bwd(lambda: dense_op(xg.relu(), wg, **kw), xg, wg),
        "bf16": _fwd_bwd(lambda: _autocast(lambda: dense_op(xg.relu(), wg, **kw)), xg, wg),
        "relu_kernels": _fwd_bwd(lambda: sparse_fn(xg, wg, **kw), xg, wg),
        "op": _fwd_bwd(lambda: dense_op(layout, wg, **kw), xg, wg),
        "op_from_dense": _fwd_bwd(lambda: dense_op(sparsa.to_sparse(xg, "relu_compact"), wg, **kw), xg, wg),
        "op_via_dense": _fwd_bwd(lambda: sparse_fn(layout.to_dense(), wg, **kw), xg, wg),
    }
    if op == "conv2d":
        xc = x.contiguous(memory_format=torch.channels_last).requires_grad_()
        wc = w.contiguous(memory_format=torch.channels_last).requires_grad_()
        fns["fp32_cl"] = _fwd_bwd(lambda: F.conv2d(xc.relu(), wc, **kw), xc, wc)
    return fns


def _autocast(fn):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return fn()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one conv shape, two sparsities, fewer rounds")
    ap.add_argument("--tiny", action="store_true", help="small shapes, one round (a smoke test of the routes)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.time()
    gen = torch.Generator().manual_seed(0)
    cases = [("conv2d", (16, 64, 32, 32), (64, 64, 3, 3), {"padding": 1})]
    if args.tiny:
        cases = [("conv2d", (2, 16, 6, 6), (8, 16, 3, 3), {"padding": 1}), ("linear", (12, 24), (8, 24), {})]
    elif not args.quick:
        cases += [
            ("conv2d", (32, 128, 16, 16), (128, 128, 3, 3), {"padding": 1}),
            ("linear", (2048, 768), (768, 768), {}),
        ]
    sparsities = (0.5, 0.9) if args.quick or args.tiny else (0.5, 0.7, 0.9)
    rounds = 1 if args.tiny else 5 if args.quick else 15
    rows = []
    for op, xs, ws, kw in cases:
        w = torch.randn(ws, generator=gen) * 0.05
        for s in sparsities:
            ms = round_robin_ms(_routes(op, _activation(xs, s, gen), w, kw), rounds)
            dense = {k: ms[k] for k in DENSE if k in ms}
            best = best_dense(dense)
            row = {"op": op, "shape": list(xs), "weight": list(ws), "sparsity": s, "threads": args.threads}
            row.update({f"{k}_ms": round(v, 3) for k, v in ms.items()})
            row["best_dense"] = best
            row.update({f"{k}_speedup_vs_best_dense": round(dense[best] / ms[k], 3) for k in ms if k not in DENSE})
            row["op_vs_op_via_dense"] = round(ms["op_via_dense"] / ms["op"], 3)
            row["op_route"] = "dense" if (1.0 - s) > crossover(f"relu_compact.{op}") else "kernels"
            rows.append(row)
            print(
                f"{op} {xs} sparsity {s} (op route: {row['op_route']}): best dense {best} {dense[best]:.2f} ms; "
                + ", ".join(f"{k} {ms[k]:.2f} ms ({dense[best] / ms[k]:.2f}x)" for k in ms if k not in DENSE),
                flush=True,
            )
    out = args.out or results_dir() / "relu_compact_ops.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    res = {
        "benchmark": "relu_compact_ops",
        "cpu": sparsa.cpu.cpu_info(),
        "torch": torch.__version__,
        "quick": args.quick or args.tiny,
        "timing": "forward + backward (input and weight gradients), round-robin, warm-up, median of rounds",
        "rows": rows,
        "seconds": round(time.time() - t_start, 1),
    }
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
