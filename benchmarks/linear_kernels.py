"""Is a pruned linear layer faster? ``F.linear(x, sparse_weight)`` vs dense MKL, per layout.

Every sparsa layout with a registered ``linear`` implementation is timed through the public path
(``F.linear`` on a :class:`sparsa.SparseTensor`, dispatcher included), plus torch.sparse CSR and BSR
(16x16 blocks) as baselines, alternating with the dense ``F.linear`` in one process (median of
repetitions). Writes ``benchmarks/results/linear_kernels.json`` and prints a table.

    flock /tmp/sparsa-bench.lock python benchmarks/linear_kernels.py --quick   # < 2 minutes
    flock /tmp/sparsa-bench.lock python benchmarks/linear_kernels.py           # full grid, ~15 minutes
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sparsa  # noqa: E402
from benchmarks._timing import compare  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "linear_kernels.json"
SHAPES = [(768, 768), (3072, 768), (768, 3072)]  # (out_features, in_features)
TOKENS = [1024, 128, 1]
SPARSITIES = [0.5, 0.75, 0.875, 0.9, 0.95]
THREADS = [1, 2]
BLOCK = 16  # torch.sparse BSR block size (and the block mask it uses)


def magnitude_mask(w: torch.Tensor, sparsity: float) -> torch.Tensor:
    keep = max(1, int(round(w.numel() * (1 - sparsity))))
    m = torch.zeros(w.numel(), dtype=torch.bool)
    m[w.abs().flatten().topk(keep).indices] = True
    return m.view(w.shape)


def block_mask(w: torch.Tensor, sparsity: float, block: int = BLOCK) -> torch.Tensor:
    R, K = w.shape
    norms = w.pow(2).view(R // block, block, K // block, block).sum((1, 3))
    keep = max(1, int(round(norms.numel() * (1 - sparsity))))
    m = torch.zeros(norms.numel(), dtype=torch.bool)
    m[norms.flatten().topk(keep).indices] = True
    return m.view(norms.shape).repeat_interleave(block, 0).repeat_interleave(block, 1)


def nm_for(sparsity: float) -> Tuple[int, int]:
    """An N:M pattern with (about) the requested sparsity."""
    return {0.5: (2, 4), 0.75: (1, 4), 0.875: (1, 8), 0.9: (1, 10), 0.95: (1, 20)}.get(
        sparsity, (1, max(2, int(round(1 / (1 - sparsity))))))


def build_layout(name: str, w: torch.Tensor, sparsity: float) -> torch.Tensor:
    """A SparseTensor of layout ``name`` at (about) ``sparsity``; its natural structure when it has one."""
    if name in ("row_group", "sliced_ell"):
        return sparsa.to_sparse(w, name, sparsity=sparsity)
    if name in ("nm", "grouped_nm"):
        n, m = nm_for(sparsity)
        return sparsa.to_sparse(w, name, n=n, m=m)
    if name == "bsr":
        return sparsa.to_sparse(w, name, mask=block_mask(w, sparsity), blocksize=(BLOCK, BLOCK))
    return sparsa.to_sparse(w, name, mask=magnitude_mask(w, sparsity))


def sparsa_layouts() -> List[str]:
    names = []
    for (op, lays), _ in sparsa.ops.registered_impls("linear").items():
        if lays[0] == "dense" and lays[2] == "dense" and lays[1] != "dense":
            names.append(lays[1])
    return sorted(set(names), key=lambda n: (n not in ("row_group", "sliced_ell"), n))


def candidates(w: torch.Tensor, sparsity: float, layouts: List[str]) -> Dict[str, Tuple[Callable, torch.Tensor]]:
    """name -> (fn(x) -> y, the dense weight it represents)."""
    out: Dict[str, Tuple[Callable, torch.Tensor]] = {}
    for name in layouts:
        try:
            sw = build_layout(name, w, sparsity)
        except (ValueError, TypeError) as e:  # a layout that cannot represent this pattern
            print(f"  skip {name} at sparsity {sparsity}: {e}", file=sys.stderr)
            continue
        out[name] = ((lambda x, sw=sw: F.linear(x, sw)), sw.to_dense().detach())
    wm = w * magnitude_mask(w, sparsity)
    csr = wm.to_sparse_csr()
    out["torch_csr"] = ((lambda x: torch.sparse.mm(csr, x.t()).t()), wm)
    wb = w * block_mask(w, sparsity)
    bsr = wb.to_sparse_bsr((BLOCK, BLOCK))
    out["torch_bsr"] = ((lambda x: (bsr @ x.t()).t()), wb)
    return out


def measure(x: torch.Tensor, w: torch.Tensor, fn: Callable, ref_w: torch.Tensor, reps: int) -> Tuple[float, float]:
    with torch.no_grad():
        y = fn(x)
        err = float((y - F.linear(x, ref_w)).abs().max()) if y.numel() else 0.0
        t0 = time.perf_counter()
        fn(x)
        one = time.perf_counter() - t0
        r = reps if one < 0.02 else max(1, min(reps, 2))  # slow (pure-torch) candidates: few repetitions
        c = compare(lambda: F.linear(x, w), lambda: fn(x), reps=r, warmup=1 if one > 0.02 else 2,
                    min_seconds=0.002 if one > 0.02 else 0.005)
    return c.ratio, err


def run(shapes, tokens, sparsities, threads, reps: int, layouts: Optional[List[str]] = None) -> List[dict]:
    layouts = sparsa_layouts() if layouts is None else layouts
    print(f"layouts: {layouts} + torch_csr, torch_bsr", flush=True)
    rows = []
    gen = torch.Generator().manual_seed(0)
    for nt in threads:
        torch.set_num_threads(nt)
        for R, K in shapes:
            w = torch.randn(R, K, generator=gen) / K ** 0.5
            for T in tokens:
                x = torch.randn(T, K, generator=gen)
                for s in sparsities:
                    line = []
                    for name, (fn, ref_w) in candidates(w, s, layouts).items():
                        ratio, err = measure(x, w, fn, ref_w, reps)
                        rows.append(dict(layout=name, out_features=R, in_features=K, tokens=T, sparsity=s, threads=nt,
                                         ratio_vs_dense=round(ratio, 3), max_abs_err=err))
                        line.append(f"{name}={ratio:.2f}")
                    print(f"threads={nt} {R}x{K} T={T:<5} s={s:<6} " + " ".join(line), flush=True)
    return rows


def summary(rows: List[dict]) -> str:
    """Pivot: ratio per layout and sparsity for each (shape, tokens, threads)."""
    lines = []
    keys = sorted({(r["threads"], r["out_features"], r["in_features"], -r["tokens"]) for r in rows})
    for nt, R, K, negT in keys:
        sub = [r for r in rows if (r["threads"], r["out_features"], r["in_features"], r["tokens"]) == (nt, R, K, -negT)]
        sps = sorted({r["sparsity"] for r in sub})
        lines.append(f"\n{R}x{K}, {-negT} tokens, {nt} thread(s): speed-up vs dense F.linear")
        lines.append(f"{'layout':<12}" + "".join(f"{s:>8}" for s in sps))
        for name in dict.fromkeys(r["layout"] for r in sub):
            vals = {r["sparsity"]: r["ratio_vs_dense"] for r in sub if r["layout"] == name}
            lines.append(f"{name:<12}" + "".join(f"{vals[s]:>8.2f}" if s in vals else f"{'-':>8}" for s in sps))
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a subset that runs in under 2 minutes")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--shapes", help="filter: comma-separated OUTxIN shapes, e.g. 768x3072")
    ap.add_argument("--tokens", help="filter: comma-separated token counts, e.g. 1024")
    ap.add_argument("--sparsities", help="filter: comma-separated sparsities, e.g. 0.75,0.9")
    ap.add_argument("--threads", help="filter: comma-separated thread counts, e.g. 1")
    ap.add_argument("--layouts", help="filter: comma-separated sparsa layouts, e.g. row_group,grouped_nm "
                                      "(torch_csr/torch_bsr baselines always run)")
    args = ap.parse_args(argv)
    if args.quick:
        grid = dict(shapes=[(768, 768)], tokens=[1024, 1], sparsities=[0.5, 0.875, 0.95], threads=[1], reps=3)
    else:
        grid = dict(shapes=SHAPES, tokens=TOKENS, sparsities=SPARSITIES, threads=THREADS, reps=5)
    if args.shapes:
        grid["shapes"] = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if args.tokens:
        grid["tokens"] = [int(v) for v in args.tokens.split(",")]
    if args.sparsities:
        grid["sparsities"] = [float(v) for v in args.sparsities.split(",")]
    if args.threads:
        grid["threads"] = [int(v) for v in args.threads.split(",")]
    if args.layouts:
        grid["layouts"] = args.layouts.split(",")
    t0 = time.perf_counter()
    rows = run(**grid)
    meta = dict(torch=torch.__version__, python=platform.python_version(), machine=platform.machine(),
                processor=platform.processor(), quick=args.quick, seconds=round(time.perf_counter() - t0, 1),
                timing="median of alternating dense/sparse repetitions; ratio = dense time / sparse time",
                baseline="torch.nn.functional.linear (MKL) on the dense weight")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(summary(rows))
    print(f"\nwrote {args.out} ({len(rows)} rows, {meta['seconds']} s)")


if __name__ == "__main__":
    main()
