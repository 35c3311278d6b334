"""Is a pruned linear layer faster? ``F.linear(x, sparse_weight)`` against the best dense path, per layout.

Every sparsa layout with a registered ``linear`` implementation is timed through the public path
(``F.linear`` on a :class:`sparsa.SparseTensor`, dispatcher included), plus torch.sparse CSR and BSR
(16x16 blocks) as baselines, in float32 and in bfloat16 (the layout's ``.to(torch.bfloat16)`` with a
bfloat16 input). Three dense baselines are timed for each shape, token count and thread count: dense
fp32 ``F.linear``, dense bf16 ``F.linear`` (input and weight in bfloat16) and ``torch.compile`` of the
faster of the two. Each sparse row is timed alternating with dense fp32 and with the fastest dense
baseline in one process (warm-up first, median of repetitions):

- ``ratio_vs_dense``      = dense fp32 eager time / sparse time (the meaning it always had);
- ``ratio_vs_best_dense`` = fastest dense time (fp32, bf16, compiled) / sparse time.

Writes ``benchmarks/results/<cpu class>/linear_kernels.json`` (``sparsa.cpu.cpu_class()``, e.g.
``amd-avx2``; ``$SPARSA_RESULTS_DIR`` or ``--out`` redirect it) with the CPU's model and flags under
``cpu``, and prints a table.

    flock /tmp/sparsa-bench.lock python benchmarks/linear_kernels.py --quick   # a few minutes
    flock /tmp/sparsa-bench.lock python benchmarks/linear_kernels.py           # full grid
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sparsa  # noqa: E402
import sparsa.cpu  # noqa: E402
from _compile import compile_many_models  # noqa: E402
from _results import results_dir  # noqa: E402
from sparsa.timing import round_robin_ms  # noqa: E402

SHAPES = [(768, 768), (3072, 768), (768, 3072)]  # (out_features, in_features)
TOKENS = [1024, 128, 1]
SPARSITIES = [0.5, 0.75, 0.875, 0.9, 0.95]
THREADS = [1, 2]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BLOCK = 16  # torch.sparse BSR block size (and the block mask it uses)
#: the largest max_rel_err (vs a float64 reference, relative to the reference's largest magnitude) a row
#: may have before it is flagged: bf16 keeps 8 significant bits, its inputs alone are rounded by 2**-9
REL_TOL = {"float32": 1e-4, "bfloat16": 2e-2}
#: the keys of every row (dense baselines and sparse rows alike); sparse rows add SPARSE_KEYS
ROW_KEYS = (
    "layout",
    "dtype",
    "compiled",
    "out_features",
    "in_features",
    "tokens",
    "sparsity",
    "threads",
    "ms",
    "ratio_vs_dense",
    "ratio_vs_best_dense",
    "max_rel_err",
    "rel_tol",
    "accurate",
)
SPARSE_KEYS = ("dense_ms", "best_dense", "best_dense_ms", "max_abs_err")


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
        sparsity, (1, max(2, int(round(1 / (1 - sparsity)))))
    )


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


def dense_label(dtype: str, compiled: bool = False) -> str:
    """The name of a dense baseline: ``fp32``, ``bf16``, ``compiled_fp32``, ``compiled_bf16``."""
    short = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    return f"compiled_{short}" if compiled else short


def parse_dense_label(label: str) -> Tuple[str, bool]:
    """Inverse of :func:`dense_label`: ``(dtype, compiled)``."""
    compiled = label.startswith("compiled_")
    short = label[len("compiled_") :] if compiled else label
    return {"fp32": "float32", "bf16": "bfloat16"}[short], compiled


def pick_best(ms: Dict[str, float]) -> str:
    """The label with the smallest time (ties: the first)."""
    if not ms:
        raise ValueError("pick_best needs at least one timed baseline, got none")
    return min(ms, key=lambda k: ms[k])


def sparse_ratios(ms: Dict[str, float], candidate: str = "sparse") -> Dict[str, object]:
    """Ratios of one side-by-side timing ``{"fp32": ..., <other dense labels>: ..., candidate: ...}`` (ms).

    ``ratio_vs_dense`` is dense fp32 eager / candidate; ``ratio_vs_best_dense`` is the fastest dense
    time in the same timing / candidate, so it is never above ``ratio_vs_dense``.
    """
    if "fp32" not in ms or candidate not in ms:
        raise ValueError(f"sparse_ratios needs 'fp32' and {candidate!r} times, got {sorted(ms)}")
    dense = {k: v for k, v in ms.items() if k != candidate}
    best = pick_best(dense)
    c = ms[candidate]
    return {
        "ms": round(c, 4),
        "dense_ms": round(ms["fp32"], 4),
        "best_dense": best,
        "best_dense_ms": round(dense[best], 4),
        "ratio_vs_dense": round(ms["fp32"] / c, 3),
        "ratio_vs_best_dense": round(dense[best] / c, 3),
    }


def dense_rows(ms: Dict[str, float], errs: Dict[str, float], common: Dict[str, object]) -> List[dict]:
    """One row per dense baseline (``layout="dense"``, sparsity 0) from their side-by-side times."""
    best = min(ms.values())
    rows = []
    for label, t in ms.items():
        dtype, compiled = parse_dense_label(label)
        err = errs.get(label, float("nan"))
        rows.append(
            dict(
                layout="dense",
                dtype=dtype,
                compiled=compiled,
                **common,
                sparsity=0.0,
                ms=round(t, 4),
                ratio_vs_dense=round(ms["fp32"] / t, 3),
                ratio_vs_best_dense=round(best / t, 3),
                max_rel_err=err,
                rel_tol=REL_TOL[dtype],
                accurate=bool(err <= REL_TOL[dtype]),
            )
        )
    return rows


def rel_err(y: torch.Tensor, ref64: torch.Tensor) -> float:
    """Largest absolute difference from a float64 reference, relative to the reference's largest magnitude."""
    if y.numel() == 0:
        return 0.0
    return float((y.double() - ref64).abs().max() / ref64.abs().max().clamp_min(1e-30))


def _compiled_linear(w: torch.Tensor) -> Callable:
    torch._dynamo.reset()  # a fresh cache per baseline: no recompile limit, no stale thread count
    return torch.compile(lambda x: F.linear(x, w), dynamic=False)


def _side_by_side(
    fns: Dict[str, Callable[[], object]], reps: int, slow: bool, warmup: Optional[int] = None
) -> Dict[str, float]:
    """Warm up, then median ms of each function timed round-robin (alternating, same machine state)."""
    for _ in range((1 if slow else 2) if warmup is None else warmup):
        for fn in fns.values():
            fn()
    return round_robin_ms(fns, rounds=reps, min_seconds=0.002 if slow else 0.005)


def dense_baselines(
    x: torch.Tensor, w: torch.Tensor, reps: int, use_compile: bool
) -> Tuple[Dict[str, Callable[[], object]], Dict[str, float], Dict[str, float], float]:
    """Dense fp32 and bf16 eager, then torch.compile of the faster: (fns, ms, max_rel_err, compile seconds)."""
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    fns: Dict[str, Callable[[], object]] = {"fp32": lambda: F.linear(x, w), "bf16": lambda: F.linear(xb, wb)}
    ref = F.linear(x.double(), w.double())
    compile_s = 0.0
    with torch.no_grad():
        ms = _side_by_side(fns, reps, slow=False)
        if use_compile:
            faster = pick_best(ms)
            dtype, _ = parse_dense_label(faster)
            xc, wc = (x, w) if dtype == "float32" else (xb, wb)
            cfn = _compiled_linear(wc)
            t0 = time.perf_counter()
            cfn(xc)
            compile_s = time.perf_counter() - t0
            fns[dense_label(dtype, compiled=True)] = lambda: cfn(xc)
            ms = _side_by_side(fns, reps, slow=False)
        errs = {k: rel_err(fn(), ref) for k, fn in fns.items()}
    return fns, ms, errs, compile_s


def candidates(
    w: torch.Tensor, sparsity: float, layouts: List[str], dtypes: Sequence[str]
) -> List[Tuple[str, str, Callable, torch.Tensor]]:
    """(name, dtype, fn(x) -> y, the fp32 dense weight it represents) for every layout and dtype."""
    out: List[Tuple[str, str, Callable, torch.Tensor]] = []
    for name in layouts:
        try:
            sw = build_layout(name, w, sparsity)
        except (ValueError, TypeError) as e:  # a layout that cannot represent this pattern
            print(f"  skip {name} at sparsity {sparsity}: {e}", file=sys.stderr)
            continue
        ref_w = sw.to_dense().detach()
        for dt in dtypes:
            try:
                swd = sw if dt == "float32" else sw.to(DTYPES[dt])
            except (ValueError, TypeError, RuntimeError, NotImplementedError) as e:
                print(f"  skip {name} in {dt}: {e}", file=sys.stderr)
                continue
            out.append((name, dt, (lambda x, sw=swd: F.linear(x, sw)), ref_w))
    wm = w * magnitude_mask(w, sparsity)
    wb = w * block_mask(w, sparsity)
    for dt in dtypes:
        csr = wm.to(DTYPES[dt]).to_sparse_csr()
        out.append(("torch_csr", dt, (lambda x, csr=csr: torch.sparse.mm(csr, x.t()).t()), wm))
        bsr = wb.to(DTYPES[dt]).to_sparse_bsr((BLOCK, BLOCK))
        out.append(("torch_bsr", dt, (lambda x, bsr=bsr: (bsr @ x.t()).t()), wb))
    return out


def measure(
    fn: Callable, x: torch.Tensor, x32: torch.Tensor, ref_w: torch.Tensor, dense: Dict[str, Callable], reps: int
) -> Optional[Dict[str, object]]:
    """Accuracy and side-by-side times of one candidate against the dense baselines in ``dense``
    (``fp32`` and the fastest); ``{"skip": reason}`` when the candidate cannot run this dtype."""
    with torch.no_grad():
        try:
            y = fn(x)
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
            return {"skip": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
        ref64 = F.linear(x32.double(), ref_w.double())
        abs_err = float((y.float() - F.linear(x32, ref_w)).abs().max()) if y.numel() else 0.0
        t0 = time.perf_counter()
        fn(x)
        one = time.perf_counter() - t0
        # slow (pure-torch) candidates: few repetitions; very slow ones one round and no further warm-up
        # (the two calls above were warm-up enough)
        slow = one > 0.02
        rounds, warmup = (reps, 2) if not slow else (max(1, min(reps, 2)), 1) if one < 0.2 else (1, 0)
        ms = _side_by_side(dict(dense, sparse=lambda: fn(x)), rounds, slow, warmup)
    return dict(sparse_ratios(ms), max_abs_err=abs_err, max_rel_err=rel_err(y, ref64))


def run(
    shapes,
    tokens,
    sparsities,
    threads,
    reps: int,
    layouts: Optional[List[str]] = None,
    dtypes: Sequence[str] = tuple(DTYPES),
    use_compile: bool = True,
) -> List[dict]:
    layouts = sparsa_layouts() if layouts is None else layouts
    print(f"layouts: {layouts} + torch_csr, torch_bsr; dtypes: {list(dtypes)}; compile: {use_compile}", flush=True)
    rows = []
    gen = torch.Generator().manual_seed(0)
    for nt in threads:
        torch.set_num_threads(nt)
        for R, K in shapes:
            w = torch.randn(R, K, generator=gen) / K**0.5
            for T in tokens:
                x = torch.randn(T, K, generator=gen)
                xs = {"float32": x, "bfloat16": x.to(torch.bfloat16)}
                common = dict(out_features=R, in_features=K, tokens=T, threads=nt)
                fns, ms, errs, compile_s = dense_baselines(x, w, reps, use_compile)
                drows = dense_rows(ms, errs, common)
                for r in drows:
                    if r["compiled"]:
                        r["compile_s"] = round(compile_s, 2)
                rows += drows
                best = pick_best(ms)
                dense = {"fp32": fns["fp32"], best: fns[best]}
                print(
                    f"threads={nt} {R}x{K} T={T:<5} dense ms: "
                    + " ".join(f"{k}={v:.3f}" for k, v in ms.items())
                    + f" (best {best})",
                    flush=True,
                )
                for s in sparsities:
                    line = []
                    for name, dt, fn, ref_w in candidates(w, s, layouts, dtypes):
                        m = measure(fn, xs[dt], x, ref_w, dense, reps)
                        if "skip" in m:
                            print(f"  skip {name} in {dt}: {m['skip']}", file=sys.stderr)
                            continue
                        ok = m["max_rel_err"] <= REL_TOL[dt]
                        if not ok:
                            print(
                                f"  WARNING {name} {dt} s={s}: max_rel_err {m['max_rel_err']:.2e} above "
                                f"{REL_TOL[dt]:.0e}",
                                file=sys.stderr,
                            )
                        rows.append(
                            dict(
                                layout=name,
                                dtype=dt,
                                compiled=False,
                                **common,
                                sparsity=s,
                                **m,
                                rel_tol=REL_TOL[dt],
                                accurate=bool(ok),
                            )
                        )
                        line.append(
                            f"{name}/{dense_label(dt)}={m['ratio_vs_dense']:.2f}|{m['ratio_vs_best_dense']:.2f}"
                        )
                    print(f"threads={nt} {R}x{K} T={T:<5} s={s:<6} " + " ".join(line), flush=True)
    return rows


def summary(rows: List[dict]) -> str:
    """Pivot: 'vs dense fp32 | vs best dense' per layout/dtype and sparsity for each (shape, tokens, threads)."""
    lines = []
    keys = sorted({(r["threads"], r["out_features"], r["in_features"], -r["tokens"]) for r in rows})
    for nt, R, K, negT in keys:
        sub = [r for r in rows if (r["threads"], r["out_features"], r["in_features"], r["tokens"]) == (nt, R, K, -negT)]
        dense = [r for r in sub if r["layout"] == "dense"]
        sub = [r for r in sub if r["layout"] != "dense"]
        sps = sorted({r["sparsity"] for r in sub})
        lines.append(f"\n{R}x{K}, {-negT} tokens, {nt} thread(s): speed-up vs dense fp32 F.linear | vs the best dense")
        lines.append("dense ms: " + ", ".join(f"{dense_label(r['dtype'], r['compiled'])} {r['ms']:.3f}" for r in dense))
        lines.append(f"{'layout':<20}" + "".join(f"{s:>13}" for s in sps))
        for name, dt in dict.fromkeys((r["layout"], r["dtype"]) for r in sub):
            vals = {
                r["sparsity"]: f"{r['ratio_vs_dense']:.2f}|{r['ratio_vs_best_dense']:.2f}"
                for r in sub
                if (r["layout"], r["dtype"]) == (name, dt)
            }
            lines.append(f"{name + '/' + dt:<20}" + "".join(f"{vals.get(s, '-'):>13}" for s in sps))
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small subset (one shape, 1 thread, 3 sparsities)")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output JSON (default: $SPARSA_RESULTS_DIR or benchmarks/results/<cpu class>, file linear_kernels.json)",
    )
    ap.add_argument("--shapes", help="filter: comma-separated OUTxIN shapes, e.g. 768x3072")
    ap.add_argument("--tokens", help="filter: comma-separated token counts, e.g. 1024")
    ap.add_argument("--sparsities", help="filter: comma-separated sparsities, e.g. 0.75,0.9")
    ap.add_argument("--threads", help="filter: comma-separated thread counts, e.g. 1")
    ap.add_argument(
        "--layouts",
        help="filter: comma-separated sparsa layouts, e.g. row_group,grouped_nm "
        "(torch_csr/torch_bsr baselines always run)",
    )
    ap.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help="filter: dtypes of the sparse rows (default float32,bfloat16); the dense fp32, bf16 "
        "and compiled baselines always run",
    )
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile dense baseline")
    args = ap.parse_args(argv)
    compile_many_models()
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        raise SystemExit(f"--dtypes {args.dtypes!r}: use a comma-separated subset of {','.join(DTYPES)}")
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
    out = args.out or results_dir() / "linear_kernels.json"
    cpu = sparsa.cpu.cpu_info()
    t0 = time.perf_counter()
    rows = run(**grid, dtypes=dtypes, use_compile=not args.no_compile)
    meta = dict(
        torch=torch.__version__,
        python=platform.python_version(),
        machine=platform.machine(),
        processor=platform.processor(),
        quick=args.quick,
        seconds=round(time.perf_counter() - t0, 1),
        dtypes=dtypes,
        compile=not args.no_compile,
        timing="warm-up, then median of round-robin repetitions of dense fp32, the fastest dense baseline "
        "and the sparse candidate; ratio = dense time / sparse time",
        baseline="torch.nn.functional.linear (MKL/oneDNN) on the dense weight: fp32 eager, bf16 eager "
        "(input and weight in bfloat16), torch.compile of the faster of the two",
        accuracy="max_rel_err: max |y - y64| / max |y64|, y64 = float64 F.linear of the fp32 input and "
        "the fp32 weight the layout represents; rel_tol per dtype",
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu, "meta": meta, "rows": rows}, indent=1))
    print(summary(rows))
    print(f"\nwrote {out} ({len(rows)} rows, {meta['seconds']} s)")


if __name__ == "__main__":
    main()
