"""Render the benchmark JSON files under benchmarks/results/<cpu class>/ into markdown tables.

Results are kept per CPU class (``sparsa.cpu.cpu_class()``, e.g. ``amd-avx2``; ``legacy-avx512`` holds
the results measured before the CPU was recorded). Each class gets its own section in
docs/benchmarks.md, headed with the CPU's model, class and ISA flags (from the ``cpu`` object the
scripts write into every JSON, or the class directory's ``cpu.json``). The summary between the
``<!-- bench:start -->`` / ``<!-- bench:end -->`` markers of README.md is refreshed too, each table
saying which CPU class it comes from, so the tables always come from the scripts' output.

    python benchmarks/tables.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
#: flags named in every CPU heading, present or not (the ones that decide the dense and sparse paths)
KEY_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
#: (JSON name, section title, command) in the order the sections appear
BENCHES = (
    ("linear_kernels", "Sparse-weight Linear kernels", "python benchmarks/linear_kernels.py"),
    ("bert_inference", "BERT-base end to end", "python benchmarks/bert_inference.py"),
    ("adaptive_training", "Adaptive activation-sparse training", "python benchmarks/adaptive_training.py"),
    ("adaptive_union", "Sparse conv kernels GEMM by GEMM", "python benchmarks/adaptive_union.py"),
    ("deepsparse_h2h", "Head to head with DeepSparse on the same weights", "make bench-deepsparse"),
    ("llm_decode", "Sparse LLM decoding (bitmask layout)", "python benchmarks/llm_decode.py"),
    ("bitmask_stream", "The bitmask decode kernel alone", "python benchmarks/bitmask_stream.py"),
    ("bitmask_prefill", "The bitmask strategies per layer", "python benchmarks/bitmask_prefill.py"),
    ("bf16_paths", "The bf16 dot-product kernel paths", "python benchmarks/bf16_paths.py"),
    ("row_group_mlp", "A BERT MLP as one row_group call", "python benchmarks/row_group_mlp.py"),
    ("adaptive_bf16", "bf16 activation-sparse convs per layer", "python benchmarks/adaptive_bf16.py"),
    ("adaptive_bf16_gemms", "bf16 activation-sparse convs GEMM by GEMM", "python benchmarks/adaptive_bf16_gemms.py"),
    ("activation_tiles", "Activation zeros at AMX-tile granularity", "python benchmarks/activation_tiles.py"),
    (
        "row_group_ab",
        "The bf16 row_group kernel before and after, one process",
        "python benchmarks/row_group_ab.py OLD",
    ),
    (
        "sliced_ell_ab",
        "The sliced_ell kernel before and after, one process",
        "python benchmarks/sliced_ell_ab.py OLD",
    ),
    ("llm_quality", "Pruned LLM perplexity", "python benchmarks/llm_quality.py"),
    ("quality", "Pruning quality", "python benchmarks/quality.py"),
    ("pareto", "Quality against speed: the MiniLM frontier", "python benchmarks/pareto.py"),
    ("recover", "Recovery to high sparsity on MiniLM", "python benchmarks/recover.py"),
    ("prune_defaults", "`sparsa prune` defaults against the frontier", "python benchmarks/prune_defaults.py"),
    ("allocation", "Per-layer sparsity allocation on MiniLM", "python benchmarks/allocation.py"),
    ("dispatch_overhead", "Dispatch overhead", "python benchmarks/dispatch_overhead.py"),
    ("relu_compact_ops", "Ops on the relu_compact layout", "python benchmarks/relu_compact_ops.py"),
)


def _load(d: Path, name: str) -> Optional[Dict[str, Any]]:
    p = d / f"{name}.json"
    return json.loads(p.read_text()) if p.is_file() else None


def class_dirs(root: Path = RESULTS) -> List[Path]:
    """The CPU-class directories under ``root`` that hold results: measured classes by name, legacy ones last."""
    if not root.is_dir():
        return []
    dirs = [d for d in root.iterdir() if d.is_dir() and any(d.glob("*.json"))]
    return sorted(dirs, key=lambda d: (d.name.startswith("legacy"), d.name))


def cpu_of(d: Path) -> Dict[str, Any]:
    """The CPU a class directory's results were measured on: the first ``cpu`` object in its JSON
    files, else its ``cpu.json``, else just the class name."""
    for p in sorted(d.glob("*.json")):
        if p.name == "cpu.json":
            continue
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("cpu"), dict):
            return data["cpu"]
    p = d / "cpu.json"
    return json.loads(p.read_text()) if p.is_file() else {"class": d.name}


def cpu_heading(cls: str, cpu: Dict[str, Any]) -> str:
    """One line naming the CPU class, model, cores, ISA flags and library versions."""
    flags = cpu.get("flags") or {}
    have = [f for f, v in flags.items() if v]
    lacks = [f for f in KEY_FLAGS if flags.get(f) is False]
    unknown = [f for f in KEY_FLAGS if f not in flags]
    parts = [f"CPU class `{cls}`: {cpu.get('model', 'model not recorded')}"]
    if cpu.get("cores"):
        parts[0] += f", {cpu['cores']} cores"
    parts.append(
        "flags: "
        + (", ".join(have) or "none recorded")
        + (f"; lacks {', '.join(lacks)}" if lacks else "")
        + (f"; not recorded: {', '.join(unknown)}" if unknown else "")
    )
    versions = [f"{k} {cpu[k]}" for k in ("torch", "onednn", "mkl") if cpu.get(k)]
    if versions:
        parts.append(", ".join(versions))
    if cpu.get("isa"):
        parts.append(f"sparsa kernel path {cpu['isa']}")
    if cpu.get("note"):
        parts.append(cpu["note"])
    return "; ".join(parts) + "."


def _quick_mark(d: Dict[str, Any]) -> str:
    """The line that marks a ``--quick`` run's table."""
    return "\n\n_(quick run)_" if d.get("quick") else ""


def _shape_rows(d: Dict[str, Any]) -> List[Dict[str, Any]]:
    """``d``'s rows with their ``shape`` list written as ``AxBx...``."""
    return [dict(r, shape="x".join(str(v) for v in r.get("shape", []))) for r in d["rows"]]


def _md(
    rows: List[Dict[str, Any]], cols: List[str], fmt: Optional[Dict[str, str]] = None, drop_empty: bool = True
) -> str:
    """A markdown table; columns no row has are left out (old and new results differ in columns)."""
    fmt = fmt or {}
    if drop_empty:
        cols = [c for c in cols if any(r.get(c) not in (None, "") for r in rows)]

    def cell(r: Dict[str, Any], c: str) -> str:
        v = r.get(c, "")
        if v is None or v == "":
            return "-"
        if c in fmt and isinstance(v, (int, float)) and not isinstance(v, bool):
            return format(v, fmt[c])
        return str(v)

    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(cell(r, c) for c in cols) + " |" for r in rows]
    return "\n".join(out)


def _ratio(r: Dict[str, Any], name: str = "ratio") -> float:
    """The ratio a row is ranked by: against the best dense path when recorded, else against dense fp32."""
    v = r.get(f"{name}_vs_best_dense")
    return float(v if v is not None else r[f"{name}_vs_dense"])


def _pick(rows: List[Dict[str, Any]], key: str, want: Any, choose) -> Any:
    have = {r[key] for r in rows if key in r}
    return want if want in have or not have else choose(have)


def linear_view(rows: List[Dict[str, Any]]) -> Tuple[int, int]:
    """(tokens, threads) of the summary table: 1024 tokens / 1 thread when measured, else the most
    tokens / fewest threads that were."""
    return _pick(rows, "tokens", 1024, max), _pick(rows, "threads", 1, min)


def best_per_point(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The fastest sparse row per (out_features, in_features, sparsity), ranked by ratio_vs_best_dense
    (ratio_vs_dense for results that predate it); dense baseline rows are left out."""
    best: Dict[tuple, Dict[str, Any]] = {}
    for r in rows:
        if r.get("layout") == "dense":
            continue
        k = (r["out_features"], r["in_features"], r["sparsity"])
        if k not in best or _ratio(r) > _ratio(best[k]):
            best[k] = r
    return sorted(best.values(), key=lambda r: (r["out_features"], r["in_features"], r["sparsity"]))


LIN_FMT = {
    "ratio_vs_dense": ".2f",
    "ratio_vs_best_dense": ".2f",
    "max_abs_err": ".1e",
    "max_rel_err": ".1e",
    "sparsity": ".3g",
    "ms": ".3f",
}


def linear_section(d: Dict[str, Any], summary: bool) -> str:
    rows = d["rows"] if isinstance(d, dict) else d
    T, nt = linear_view(rows)
    sel = [r for r in rows if r.get("tokens") == T and r.get("threads") == nt]
    dense = [r for r in sel if r.get("layout") == "dense"]
    if summary:
        best_cols = any("ratio_vs_best_dense" in r for r in sel)
        head = (
            f"Best layout per shape and sparsity, {T} tokens, {nt} thread{'s' if nt > 1 else ''} "
            "(ratio = dense time / sparse time; ratio_vs_dense: against dense fp32 `F.linear`"
            + (
                ", ratio_vs_best_dense: against the fastest of dense fp32, bf16 and torch.compile, best_dense "
                "says which"
                if best_cols
                else ""
            )
            + "):\n\n"
        )
        s = head + _md(
            best_per_point(sel),
            [
                "out_features",
                "in_features",
                "sparsity",
                "layout",
                "dtype",
                "ratio_vs_dense",
                "ratio_vs_best_dense",
                "best_dense",
            ],
            LIN_FMT,
        )
        if dense:
            s += (
                "\n\nDense baselines (ms): "
                + "; ".join(
                    f"{R}x{K}: "
                    + ", ".join(
                        f"{_dense_name(r)} {r['ms']:.3f}"
                        for r in dense
                        if (r["out_features"], r["in_features"]) == (R, K)
                    )
                    for R, K in dict.fromkeys((r["out_features"], r["in_features"]) for r in dense)
                )
                + "."
            )
        return s + ("\n\n_(quick run)_" if d.get("meta", {}).get("quick") else "")
    dense_all = sorted(
        (r for r in rows if r.get("layout") == "dense"),
        key=lambda r: (r["out_features"], r["in_features"], r["tokens"], r["threads"]),
    )
    sparse = sorted(
        (r for r in rows if r.get("layout") != "dense"),
        key=lambda r: (
            r["layout"],
            r.get("dtype", ""),
            r["out_features"],
            r["in_features"],
            r["tokens"],
            r["threads"],
            r["sparsity"],
        ),
    )
    parts = []
    if dense_all:
        parts.append(
            "Dense baselines (ratio_vs_dense: dense fp32 eager time / this one's):\n\n"
            + _md(
                [dict(r, baseline=_dense_name(r)) for r in dense_all],
                [
                    "out_features",
                    "in_features",
                    "tokens",
                    "threads",
                    "baseline",
                    "ms",
                    "ratio_vs_dense",
                    "max_rel_err",
                    "compile_s",
                ],
                LIN_FMT,
            )
        )
    parts.append(
        _md(
            sparse,
            [
                "layout",
                "dtype",
                "out_features",
                "in_features",
                "tokens",
                "threads",
                "sparsity",
                "ratio_vs_dense",
                "ratio_vs_best_dense",
                "best_dense",
                "max_abs_err",
                "max_rel_err",
            ],
            LIN_FMT,
        )
    )
    return "\n\n".join(parts)


def _dense_name(r: Dict[str, Any]) -> str:
    short = {"float32": "fp32", "bfloat16": "bf16"}.get(r.get("dtype", "float32"), r.get("dtype"))
    return ("compiled_" if r.get("compiled") else "") + short


BERT_FMT = {
    "speedup_vs_dense": ".2f",
    "speedup_vs_compiled_dense": ".2f",
    "speedup_vs_best_dense": ".2f",
    "speedup_vs_eager_sparse": ".2f",
    "max_rel_err": ".1e",
    "ms": ".1f",
}


def bert_section(d: Dict[str, Any], batches: Optional[Sequence[int]] = None, quality: bool = True) -> str:
    """Speed rows (``batches``: only those), the dense baselines, then the quality rows."""
    rows = [r for r in d["rows"] if batches is None or r.get("batch") in batches]
    dense = [dict(r, baseline=_dense_name(r)) for r in rows if r.get("layout") == "dense"]
    sparse = [r for r in rows if r.get("layout") != "dense"]
    model = d.get("model", "")
    s = f"Model: {model}.\n\n" if model and not model.startswith("BertModel(BertConfig())") else ""
    s += (
        "speedup_vs_dense: dense fp32 eager time / sparse time; speedup_vs_best_dense: the fastest of dense fp32, "
        "bf16 and torch.compile (best_dense) / sparse time; max_rel_err against the same pruned weights run "
        "densely in fp32.\n\n"
        if any("speedup_vs_best_dense" in r for r in sparse)
        else ""
    )
    if any(r.get("fused") for r in sparse):
        s += (
            "fused: GELU in the sparse kernels' epilogue (`sparsa.fuse_gelu`), and in rows with fused_qkv "
            "query, key and value as one product (`sparsa.fuse_projections`; runs before it have no fused_qkv "
            "field), in rows with fused_mlp the MLP's two row_group products as one call (`sparsa.fuse_mlp`; runs "
            "before it have no fused_mlp field); compiled: `torch.compile` of the "
            "fused model (in runs before `fdd728a` its graph ran the GELU as a separate op: the fused module could "
            "not read the weight's layout under compile; in runs before `9ee8505` a full run's models past "
            "Dynamo's eighth compiled entry ran eagerly, so its later compiled rows time eager code); "
            "speedup_vs_eager_sparse: the same sparse model run eagerly and unfused / this row.\n\n"
        )
    s += _md(
        sparse,
        [
            "layout",
            "dtype",
            "fused",
            "fused_qkv",
            "fused_mlp",
            "compiled",
            "sparsity",
            "batch",
            "seq",
            "threads",
            "speedup_vs_dense",
            "speedup_vs_compiled_dense",
            "speedup_vs_best_dense",
            "best_dense",
            "speedup_vs_eager_sparse",
            "max_rel_err",
        ],
        BERT_FMT,
    )
    if dense:
        s += "\n\nDense baselines:\n\n" + _md(
            dense,
            ["baseline", "batch", "seq", "threads", "ms", "speedup_vs_dense", "max_rel_err", "compile_s"],
            BERT_FMT,
        )
    if quality and d.get("quality"):
        s += "\n\nQuality next to speed (real pretrained MiniLM-L6, one-shot magnitude, held-out text):\n\n"
        s += _md(
            d["quality"],
            ["layout", "sparsity", "weight_norm_kept", "mean_cosine"],
            {"weight_norm_kept": ".3f", "mean_cosine": ".3f"},
        )
    return s + _quick_mark(d)


H2H_FMT = {
    "median_ms": ".1f",
    "speedup_vs_fp32_eager": ".2f",
    "speedup_vs_best_dense": ".2f",
    "vs_deepsparse": ".2f",
    "max_rel_err": ".1e",
}


def h2h_section(d: Dict[str, Any]) -> str:
    """Every engine on the same pruned BERT-base weights, with each engine's speed relative to DeepSparse."""
    ds = {(r["sparsity"], r["batch"]): r["median_ms"] for r in d["rows"] if r["engine"] == "deepsparse"}
    rows = [
        dict(r, vs_deepsparse=ds[(r["sparsity"], r["batch"])] / r["median_ms"])
        if (r["sparsity"], r["batch"]) in ds
        else dict(r)
        for r in d["rows"]
    ]
    st = d.get("deepsparse") or {}
    s = (
        f"{d.get('model', '')}; {d.get('pruning', '')}; {d.get('timing', '')}. DeepSparse "
        f"{st.get('version', '?')}: {st.get('status', '?')}. vs_deepsparse: DeepSparse time / this engine's time "
        "(above 1: faster than DeepSparse). `_compiled` engines of runs before `9ee8505` past Dynamo's eighth "
        "compiled entry (the 90% ones) ran eagerly.\n\n"
    )
    return s + _md(
        rows,
        [
            "engine",
            "sparsity",
            "batch",
            "seq",
            "threads",
            "median_ms",
            "speedup_vs_fp32_eager",
            "speedup_vs_best_dense",
            "vs_deepsparse",
            "max_rel_err",
        ],
        H2H_FMT,
    )


def adaptive_union_section(d: Dict[str, Any]) -> str:
    rows = []
    for r in d["rows"]:
        row = {
            "layer": r["layer"],
            "shape": "x".join(str(v) for v in r["shape"]),
            "O": r["out_channels"],
            "x_sparsity": r["activation_sparsity"],
            "dy_sparsity": r["grad_sparsity"],
            "union4_density": r.get("union4_density"),
        }
        row.update({k[: -len("_vs_dense")]: v for k, v in r.items() if k.endswith("_vs_dense")})
        rows.append(row)
    cols = [
        "layer",
        "shape",
        "O",
        "x_sparsity",
        "dy_sparsity",
        "union4_density",
        "fwd_list",
        "fwd_union",
        "fwd_union2",
        "dx_list",
        "dx_union_dy",
        "dx_union_dy2",
        "dx_union_x",
        "dw_list",
        "dw_lists",
        "dw_union_x",
        "dw_union_dy",
    ]
    fmt = {c: ".2f" for c in cols[3:]}
    return (
        f"Dense time / sparse time per GEMM ({d['config']['threads']} threads, batch {d['config']['batch']}, "
        f"{d['config']['data']}; real output gradients; union4_density: the fraction of (run of 4 pixels, "
        f"channel) pairs with a nonzero, i.e. what the union kernels still compute; fwd_union2 / "
        f"dx_union_dy2: the union kernels on 2-pixel groups; dx_union_x: the input gradient at relu(x)'s "
        f"nonzeros; dw_lists: the per-channel list weight gradient):\n\n"
        + _md(rows, cols, fmt)
        + (
            f"\n\nDense side: {d['baseline']}. These are the float32 kernels; where the CPU has bf16 hardware "
            "the fastest dense path is bf16 (`adaptive_bf16.py` times the bf16 kernels against it)."
            if d.get("baseline")
            else ""
        )
    )


def adaptive_section(d: Dict[str, Any]) -> str:
    parts = []
    ref = d.get("config", {}).get("dense_reference_ms")
    if ref:
        parts.append(
            "Machine speed during the run (a fixed dense conv forward+backward, [32, 64, 32, 32] 64->64 3x3, "
            "ms; a slow phase inflates the dense/sparse ratios measured in it): "
            + ", ".join(f"{k} {v:.1f}" for k, v in ref.items())
            + "."
        )
    if d.get("monitor"):
        m = d["monitor"]
        parts.append(
            f"Monitor: {m.get('speedup_vs_full_count', 0):.1f}x cheaper than a full count, "
            f"{m.get('abs_error_pp', 0):.2f} pp largest absolute error over the layers "
            f"({m.get('mean_abs_error_pp', 0):.2f} pp mean)."
        )
    if d.get("models"):
        cols = ["model", "step_speedup_vs_dense", "loss_dense", "loss_adaptive"]
        rows = d["models"]
        if any("step_ms" in r for r in rows):  # both memory formats timed side by side
            rows = [
                dict(
                    r,
                    **r.get("step_ms", {}),
                    **{f"same_format_{k}": v for k, v in r.get("step_speedup_same_format", {}).items()},
                )
                for r in rows
            ]
            cols = [
                "model",
                "step_speedup_vs_dense",
                "dense_format",
                "adaptive_format",
                "dense_nchw",
                "dense_channels_last",
                "adaptive_nchw",
                "adaptive_channels_last",
                "same_format_nchw",
                "same_format_channels_last",
                "loss_dense",
                "loss_adaptive",
            ]
        if any("step_speedup_vs_best_dense" in r for r in d["models"]):
            rows = [dict(r, guard_verdict=(r.get("guard") or {}).get("decision") or "-") for r in rows]
            cols[1:1] = ["dtype", "step_speedup_vs_best_dense", "best_dense"]
            cols.insert(cols.index("loss_dense"), "guard_verdict")
        if any("loss_dense_perturbed" in r for r in d["models"]):
            cols += ["loss_dense_perturbed", "loss_max_abs_diff", "loss_max_float_band"]
        fmts = {
            "step_speedup_vs_dense": ".2f",
            "step_speedup_vs_best_dense": ".2f",
            "loss_dense": ".4f",
            "loss_adaptive": ".4f",
            "loss_dense_perturbed": ".4f",
            "loss_max_abs_diff": ".4f",
            "loss_max_float_band": ".4f",
            "dense_nchw": ".0f",
            "dense_channels_last": ".0f",
            "adaptive_nchw": ".0f",
            "adaptive_channels_last": ".0f",
            "same_format_nchw": ".2f",
            "same_format_channels_last": ".2f",
        }
        parts.append(_md(rows, cols, fmts))
        if any("step_ms" in r for r in d["models"]):
            parts.append(
                "step_speedup_vs_dense: the faster adaptive format's median training step against the faster "
                "dense format's; dense_* / adaptive_*: median step ms in each format (all four trained side "
                "by side, one step of each in turn); same_format_*: dense / adaptive within one format. "
                "Losses: the channels-last pair."
            )
        if any("step_speedup_vs_best_dense" in r for r in d["models"]):
            parts.append(
                "step_speedup_vs_best_dense: the same adaptive step against the fastest dense step of either "
                "format in fp32 or bf16 autocast (best_dense names it; the dtype not trained in the row is "
                "timed for a few steps on the same batches); guard_verdict: the step guard's last verdict "
                "(it times whole steps, here interleaved with the other trainings of the round, so its "
                "ratio is diluted; - when it had not compared yet)."
            )
        parts.append(
            "loss_dense_perturbed: the same dense training from weights moved by a relative 1e-7 "
            "(rounding-sized); loss_max_abs_diff / loss_max_float_band: the largest per-step loss "
            "difference of the adaptive run / of that control from dense. Losses can drift far beyond "
            "rounding when a model sits on a plateau (VGG-16 without BatchNorm escapes it at a different "
            "step in each run); the control shows how far rounding alone moves them."
        )
    if d.get("sweep"):
        cols = (
            ["shape", "activation_sparsity", "dy", "grad_sparsity", "ratio_vs_dense"]
            if any("dy" in r for r in d["sweep"])
            else ["shape", "activation_sparsity", "ratio_vs_dense"]
        )
        parts.append(
            _md(d["sweep"], cols, {"ratio_vs_dense": ".2f", "activation_sparsity": ".2f", "grad_sparsity": ".2f"})
        )
    if d.get("layers"):
        cols = ["model", "layer", "kind", "activation_sparsity", "path", "ratio_vs_dense"]
        if any(r.get("grad_sparsity") is not None for r in d["layers"]):
            cols[4:4] = ["grad_sparsity"]
            cols.append("sparse_kernel_ratio")
        if any("kappa" in r for r in d["layers"]):
            cols += ["model_speedup", "kappa", "measured_in_training"]
        parts.append(
            _md(
                d["layers"],
                cols,
                {
                    "ratio_vs_dense": ".2f",
                    "activation_sparsity": ".2f",
                    "grad_sparsity": ".2f",
                    "sparse_kernel_ratio": ".2f",
                    "model_speedup": ".2f",
                    "kappa": ".2f",
                    "measured_in_training": ".2f",
                },
            )
        )
        parts.append(
            "ratio_vs_dense: forward+backward of the layer on the path the policy chose (1.0 where dense), "
            "timed side by side after training; model_speedup: the cost model's prediction; kappa: the "
            "correction from times measured in training (layers predicted below 1.3x; - when not "
            "measured); measured_in_training: median dense over sparse time measured in training."
        )
    return "\n\n".join(parts)


def quality_section(d: Dict[str, Any]) -> str:
    parts = []
    if d.get("minilm"):
        parts.append(
            _md(
                d["minilm"], ["method", "pattern", "sparsity", "mean_cosine"], {"mean_cosine": ".3f", "sparsity": ".3g"}
            )
        )
    if d.get("digits"):
        parts.append(
            _md(
                d["digits"],
                ["model", "method", "sparsity", "accuracy", "dense_accuracy"],
                {"accuracy": ".4f", "dense_accuracy": ".4f"},
            )
        )
    return "\n\n".join(parts)


PARETO_FMT = {
    "sparsity": ".2f",
    "quality_cosine": ".3f",
    "cosine_docstrings": ".3f",
    "cosine_readme": ".3f",
    "quality_top1": ".3f",
    "speedup_vs_best_dense": ".2f",
    "speedup_vs_dense": ".2f",
}
PARETO_COLS = [
    "method",
    "label",
    "sparsity",
    "quality_cosine",
    "cosine_docstrings",
    "cosine_readme",
    "quality_top1",
    "speedup_vs_best_dense",
    "best_dense",
    "layout",
    "sparse_dtype",
    "sparse_path",
]


def _pareto_rows(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Rows sorted by speed, the method column saying ``+recover`` for recovered rows."""
    return [
        dict(
            r,
            method=r["method"] + ("+recover" if r.get("recovered") else ""),
            label="unstructured" if r.get("pattern") == "unstructured" else r.get("label", r.get("layout")),
            sparse_dtype=r.get("sparse_dtype", "float32"),  # runs before it was recorded timed float32 only
            sparse_path=r.get("sparse_path", "eager"),  # and eagerly only
        )
        for r in sorted(rows, key=lambda r: (-r["speedup_vs_best_dense"], -r["quality_cosine"]))
    ]


def pareto_section(d: Dict[str, Any], frontier_only: bool = False) -> str:
    """The frontier of the MiniLM quality-speed grid (and, unless ``frontier_only``, every row)."""
    rows = d.get("rows", [])
    front = [r for r in rows if r.get("on_frontier")]
    s = (
        f"all-MiniLM-L6-v2, every block Linear pruned; speed: batch {d.get('batch', 8)}, seq {d.get('seq', 128)}, "
        f"{d.get('threads')} threads, against the fastest dense path of the run ({d.get('best_dense', '-')}: "
        + ", ".join(f"{k} {v} ms" for k, v in (d.get("dense_ms") or {}).items())
        + "); quality: mean cosine to the "
        "dense sentence embeddings (and top-1 nearest-neighbour agreement) on held-out stdlib docstrings and "
        "README prose, averaged. label: the pattern; layout: the one it ran fastest in (an unstructured mask is "
        "timed in sliced_ell and bitmask since the runs that record sparse_path, sliced_ell only before); "
        "sparse_dtype / sparse_path: its fastest way to run (float32 or bfloat16; eager, GELU fused into the "
        "kernels, or torch.compile of that; quality is measured in float32). The frontier: rows no other row "
        "(nor the best dense path) beats in both speed and cosine.\n\n"
    )
    s += _md(_pareto_rows(front), PARETO_COLS, PARETO_FMT)
    if not frontier_only:
        s += (
            "\n\n<details><summary>All rows</summary>\n\n"
            + _md(_pareto_rows(rows), PARETO_COLS, PARETO_FMT)
            + "\n\n</details>"
        )
        if d.get("skipped"):
            reasons = "; ".join(sorted({x["reason"] for x in d["skipped"]}))
            s += f"\n\nSkipped: {len(d['skipped'])} rows ({reasons})."
    run = f"`{d['command']}`, " if d.get("command") else ""
    quick = "quick run, " if d.get("quick") else ""
    return s + f"\n\n_({run}{quick}{d.get('seconds')} s)_"


LLM_FMT = {
    "ms": ".1f",
    "tokens_per_s": ".1f",
    "speedup_vs_dense": ".2f",
    "speedup_vs_best_dense": ".2f",
    "speedup_vs_best_dense_same_dtype": ".2f",
    "weight_bytes_ratio": ".3f",
}


def llm_decode_section(d: Dict[str, Any]) -> str:
    """Decode (ms per step) and prefill (ms per prompt) of each engine, per model, dtype and batch."""
    rows = [dict(r, engine=(f"{r['layout']} {r['sparsity']}" if r.get("sparsity") else r["layout"])) for r in d["rows"]]
    s = (
        f"Random-initialised Llama configs, prompt {d.get('prompt')} tokens, {d.get('threads')} threads; decode: "
        f"ms per step of one token per sequence on the prompt's KV cache ({d.get('decode_steps_per_round')} steps a "
        "round), prefill: ms for the prompt up to the next token's logits (as generate() runs it). "
        "speedup_vs_dense: dense eager in the same dtype / this engine; "
        "speedup_vs_best_dense: the fastest dense path timed beside it, in any dtype, eager or compiled "
        "(best_dense names it) / this engine; same_dtype: the faster of dense eager and compiled in the row's "
        "dtype / this engine. weight_bytes_ratio: bytes of the decoder blocks' linear weights against dense. "
        f"Peak RSS {d.get('peak_rss_mb')} MB."
        + (f" Compiled engines: {d['compiled']}." if d.get("compiled") else "")
        + "\n\n"
    )
    s += _md(
        rows,
        [
            "model",
            "dtype",
            "batch",
            "phase",
            "engine",
            "ms",
            "tokens_per_s",
            "speedup_vs_dense",
            "speedup_vs_best_dense",
            "best_dense",
            "speedup_vs_best_dense_same_dtype",
            "weight_bytes_ratio",
        ],
        LLM_FMT,
    )
    if d.get("notes"):
        s += "\n\nNotes: " + "; ".join(f"{k}: {v}" for k, v in d["notes"].items())
    return s + _quick_mark(d)


def bitmask_stream_section(d: Dict[str, Any]) -> str:
    """The stream kernel over a decoder's block linears against dense F.linear, per dtype, sparsity and tokens."""
    r0 = d["rows"][0] if d["rows"] else {}
    head = (
        f"Every block linear of {r0.get('model')} ({r0.get('layers')} layers) times 1-4 tokens, one after another, "
        f"the `stream` kernel (loop `{d.get('stream_path')}`) against dense `F.linear` in the same dtype "
        "(dense_ms, speedup_vs_dense) and in every dtype (best_dense: the fastest; speedup_vs_best_dense), "
        f"round-robin ({d.get('rounds')} rounds, medians), {d.get('threads')} threads: no model, attention or "
        "dispatch. GB/s: bytes of the weights read per second.\n\n"
    )
    cols = ["dtype", "sparsity", "tokens", "stream_ms", "dense_ms", "speedup_vs_dense", "best_dense"]
    cols += ["speedup_vs_best_dense"]
    cols += ["stream_gb_per_s", "dense_gb_per_s", "weight_bytes_ratio", "max_rel_err"]
    return head + _md(d["rows"], cols, {"max_rel_err": ".1e"}) + _quick_mark(d)


def bitmask_prefill_section(d: Dict[str, Any]) -> str:
    """Each bitmask strategy on one weight against dense ``F.linear`` in the same dtype, and the one chosen."""
    t = d.get("thresholds") or {}
    head = (
        f"Each strategy of `sparsa::bitmask_linear` on one weight (the weight in cache), {d.get('threads')} "
        "threads, side by side with dense `F.linear` in the same dtype (`<strategy>_vs_dense`); auto: the "
        "strategy `choose_strategy` picks, against the faster dense dtype (auto_vs_best_dense). Thresholds: "
        + ", ".join(f"{k} {v}" for k, v in t.items())
        + ".\n\n"
    )
    rows = _shape_rows(d)
    cols = ["model", "shape", "dtype", "sparsity", "tokens", "dense_ms", "stream_vs_dense"]
    cols += ["expand_blocks_vs_dense", "expand_whole_vs_dense", "panel_vs_dense", "amx_vs_dense", "auto_strategy"]
    cols += ["best_dense", "auto_vs_best_dense"]
    return head + _md(rows, cols) + _quick_mark(d)


def row_group_mlp_section(d: Dict[str, Any]) -> str:
    """The fused MLP op against its two products and the dense MLP."""
    head = (
        "`sparsa::row_group_mlp_kernel` (fused: one call; fused_path `native` where the AMX one-call path ran) "
        "against the two `row_group_linear` products it replaces and the dense MLP (`F.linear`, `F.gelu`, "
        f"`F.linear`) in fp32 and bf16 eager and compiled bf16, bf16 weights in groups of 16, {d.get('threads')} "
        f"threads, {d.get('timing', 'round robin, medians')}.\n\n"
    )
    cols = ["model", "shape", "sparsity", "tokens", "fused_ms", "two_products_ms", "dense_bfloat16_ms"]
    cols += ["dense_compiled_bfloat16_ms", "dense_float32_ms", "best_dense", "fused_vs_two_products"]
    cols += ["fused_vs_best_dense", "two_products_vs_best_dense", "fused_path", "max_rel_err"]
    return head + _md(d["rows"], cols) + _quick_mark(d)


def bf16_paths_section(d: Dict[str, Any]) -> str:
    """The bf16 dot-product paths against the path below them and against the faster dense dtype."""
    head = (
        "Each bf16 kernel path (path: VDPBF16PS, AMX tiles, or sliced_ell_fma's 16-float FMAs; dp_ms) "
        "beside the path below it "
        f"(below_path, below_ms) and dense bf16 and fp32 `F.linear`, {d.get('threads')} thread(s), one process; "
        "speedup_vs_best_dense: the faster dense dtype / the dp path.\n\n"
    )
    cols = ["kernel"] + (["path"] if any("path" in r for r in d["rows"]) else [])
    cols += ["out_features", "in_features", "tokens", "sparsity", "dp_ms", "below_path", "below_ms"]
    cols += ["dense_bf16_ms", "dense_fp32_ms", "speedup_vs_below", "speedup_vs_best_dense"]
    return head + _md(d["rows"], cols) + _quick_mark(d)


def adaptive_bf16_section(d: Dict[str, Any]) -> str:
    """Fwd+bwd of conv2d(relu(x), W) with the bf16 and fp32 activation-sparse kernels against dense."""
    head = (
        "Forward and backward of `conv2d(relu(x), W)` (3x3, batch 32, clustered zeros) under bf16 autocast: "
        "the bf16 activation-sparse kernels and the fp32 kernels on the widened operands, against dense bf16 "
        "autocast and dense fp32 in both memory formats (best_dense: the fastest); dy: the output gradient, dense "
        "or as behind a 2x2 max-pool (one pixel per window); each call on a new weight version.\n\n"
    )
    rows = _shape_rows(d)
    cols = ["shape", "sparsity"] + (["dy"] if any("dy" in r for r in rows) else [])
    cols += ["threads", "bf16_kernels_ms", "fp32_kernels_ms", "dense_bf16_nchw_ms"]
    cols += ["dense_bf16_cl_ms", "dense_fp32_nchw_ms", "dense_fp32_cl_ms", "best_dense"]
    cols += ["speedup_vs_best_dense", "speedup_fp32_kernels_vs_best_dense"]
    return head + _md(rows, cols) + _quick_mark(d)


def adaptive_bf16_gemms_section(d: Dict[str, Any]) -> str:
    """Each GEMM of the bf16 activation-sparse conv against dense bf16, with the pair densities that bound it."""
    head = (
        "Each GEMM of `conv2d(relu(x), W)` (3x3, batch 32, clustered zeros) on the bf16 sparse kernels against "
        "dense bf16 (channels-last): best_fwd / best_dx / best_dw name the fastest sparse way of each, *_vs_dense "
        "its speed-up; x_pair_gK / dy_pair_gK: the fraction of (K-pixel group, channel pair) with a nonzero, the "
        "work of a `VDPBF16PS` union kernel on K-pixel groups relative to dense; speedup_best_sparse_vs_dense: "
        "dense fwd + dx + dw over the fastest sparse ways plus the operand and the weight packs.\n\n"
    )
    rows = _shape_rows(d)
    cols = ["shape", "sparsity", "dy", "threads", "x_elem", "x_pair_g1", "x_pair_g2", "x_pair_g4", "dy_pair_g1"]
    cols += ["dy_pair_g2", "best_fwd", "fwd_vs_dense", "best_dx", "dx_vs_dense", "best_dw", "dw_vs_dense"]
    cols += ["speedup_best_sparse_vs_dense"]
    return head + _md(rows, cols) + _quick_mark(d)


def activation_tiles_section(d: Dict[str, Any]) -> str:
    """Per conv of the training nets: the nonzero fractions an AMX-tiled activation-sparse kernel would face."""
    head = (
        f"{d.get('method', '')}. x: the conv's input (relu(x)), dy: its output gradient; *_density: nonzero "
        "fraction; *_union16_pixels / *_union16_channels: the fraction of (16 consecutive pixels, channel) / "
        "(pixel, 16 consecutive channels) holding a nonzero; work_bound_fwd / _dx / _dw: the smallest such "
        "fraction for each GEMM, the dense work an AMX kernel that gathers at tile granularity still does. "
        "Nothing is timed.\n\n"
    )
    cols = ["model", "layer", "shape", "x_density", "x_union16_pixels", "dy_density", "dy_union16_pixels"]
    cols += ["dy_union16_channels", "work_bound_fwd", "work_bound_dx", "work_bound_dw"]
    return head + _md(d["rows"], cols)


def row_group_ab_section(d: Dict[str, Any]) -> str:
    """An older commit's bf16 row_group kernel against the tree's, with dense bf16, timed in one process."""
    old, new = str(d.get("old", ""))[:12], str(d.get("new", ""))[:12]
    head = (
        f"The bf16 row_group kernel of `{old}` (old_ms) against `{new}` (new_ms) and "
        "dense bf16 `F.linear` (dense_bf16_ms), round-robin in one process: new_over_old = old / new time; "
        "*_vs_dense = dense time / kernel time; max_abs_diff between the two kernels' outputs.\n\n"
    )
    cols = ["out_features", "in_features", "tokens", "sparsity", "group", "threads", "old_ms", "new_ms"]
    cols += ["dense_bf16_ms", "new_over_old", "old_vs_dense", "new_vs_dense", "max_abs_diff"]
    return head + _md(d["rows"], cols) + _quick_mark(d)


def sliced_ell_ab_section(d: Dict[str, Any]) -> str:
    """An older commit's sliced_ell kernel against the tree's, fp32 and bf16, with dense bf16, in one process."""
    old, new = str(d.get("old", ""))[:12], str(d.get("new", ""))[:12]
    head = (
        f"The sliced_ell kernel of `{old}` (old_ms) against `{new}` (new_ms) and dense bf16 `F.linear` "
        "(dense_bf16_ms) on row-balanced magnitude-pruned weights, round-robin in one process; rows: the bf16 "
        "rows both kernels ran (fp32: the FMA rows). new_over_old = old / new time; *_vs_dense = dense time / "
        "kernel time; max_abs_diff between the two kernels' outputs.\n\n"
    )
    cols = ["out_features", "in_features", "tokens", "sparsity", "dtype", "rows", "threads", "old_ms", "new_ms"]
    cols += ["dense_bf16_ms", "new_over_old", "old_vs_dense", "new_vs_dense", "max_abs_diff"]
    return head + _md(d["rows"], cols) + _quick_mark(d)


def prune_defaults_section(d: Dict[str, Any]) -> str:
    """`sparsa prune` run with nothing but method, pattern and sparsity, against the frontier's figure."""
    dom = ", ".join(f"{n} {k}" for k, n in (d.get("domains") or {}).items())
    head = (
        f"{d.get('model', 'MiniLM')}: `sparsa prune MODEL -o OUT --method M --pattern P --sparsity S` (every other "
        f"setting its default), then the mean embedding cosine to the dense model on `{d.get('pareto')}`'s held-out "
        f"text ({dom} sentences). pareto_cosine: the frontier's one-shot figure for the same method, pattern and "
        f"sparsity; gap: that minus this run's; within_0_02: gap <= {d.get('tolerance')}; "
        "pareto_recovered_cosine: the frontier's recovered figure (the CLI recovers only with `--recover`).\n\n"
    )
    cols = ["method", "pattern", "sparsity", "layout", "quality_cosine", "cosine_docstrings", "cosine_readme"]
    cols += ["quality_top1", "pareto_cosine", "gap", "within_0_02", "pareto_recovered_cosine", "prune_s"]
    return head + _md(d["rows"], cols) + _quick_mark(d)


def allocation_section(d: Dict[str, Any]) -> str:
    """Uniform against non-uniform (OWL) per-layer sparsity at the same overall target."""
    head = (
        f"MiniLM, each method one-shot at the overall target, uniform or allocated per layer/block "
        f"(OWL outlier ratios, strength lam), mean cosine to the dense embeddings on {d.get('n_eval')} held-out "
        "texts.\n\n"
    )
    cols = ["method", "allocation", "target", "sparsity", "mean_cosine", "seconds"]
    return head + _md(d["rows"], cols)


def llm_quality_section(d: Dict[str, Any]) -> str:
    cols = [
        c
        for c in ("model", "method", "pattern", "sparsity", "domain", "perplexity", "ppl_ratio_vs_dense")
        if any(c in r for r in d.get("rows", []))
    ]
    rec = d.get("recovery") or {}
    head = ""
    if rec.get("patterns"):
        head = (
            f"sparsegpt+recover: {rec.get('seconds')} s of distillation from the dense model, "
            f"AdamW lr {rec.get('lr')}, autocast {rec.get('autocast')}, {rec.get('code_ratio', 1)} Python-source "
            "window(s) per prose window in the recovery text"
            + (
                ", the prose the calibration sentences plus other standard-library docstrings and the Python docs"
                if rec.get("prose") == "wide"
                else ""
            )
            + (f", {rec['train_windows']} windows in all" if rec.get("train_windows") else "")
            + ".\n\n"
        )
    steps = {r.get("recover_steps") for r in d.get("rows", []) if r.get("recover_steps")}
    cols += ["recover_steps"] if steps else []
    return head + _md(d.get("rows", []), cols, {"perplexity": ".2f", "ppl_ratio_vs_dense": ".3f"}) + _quick_mark(d)


RECOVER_COLS = [
    "pattern",
    "sparsity",
    "init_sparsity",
    "budget_s",
    "fixed_steps",
    "prune_by",
    "autocast",
    "lr",
    "dropout",
    "n_distil",
    "augment",
    "n_general",
    "steps",
    "one_shot_sparsegpt_cosine",
    "one_shot_sparsegpt_cosine_readme",
    "recovered_cosine",
    "recovered_cosine_readme",
]


def recover_section(d: Dict[str, Any]) -> str:
    """One row per run of ``benchmarks/recover.py`` (they append), oldest first."""
    # runs before a flag had its default of then: dropout 0.1, magnitude ranking
    rows = [
        dict(
            r,
            dropout=r.get("dropout", 0.1),
            prune_by=r.get("prune_by", "magnitude"),
            autocast=r.get("autocast", "none"),
        )
        for r in d.get("rows", [])
    ]
    head = (
        f"{d.get('model', 'MiniLM')}, every block Linear pruned; SparseGPT one-shot at the target (or at "
        "`init_sparsity`, then pruned gradually to the target while distilling), then "
        "`sparsa.recover` for `budget_s` (calibration included). Cosine: dense against pruned sentence "
        "embeddings on held-out stdlib docstrings (`recovered_cosine`) and README prose "
        "(`recovered_cosine_readme`, a domain never distilled on). augment: the fraction of tokens "
        "replaced by random word pieces in an added noisy copy of every distillation batch. n_general: "
        "sentences of general English written by SmolLM2-135M-Instruct (`sparsa.data.generated`) among "
        "the `n_distil` distillation sentences. fixed_steps: exactly that many optimizer steps instead of a "
        "budget. prune_by: what the gradual schedule ranks (`magnitude` |W|, `wanda` |W|·||X||). autocast: "
        "`bf16` ran the student under `torch.autocast` (fp32 master weights, `recover(autocast=...)`).\n\n"
    )
    return head + _md(rows, RECOVER_COLS, {"lr": "g"})


def dispatch_section(d: Dict[str, Any]) -> str:
    return _md(d["rows"], ["mode", "direct_us", "dispatched_us", "overhead_us"])


def relu_compact_section(d: Dict[str, Any]) -> str:
    """Milliseconds of forward + backward per route, and each sparse route against the fastest dense one."""
    routes = ("relu_kernels", "op", "op_from_dense", "op_via_dense")
    rows = [
        {
            "op": r["op"],
            "shape": "x".join(str(s) for s in r["shape"]),
            "sparsity": r["sparsity"],
            "best_dense": r["best_dense"],
            "best_dense_ms": r[f"{r['best_dense']}_ms"],
            "op_route": r.get("op_route", "kernels"),
            **{f"{k}_ms": r[f"{k}_ms"] for k in routes},
            **{f"{k} x": r[f"{k}_speedup_vs_best_dense"] for k in routes},
        }
        for r in d["rows"]
    ]
    cols = ["op", "shape", "sparsity", "best_dense", "best_dense_ms", "op_route"] + [f"{k}_ms" for k in routes]
    return _md(rows, cols + [f"{k} x" for k in routes]) + (
        f"\n\n{d['timing']}, {d['rows'][0]['threads']} threads. `x`: speed-up over the fastest dense route. "
        "`op_route`: what the op ran, the kernels or (relu(x) denser than the op's crossover in "
        "`sparsa.crossovers`) the dense op on relu(x)."
    )


SECTIONS = {
    "linear_kernels": lambda d: (
        linear_section(d, True)
        + "\n\n<details><summary>All rows</summary>\n\n"
        + linear_section(d, False)
        + "\n\n</details>"
    ),
    "bert_inference": bert_section,
    "adaptive_training": adaptive_section,
    "adaptive_union": adaptive_union_section,
    "quality": quality_section,
    "deepsparse_h2h": h2h_section,
    "dispatch_overhead": dispatch_section,
    "relu_compact_ops": relu_compact_section,
    "llm_decode": llm_decode_section,
    "bitmask_stream": bitmask_stream_section,
    "bitmask_prefill": bitmask_prefill_section,
    "bf16_paths": bf16_paths_section,
    "row_group_mlp": row_group_mlp_section,
    "adaptive_bf16": adaptive_bf16_section,
    "adaptive_bf16_gemms": adaptive_bf16_gemms_section,
    "activation_tiles": activation_tiles_section,
    "row_group_ab": row_group_ab_section,
    "sliced_ell_ab": sliced_ell_ab_section,
    "llm_quality": llm_quality_section,
    "pareto": pareto_section,
    "recover": recover_section,
    "allocation": allocation_section,
    "prune_defaults": prune_defaults_section,
}


def class_section(d: Path) -> str:
    """Every result of one CPU class, headed with its CPU."""
    parts = [f"## {d.name}", cpu_heading(d.name, cpu_of(d))]
    missing = []
    for name, title, cmd in BENCHES:
        data = _load(d, name)
        if data is None:
            missing.append(f"`{cmd}`")
            continue
        parts.append(f"### {title} (`{cmd}`)\n\n{SECTIONS[name](data)}")
    if missing:
        parts.append("Not measured on this CPU class yet: " + ", ".join(missing) + ".")
    return "\n\n".join(parts)


def _summary_dirs(dirs: List[Path], name: str) -> List[Path]:
    """The classes whose ``name`` results go into the README: every measured class, legacy results
    only where no measured class has any."""
    have = [d for d in dirs if (d / f"{name}.json").is_file()]
    measured = [d for d in have if not d.name.startswith("legacy")]
    return measured or have


def readme_summary(root: Path = RESULTS) -> str:
    dirs = class_dirs(root)
    parts = []
    for d in _summary_dirs(dirs, "linear_kernels"):
        parts.append(
            f"**Per layer.** {cpu_heading(d.name, cpu_of(d))}\n\n{linear_section(_load(d, 'linear_kernels'), True)}"
        )
    for d in _summary_dirs(dirs, "bert_inference"):
        data = _load(d, "bert_inference")
        batches = sorted({r["batch"] for r in data["rows"]})
        sel = batches[-1:] if len(batches) > 1 else None
        parts.append(
            f"**BERT-base end to end{f', batch {batches[-1]}' if sel else ''}.** "
            f"{cpu_heading(d.name, cpu_of(d))}\n\n{bert_section(data, sel)}"
        )
    for d in _summary_dirs(dirs, "deepsparse_h2h"):
        parts.append(
            f"**Against DeepSparse, same weights.** {cpu_heading(d.name, cpu_of(d))}\n\n"
            f"{h2h_section(_load(d, 'deepsparse_h2h'))}"
        )
    for d in _summary_dirs(dirs, "llm_decode"):
        data = _load(d, "llm_decode")
        rows = [r for r in data["rows"] if r["batch"] == 1]
        parts.append(
            f"**LLM decoding, batch 1 (bitmask layout).** {cpu_heading(d.name, cpu_of(d))}\n\n"
            f"{llm_decode_section(dict(data, rows=rows))}"
        )
    for d in _summary_dirs(dirs, "pareto"):
        parts.append(
            f"**Quality against speed (MiniLM-L6 frontier).** {cpu_heading(d.name, cpu_of(d))}\n\n"
            f"{pareto_section(_load(d, 'pareto'), frontier_only=True)}"
        )
    if not parts:
        return "_No linear_kernels or bert_inference results yet: run the benchmark scripts._"
    return "\n\n".join(parts)


def render(root: Path = RESULTS) -> str:
    """docs/benchmarks.md for the results under ``root``."""
    dirs = class_dirs(root)
    intro = """# Benchmarks

Every table below is generated by `python benchmarks/tables.py` from the JSON the benchmark
scripts write under `benchmarks/results/<cpu class>/` (`sparsa.cpu.cpu_class()`, e.g. `amd-avx2`).
Each CPU class has its own section, headed with the CPU's model, ISA flags and library versions:
sparse kernels and dense baselines both pick their instruction set at run time, so a ratio holds for
the CPU it was measured on. Ratios are measured side by side in one process (warm-up, dense and
sparse alternating, median of repetitions); the current scripts compare every sparse row against the
fastest dense path of that CPU (dense fp32, dense bf16 and torch.compile of the faster, the
`*_vs_best_dense` columns) as well as against dense fp32 eager (`*_vs_dense`). `legacy-avx512` holds
the results measured before the scripts recorded the CPU (a 2-core AMD EPYC with AVX-512, fp32 only,
compared with dense fp32 eager and, for BERT, its torch.compile). Re-run a script to refresh its
table (`sparsa bench NAME` runs it from a source checkout).

The quality-speed frontier of the pretrained MiniLM-L6 comes from `benchmarks/pareto.py`:
`flock /tmp/sparsa-bench.lock python benchmarks/pareto.py --quick` (unstructured/sliced_ell, 2:4
and row_group16 at 50/70/90%, magnitude, Wanda and SparseGPT one-shot, one 40 s recovery; under 5
minutes on 2 cores) or the full grid, `python benchmarks/pareto.py [--budget SECONDS]
[--recover-budget SECONDS] [--recover none|all|PATTERN@SPARSITY,...]`: 27 (layout, sparsity)
configurations timed (a few minutes), 76 one-shot rows (about 25 minutes on 2 cores) and 81
recoveries of `--recover-budget` seconds each (default 300 s, about 7 hours in all); `--budget`
stops starting rows after that many seconds and lists the rest as skipped. The committed amd-avx2
run (34 minutes) is `python benchmarks/pareto.py --budget 3900 --recover-budget 300 --recover
unstructured@0.8,unstructured@0.9,row_group16@0.5,row_group16@0.7,row_group8@0.6 --recover-methods
sparsegpt`; the `intel-amx` run (40 minutes) is the command under its table, the first to time each
configuration in its fastest way to run (fp32 or bf16, GELU-fused, compiled; an unstructured mask in
sliced_ell and in bitmask).
"""
    body = [class_section(d) for d in dirs] or ["_No results yet: run the benchmark scripts._"]
    return intro + "\n" + "\n\n".join(body) + "\n"


#: the heading of docs/benchmarks.md's hand-written last section, which main() keeps when it re-renders
HAND_WRITTEN = "## Design measurements behind the kernels"


def main(argv: Optional[List[str]] = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    doc = ROOT / "docs" / "benchmarks.md"
    old = doc.read_text() if doc.is_file() else ""
    kept = old[old.index(HAND_WRITTEN) :] if HAND_WRITTEN in old else ""
    doc.write_text(render(RESULTS) + ("\n" + kept if kept else ""))
    readme = ROOT / "README.md"
    text = readme.read_text()
    start, end = "<!-- bench:start -->", "<!-- bench:end -->"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        readme.write_text(f"{head}{start}\n{readme_summary(RESULTS)}\n{end}{tail}")
    print("wrote docs/benchmarks.md" + (" and README.md" if start in text else ""))


if __name__ == "__main__":
    main()
