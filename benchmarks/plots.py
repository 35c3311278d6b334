"""PNG plots from the benchmark JSON files (speed-up vs sparsity, quality vs sparsity).

    python benchmarks/plots.py          # benchmarks/results/<this cpu class>/*.png for every JSON there
    python benchmarks/plots.py --all    # every CPU class directory under benchmarks/results/

``$SPARSA_RESULTS_DIR`` (or ``--dir``) names the one directory to read and write instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

BASE = Path(__file__).resolve().parent / "results"


def default_dir() -> Path:
    """``$SPARSA_RESULTS_DIR`` if set, else ``benchmarks/results/<this CPU's class>``."""
    env = os.environ.get("SPARSA_RESULTS_DIR")
    if env:
        return Path(env)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from sparsa.cpu import cpu_class

    return BASE / cpu_class()


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def linear_plot(results: Path) -> Path:
    """Speed-up per layout vs sparsity, one panel per shape: against the best dense path where the JSON
    has it (solid fp32, dashed bf16), else against dense fp32."""
    rows: List[Dict[str, Any]] = [
        r for r in json.loads((results / "linear_kernels.json").read_text())["rows"] if r.get("layout") != "dense"
    ]
    plt = _plt()
    toks, threads = {r["tokens"] for r in rows}, {r["threads"] for r in rows}
    T = 1024 if 1024 in toks else max(toks)
    nt = 1 if 1 in threads else min(threads)
    best = any("ratio_vs_best_dense" in r for r in rows)
    key = "ratio_vs_best_dense" if best else "ratio_vs_dense"
    shapes = sorted({(r["out_features"], r["in_features"]) for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, (o, i) in zip(axes, shapes):
        sel = [
            r
            for r in rows
            if (r["out_features"], r["in_features"]) == (o, i) and r["tokens"] == T and r["threads"] == nt
        ]
        colors: Dict[str, Any] = {}
        for lay, dt in sorted({(r["layout"], r.get("dtype", "float32")) for r in sel}):
            pts = sorted(
                (r["sparsity"], r.get(key, r["ratio_vs_dense"]))
                for r in sel
                if (r["layout"], r.get("dtype", "float32")) == (lay, dt)
            )
            (line,) = ax.plot(
                [p[0] * 100 for p in pts],
                [p[1] for p in pts],
                marker="o",
                color=colors.get(lay),
                ls="-" if dt == "float32" else "--",
                label=lay if dt == "float32" else f"{lay} bf16",
            )
            colors.setdefault(lay, line.get_color())
        ax.axhline(1.0, color="gray", lw=0.8, ls=":")
        ax.set_yscale("log")
        ax.set_title(f"W {o}x{i}, {T} tokens, {nt} thread{'s' if nt > 1 else ''}")
        ax.set_xlabel("sparsity (%)")
    axes[0].set_ylabel("speed-up vs the best dense path (log)" if best else "speed-up vs dense F.linear (log)")
    axes[-1].legend(fontsize=6)
    fig.tight_layout()
    out = results / "linear_kernels.png"
    fig.savefig(out, dpi=110)
    return out


def quality_plot(results: Path) -> Path:
    d = json.loads((results / "quality.json").read_text())
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    rows = d["minilm"]
    methods = sorted({r["method"] for r in rows})
    patterns = sorted({r["pattern"] for r in rows})
    width = 0.8 / max(1, len(methods))
    for k, meth in enumerate(methods):
        ys = [
            next((r["mean_cosine"] for r in rows if r["method"] == meth and r["pattern"] == p), 0.0) for p in patterns
        ]
        ax.bar([j + k * width for j in range(len(patterns))], ys, width, label=meth)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(patterns))])
    ax.set_xticklabels(patterns, rotation=20, fontsize=8)
    ax.set_ylabel("mean cosine, dense vs sparse embeddings")
    ax.set_title("MiniLM-L6 (pretrained) at 50% sparsity, held-out text")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = results / "quality.png"
    fig.savefig(out, dpi=110)
    return out


def adaptive_plot(results: Path) -> Path:
    d = json.loads((results / "adaptive_training.json").read_text())
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for shape in sorted({r["shape"] for r in d["sweep"]}):
        pts = sorted(
            (r["activation_sparsity"], r["ratio_vs_dense"])
            for r in d["sweep"]
            if r["shape"] == shape and r.get("dy", "real") == "real"
        )
        ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], marker="o", label=shape)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xlabel("activation sparsity (%)")
    ax.set_ylabel("conv fwd+bwd speed-up vs dense")
    ax.set_title("Activation-sparse conv (CPU, 2 threads)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = results / "adaptive_training.png"
    fig.savefig(out, dpi=110)
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="the results directory to plot (default: $SPARSA_RESULTS_DIR, else this CPU class's)",
    )
    ap.add_argument("--all", action="store_true", help="every CPU class directory under benchmarks/results/")
    args = ap.parse_args(argv)
    dirs = sorted(d for d in BASE.iterdir() if d.is_dir()) if args.all else [args.dir or default_dir()]
    for results in dirs:
        for name, fn in (
            ("linear_kernels", linear_plot),
            ("quality", quality_plot),
            ("adaptive_training", adaptive_plot),
        ):
            if (results / f"{name}.json").is_file():
                print("wrote", fn(results))


if __name__ == "__main__":
    main()
