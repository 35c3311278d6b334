"""Render the benchmark JSON files under benchmarks/results/ into markdown tables.

Writes docs/benchmarks.md and refreshes the summary between the ``<!-- bench:start -->`` /
``<!-- bench:end -->`` markers of README.md, so the tables always come from the scripts' output.

    python benchmarks/tables.py
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _load(name: str) -> Optional[Dict[str, Any]]:
    p = RESULTS / f"{name}.json"
    return json.loads(p.read_text()) if p.is_file() else None


def _md(rows: List[Dict[str, Any]], cols: List[str], fmt: Optional[Dict[str, str]] = None) -> str:
    fmt = fmt or {}

    def cell(r: Dict[str, Any], c: str) -> str:
        v = r.get(c, "")
        if v is None or v == "":
            return "-"
        if c in fmt and isinstance(v, (int, float)):
            return format(v, fmt[c])
        return str(v)

    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(cell(r, c) for c in cols) + " |" for r in rows]
    return "\n".join(out)


def linear_section(summary: bool) -> str:
    d = _load("linear_kernels")
    if not d:
        return "_linear_kernels.json not found: run `python benchmarks/linear_kernels.py`._"
    rows = d["rows"] if isinstance(d, dict) else d
    sel = [r for r in rows if r.get("tokens") == 1024 and r.get("threads") == 1]
    if summary:
        best: Dict[tuple, Dict[str, Any]] = {}
        for r in sel:
            k = (r["out_features"], r["in_features"], r["sparsity"])
            if k not in best or r["ratio_vs_dense"] > best[k]["ratio_vs_dense"]:
                best[k] = r
        sel = sorted(best.values(), key=lambda r: (r["out_features"], r["in_features"], r["sparsity"]))
        return _md(sel, ["out_features", "in_features", "sparsity", "layout", "ratio_vs_dense"],
                   {"ratio_vs_dense": ".2f", "sparsity": ".3g"})
    sel = sorted(rows, key=lambda r: (r["layout"], r["out_features"], r["in_features"], r["tokens"], r["threads"],
                                      r["sparsity"]))
    return _md(sel, ["layout", "out_features", "in_features", "tokens", "threads", "sparsity", "ratio_vs_dense",
                     "max_abs_err"], {"ratio_vs_dense": ".2f", "max_abs_err": ".1e", "sparsity": ".3g"})


def bert_section() -> str:
    d = _load("bert_inference")
    if not d:
        return "_bert_inference.json not found: run `python benchmarks/bert_inference.py`._"
    s = _md(d["rows"], ["layout", "sparsity", "batch", "seq", "threads", "speedup_vs_dense",
                        "speedup_vs_compiled_dense", "max_rel_err"],
            {"speedup_vs_dense": ".2f", "speedup_vs_compiled_dense": ".2f", "max_rel_err": ".1e"})
    if d.get("quality"):
        s += "\n\nQuality next to speed (real pretrained MiniLM-L6, one-shot magnitude, held-out text):\n\n"
        s += _md(d["quality"], ["layout", "sparsity", "weight_norm_kept", "mean_cosine"],
                 {"weight_norm_kept": ".3f", "mean_cosine": ".3f"})
    return s + ("\n\n_(quick run)_" if d.get("quick") else "")


def adaptive_union_section() -> str:
    d = _load("adaptive_union")
    if not d:
        return "_adaptive_union.json not found: run `python benchmarks/adaptive_union.py`._"
    rows = []
    for r in d["rows"]:
        row = {"layer": r["layer"], "shape": "x".join(str(v) for v in r["shape"]), "O": r["out_channels"],
               "x_sparsity": r["activation_sparsity"], "dy_sparsity": r["grad_sparsity"],
               "union4_density": r.get("union4_density")}
        row.update({k[:-len("_vs_dense")]: v for k, v in r.items() if k.endswith("_vs_dense")})
        rows.append(row)
    cols = ["layer", "shape", "O", "x_sparsity", "dy_sparsity", "union4_density", "fwd_list", "fwd_union", "fwd_union2",
            "dx_list", "dx_union_dy", "dx_union_dy2", "dx_union_x", "dw_list", "dw_lists", "dw_union_x", "dw_union_dy"]
    fmt = {c: ".2f" for c in cols[3:]}
    return (f"Dense time / sparse time per GEMM ({d['config']['threads']} threads, batch {d['config']['batch']}, "
            f"{d['config']['data']}; real output gradients; union4_density: the fraction of (run of 4 pixels, "
            f"channel) pairs with a nonzero, i.e. what the union kernels still compute; fwd_union2 / "
            f"dx_union_dy2: the union kernels on 2-pixel groups; dx_union_x: the input gradient at relu(x)'s "
            f"nonzeros; dw_lists: the per-channel list weight gradient):\n\n" + _md(rows, cols, fmt))


def adaptive_section() -> str:
    d = _load("adaptive_training")
    if not d:
        return "_adaptive_training.json not found: run `python benchmarks/adaptive_training.py`._"
    parts = []
    ref = d.get("config", {}).get("dense_reference_ms")
    if ref:
        parts.append("Machine speed during the run (a fixed dense conv forward+backward, [32, 64, 32, 32] 64->64 3x3, "
                     "ms; a slow phase inflates the dense/sparse ratios measured in it): "
                     + ", ".join(f"{k} {v:.1f}" for k, v in ref.items()) + ".")
    if d.get("monitor"):
        m = d["monitor"]
        parts.append(f"Monitor: {m.get('speedup_vs_full_count', 0):.1f}x cheaper than a full count, "
                     f"{m.get('abs_error_pp', 0):.2f} pp largest absolute error over the layers "
                     f"({m.get('mean_abs_error_pp', 0):.2f} pp mean).")
    if d.get("models"):
        cols = ["model", "step_speedup_vs_dense", "loss_dense", "loss_adaptive"]
        rows = d["models"]
        if any("step_ms" in r for r in rows):  # both memory formats timed side by side
            rows = [dict(r, **r.get("step_ms", {}),
                         **{f"same_format_{k}": v for k, v in r.get("step_speedup_same_format", {}).items()})
                    for r in rows]
            cols = ["model", "step_speedup_vs_dense", "dense_format", "adaptive_format", "dense_nchw",
                    "dense_channels_last", "adaptive_nchw", "adaptive_channels_last", "same_format_nchw",
                    "same_format_channels_last", "loss_dense", "loss_adaptive"]
        if any("loss_dense_perturbed" in r for r in d["models"]):
            cols += ["loss_dense_perturbed", "loss_max_abs_diff", "loss_max_float_band"]
        fmts = {"step_speedup_vs_dense": ".2f", "loss_dense": ".4f", "loss_adaptive": ".4f",
                "loss_dense_perturbed": ".4f", "loss_max_abs_diff": ".4f", "loss_max_float_band": ".4f",
                "dense_nchw": ".0f", "dense_channels_last": ".0f", "adaptive_nchw": ".0f",
                "adaptive_channels_last": ".0f", "same_format_nchw": ".2f", "same_format_channels_last": ".2f"}
        parts.append(_md(rows, cols, fmts))
        if any("step_ms" in r for r in d["models"]):
            parts.append("step_speedup_vs_dense: the faster adaptive format's median training step against the faster "
                         "dense format's; dense_* / adaptive_*: median step ms in each format (all four trained side "
                         "by side, one step of each in turn); same_format_*: dense / adaptive within one format. "
                         "Losses: the channels-last pair.")
        parts.append("loss_dense_perturbed: the same dense training from weights moved by a relative 1e-7 "
                     "(rounding-sized); loss_max_abs_diff / loss_max_float_band: the largest per-step loss "
                     "difference of the adaptive run / of that control from dense. Losses can drift far beyond "
                     "rounding when a model sits on a plateau (VGG-16 without BatchNorm escapes it at a different "
                     "step in each run); the control shows how far rounding alone moves them.")
    if d.get("sweep"):
        cols = ["shape", "activation_sparsity", "dy", "grad_sparsity", "ratio_vs_dense"] \
            if any("dy" in r for r in d["sweep"]) else ["shape", "activation_sparsity", "ratio_vs_dense"]
        parts.append(_md(d["sweep"], cols, {"ratio_vs_dense": ".2f", "activation_sparsity": ".2f",
                                            "grad_sparsity": ".2f"}))
    if d.get("layers"):
        cols = ["model", "layer", "kind", "activation_sparsity", "path", "ratio_vs_dense"]
        if any(r.get("grad_sparsity") is not None for r in d["layers"]):
            cols[4:4] = ["grad_sparsity"]
            cols.append("sparse_kernel_ratio")
        if any("kappa" in r for r in d["layers"]):
            cols += ["model_speedup", "kappa", "measured_in_training"]
        parts.append(_md(d["layers"], cols, {"ratio_vs_dense": ".2f", "activation_sparsity": ".2f",
                                             "grad_sparsity": ".2f", "sparse_kernel_ratio": ".2f",
                                             "model_speedup": ".2f", "kappa": ".2f", "measured_in_training": ".2f"}))
        parts.append("ratio_vs_dense: forward+backward of the layer on the path the policy chose (1.0 where dense), "
                     "timed side by side after training; model_speedup: the cost model's prediction; kappa: the "
                     "correction from times measured in training (layers predicted below 1.3x; - when not "
                     "measured); measured_in_training: median dense over sparse time measured in training.")
    return "\n\n".join(parts)


def quality_section() -> str:
    d = _load("quality")
    if not d:
        return "_quality.json not found: run `python benchmarks/quality.py`._"
    parts = []
    if d.get("minilm"):
        parts.append(_md(d["minilm"], ["method", "pattern", "sparsity", "mean_cosine"],
                         {"mean_cosine": ".3f", "sparsity": ".3g"}))
    if d.get("digits"):
        parts.append(_md(d["digits"], ["model", "method", "sparsity", "accuracy", "dense_accuracy"],
                         {"accuracy": ".4f", "dense_accuracy": ".4f"}))
    return "\n\n".join(parts)


def dispatch_section() -> str:
    d = _load("dispatch_overhead")
    if not d:
        return "_dispatch_overhead.json not found._"
    return _md(d["rows"], ["mode", "direct_us", "dispatched_us", "overhead_us"])


def main() -> None:
    doc = f"""# Benchmarks

Every table below is generated by `python benchmarks/tables.py` from the JSON the benchmark
scripts write under `benchmarks/results/`. Ratios are measured side by side in one process (warm-up,
dense and sparse alternating, median of repetitions) on the development machine: 2 cores of an
AMD EPYC, fp32, which has AVX-512: sparsa's kernels pick their AVX-512 tiles at run time where the CPU
has them (AVX2 + FMA otherwise; `SPARSA_NO_AVX512=1` forces AVX2), and the dense baselines (oneDNN, MKL)
use AVX-512 too. Re-run a script to refresh
its table (`sparsa bench NAME` runs it from a source checkout).

## Sparse-weight Linear kernels (`python benchmarks/linear_kernels.py`)

Best layout per shape and sparsity, 1024 tokens, 1 thread (ratio = dense `F.linear` time / sparse time):

{linear_section(True)}

<details><summary>All rows</summary>

{linear_section(False)}

</details>

## BERT-base end to end (`python benchmarks/bert_inference.py`)

{bert_section()}

## Adaptive activation-sparse training (`python benchmarks/adaptive_training.py`)

{adaptive_section()}

### Sparse conv kernels GEMM by GEMM (`python benchmarks/adaptive_union.py`)

{adaptive_union_section()}

## Pruning quality (`python benchmarks/quality.py`)

{quality_section()}

## Dispatch overhead (`python benchmarks/dispatch_overhead.py`)

{dispatch_section()}
"""
    (ROOT / "docs" / "benchmarks.md").write_text(doc)
    readme = ROOT / "README.md"
    text = readme.read_text()
    start, end = "<!-- bench:start -->", "<!-- bench:end -->"
    if start in text and end in text:
        summary = (f"Per layer, best layout, 1024 tokens, 1 thread:\n\n{linear_section(True)}\n\n"
                   f"BERT-base end to end:\n\n{bert_section()}")
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        readme.write_text(f"{head}{start}\n{summary}\n{end}{tail}")
    print("wrote docs/benchmarks.md" + (" and README.md" if start in text else ""))


if __name__ == "__main__":
    main()
