"""PNG plots from the benchmark JSON files (speed-up vs sparsity, quality vs sparsity).

    python benchmarks/plots.py      # writes benchmarks/results/*.png for every JSON present
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List

RESULTS = Path(os.environ.get("SPARSA_RESULTS_DIR", Path(__file__).resolve().parent / "results"))


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def linear_plot() -> Path:
    rows: List[Dict[str, Any]] = json.loads((RESULTS / "linear_kernels.json").read_text())["rows"]
    plt = _plt()
    shapes = sorted({(r["out_features"], r["in_features"]) for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), sharey=True)
    for ax, (o, i) in zip(axes, shapes):
        sel = [r for r in rows if (r["out_features"], r["in_features"]) == (o, i) and r["tokens"] == 1024
               and r["threads"] == 1]
        for lay in sorted({r["layout"] for r in sel}):
            pts = sorted((r["sparsity"], r["ratio_vs_dense"]) for r in sel if r["layout"] == lay)
            ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], marker="o", label=lay)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.set_title(f"W {o}x{i}, 1024 tokens, 1 thread")
        ax.set_xlabel("sparsity (%)")
    axes[0].set_ylabel("speed-up vs dense F.linear (log)")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    out = RESULTS / "linear_kernels.png"
    fig.savefig(out, dpi=110)
    return out


def quality_plot() -> Path:
    d = json.loads((RESULTS / "quality.json").read_text())
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    rows = d["minilm"]
    methods = sorted({r["method"] for r in rows})
    patterns = sorted({r["pattern"] for r in rows})
    width = 0.8 / max(1, len(methods))
    for k, meth in enumerate(methods):
        ys = [next((r["mean_cosine"] for r in rows if r["method"] == meth and r["pattern"] == p), 0.0) for p in patterns]
        ax.bar([j + k * width for j in range(len(patterns))], ys, width, label=meth)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(patterns))])
    ax.set_xticklabels(patterns, rotation=20, fontsize=8)
    ax.set_ylabel("mean cosine, dense vs sparse embeddings")
    ax.set_title("MiniLM-L6 (pretrained) at 50% sparsity, held-out text")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = RESULTS / "quality.png"
    fig.savefig(out, dpi=110)
    return out


def adaptive_plot() -> Path:
    d = json.loads((RESULTS / "adaptive_training.json").read_text())
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for shape in sorted({r["shape"] for r in d["sweep"]}):
        pts = sorted((r["activation_sparsity"], r["ratio_vs_dense"]) for r in d["sweep"]
                     if r["shape"] == shape and r.get("dy", "real") == "real")
        ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], marker="o", label=shape)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xlabel("activation sparsity (%)")
    ax.set_ylabel("conv fwd+bwd speed-up vs dense")
    ax.set_title("Activation-sparse conv (CPU, 2 threads)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = RESULTS / "adaptive_training.png"
    fig.savefig(out, dpi=110)
    return out


def main() -> None:
    for name, fn in (("linear_kernels", linear_plot), ("quality", quality_plot), ("adaptive_training", adaptive_plot)):
        if (RESULTS / f"{name}.json").is_file():
            print("wrote", fn())


if __name__ == "__main__":
    main()
