"""A transformer MLP with row_group weights: one ``sparsa::row_group_mlp_kernel`` call against the two
``row_group_linear`` products it replaces and against dense PyTorch, side by side in one process.

Per MLP shape (BERT-base's 768 -> 3072 -> 768 by default), sparsity and token count, round robin after a
warm-up, medians: ``fused`` (the op: on AMX tiles, bf16, groups of 16, the hidden activation stays in
packed panels), ``two_products`` (``row_group_linear`` with GELU in its epilogue, then the second product:
what a model runs without ``sparsa.fuse_mlp``), and dense ``F.linear`` -> ``F.gelu`` -> ``F.linear`` in
float32 and bfloat16 eager and ``torch.compile`` of the bf16 one (``compiled_bfloat16``, Inductor's GELU
fused into the first product's output; ``best_dense``: the fastest of the three). The sparse weights are
bf16 (row groups of 16, one-shot magnitude); the dense ones hold the same kept values. Rows: ``shape,
sparsity, tokens, threads, fused_ms, two_products_ms, dense_float32_ms, dense_bfloat16_ms,
dense_compiled_bfloat16_ms, best_dense, fused_vs_two_products, fused_vs_best_dense,
two_products_vs_best_dense, fused_path`` (``native``: the one-call AMX path ran; ``two_products``: the op
ran the two products, e.g. no AMX here), ``max_rel_err`` (fused against the float64
product of the same bf16 operands).

    python benchmarks/row_group_mlp.py [--quick]

Writes ``benchmarks/results/<cpu class>/row_group_mlp.json`` (``--out`` or ``$SPARSA_RESULTS_DIR`` move it).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sparsa  # noqa: E402
from sparsa.kernels import row_group as rg  # noqa: E402
from sparsa.kernels import row_group_mlp as rgm  # noqa: E402
from sparsa.layouts import RowGroup  # noqa: E402
from sparsa.timing import round_robin_ms  # noqa: E402
from _results import write_results  # noqa: E402

SHAPES = {"bert-base": (768, 3072, 768), "bert-large": (1024, 4096, 1024)}
DENSE = ("float32", "bfloat16", "compiled_bfloat16")


def _dense_mlp(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="90%% only, 128 tokens, 10 rounds")
    ap.add_argument("--models", nargs="+", default=["bert-base"], choices=sorted(SHAPES))
    ap.add_argument("--sparsities", nargs="+", type=float, default=[0.5, 0.75, 0.9])
    ap.add_argument("--tokens", nargs="+", type=int, default=[128, 1024])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="output JSON (default: the results folder of this CPU class)")
    a = ap.parse_args(argv)
    if a.quick:
        a.sparsities, a.tokens, a.rounds = [0.9], [128], 10
    bad = [s for s in a.sparsities if not 0.0 < s < 1.0]
    if bad:
        ap.error(f"--sparsities must be in (0, 1), got {bad}")
    if any(t < 1 for t in a.tokens):
        ap.error(f"--tokens must be at least 1, got {a.tokens}")
    if a.rounds < 1 or a.threads < 1:
        ap.error("--rounds and --threads must be at least 1")
    return a


def main(argv: Optional[Sequence[str]] = None) -> None:
    a = _parse(argv)
    torch.set_num_threads(a.threads)
    t_start = time.time()
    rows: List[dict] = []
    gen = torch.Generator().manual_seed(0)
    compiled = torch.compile(_dense_mlp, dynamic=False)  # one graph per token count
    for model in a.models:
        K, H, R = SHAPES[model]
        for sp in a.sparsities:
            w1 = RowGroup.from_dense(torch.randn(H, K, generator=gen) / K**0.5, group=16, sparsity=sp)
            w2 = RowGroup.from_dense(torch.randn(R, H, generator=gen) / H**0.5, group=16, sparsity=sp)
            v1, v2 = w1.values.bfloat16(), w2.values.bfloat16()
            b1, b2 = torch.randn(H, generator=gen).bfloat16(), torch.randn(R, generator=gen).bfloat16()
            d1 = RowGroup(w1.columns, v1, w1.shape, w1.row_perm, validate=False).to_dense()
            d2 = RowGroup(w2.columns, v2, w2.shape, w2.row_perm, validate=False).to_dense()
            dense = {
                "float32": (d1.float(), b1.float(), d2.float(), b2.float()),
                "bfloat16": (d1.bfloat16(), b1, d2.bfloat16(), b2),
            }
            for T in a.tokens:
                x = torch.randn(T, K, generator=gen).bfloat16()
                args = (x, w1.columns, v1, b1, H, w1.row_perm, w2.columns, v2, b2, R, w2.row_perm)
                native = rgm.native_mlp(*args, 1) is not None

                def two(args=args):
                    h = rg.row_group_linear_kernel(*args[:6], "gelu")
                    return rg.row_group_linear_kernel(h, *args[6:], "none")

                fns = {
                    "fused": lambda args=args: rgm.row_group_mlp_kernel(*args),
                    "two_products": two,
                }
                for dt, ops in dense.items():
                    fns[f"dense_{dt}"] = lambda xd=x.to(ops[0].dtype), ops=ops: _dense_mlp(xd, *ops)
                fns["dense_compiled_bfloat16"] = lambda x=x, ops=dense["bfloat16"]: compiled(x, *ops)
                with torch.inference_mode():
                    y = fns["fused"]()
                    ref = F.gelu(x.double() @ d1.double().T + b1.double()).bfloat16().double() @ d2.double().T
                    ref = ref + b2.double()
                    err = float((y.double() - ref).abs().max() / ref.abs().max())
                    for fn in fns.values():  # warm-up: builds, packs
                        fn()
                    ms = round_robin_ms(fns, rounds=a.rounds, min_seconds=0.0)
                best = min(DENSE, key=lambda d: ms[f"dense_{d}"])
                row = {
                    "model": model,
                    "shape": [K, H, R],
                    "sparsity": sp,
                    "tokens": T,
                    "threads": a.threads,
                    **{f"{k}_ms": round(v, 3) for k, v in ms.items()},
                    "best_dense": best,
                    "fused_vs_two_products": round(ms["two_products"] / ms["fused"], 3),
                    "fused_vs_best_dense": round(ms[f"dense_{best}"] / ms["fused"], 3),
                    "two_products_vs_best_dense": round(ms[f"dense_{best}"] / ms["two_products"], 3),
                    "fused_path": "native" if native else "two_products",
                    "max_rel_err": float(f"{err:.2e}"),
                }
                rows.append(row)
                print(
                    f"{model} {sp:.0%} T={T}: fused x{row['fused_vs_two_products']:.2f} vs two products "
                    f"({row['fused_path']}), x{row['fused_vs_best_dense']:.2f} vs dense {best} "
                    f"(two products x{row['two_products_vs_best_dense']:.2f}), err {err:.1e}",
                    flush=True,
                )
    res = {
        "benchmark": "row_group_mlp",
        "cpu": sparsa.cpu.cpu_info(),
        "threads": a.threads,
        "quick": a.quick,
        "rounds": a.rounds,
        "amx": rg.has_amx(),
        "torch": torch.__version__,
        "timing": "warm-up, then medians of round-robin rounds (one call of each per round), inference mode",
        "seconds": round(time.time() - t_start, 1),
        "rows": rows,
    }
    write_results(res, "row_group_mlp", Path(a.out) if a.out else None)


if __name__ == "__main__":
    main()
