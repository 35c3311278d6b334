"""The small demo: sparsify an MLP on scikit-learn's digits, fine-tune it, compare and save it.

Run ``python -m examples.demo [--sparsity 0.75] [--layout masked] [--epochs 15] [--finetune-epochs 5]``.

Steps: train a dense 64-256-128-10 MLP, apply magnitude sparsity to its Linear weights with
:func:`sparsa.sparsify`, fine-tune (the pattern survives every Adam step), print dense vs sparse test
accuracy, the per-layer :func:`sparsa.sparsity_report`, and the checkpoint sizes of a dense
``torch.save`` against :func:`sparsa.save` in CSR. Seeds are fixed, so runs are reproducible.
"""

from __future__ import annotations

import argparse
import copy
import io
import os
import tempfile
import time
import warnings
from typing import Iterator, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

__all__ = ["load_digits_split", "make_mlp", "train", "accuracy", "main"]

Data = Tuple[Tensor, Tensor, Tensor, Tensor]


def load_digits_split(seed: int = 0, test_size: float = 0.25) -> Data:
    """Digits (8x8 images, 10 classes) as float tensors scaled to [0, 1]: ``(Xtr, ytr, Xte, yte)``."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    X, y = load_digits(return_X_y=True)
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=test_size, random_state=seed, stratify=y)
    f = lambda a: torch.tensor(a, dtype=torch.float32) / 16.0  # noqa: E731
    return f(Xtr), torch.tensor(ytr), f(Xte), torch.tensor(yte)


def make_mlp(seed: int = 0, sizes: Sequence[int] = (64, 256, 128, 10)) -> nn.Sequential:
    """A ReLU MLP with the given layer sizes (deterministic init)."""
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _batches(n: int, batch: int, gen: torch.Generator) -> Iterator[Tensor]:
    while True:
        perm = torch.randperm(n, generator=gen)
        for i in range(0, n - batch + 1, batch):
            yield perm[i : i + batch]


def train(
    model: nn.Module,
    X: Tensor,
    y: Tensor,
    steps: int,
    *,
    lr: float = 1e-3,
    batch: int = 64,
    seed: int = 0,
    optimizer: Optional[torch.optim.Optimizer] = None,
    progress: Optional[str] = None,
) -> torch.optim.Optimizer:
    """``steps`` minibatch Adam steps (cross-entropy); returns the optimizer. ``progress``: a tqdm label."""
    opt = optimizer or torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    it = _batches(len(X), batch, gen)
    bar = None
    if progress is not None:
        from tqdm import tqdm

        bar = tqdm(total=steps, desc=progress, unit="step", leave=True, dynamic_ncols=True)
    model.train()
    for _ in range(steps):
        idx = next(it)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(X[idx]), y[idx])
        loss.backward()
        opt.step()
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    if bar is not None:
        bar.close()
    return opt


@torch.no_grad()
def accuracy(model: nn.Module, X: Tensor, y: Tensor) -> float:
    """Top-1 accuracy in percent."""
    model.eval()
    return 100.0 * float((model(X).argmax(-1) == y).float().mean())


def _torch_save_size(state: dict) -> int:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getbuffer().nbytes


def main(argv: Optional[Sequence[str]] = None) -> dict:
    import sparsa
    from sparsa.sparsifiers import Magnitude

    p = argparse.ArgumentParser(prog="python -m examples.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--sparsity", type=float, default=0.75, help="fraction of Linear weights removed (0.75)")
    p.add_argument("--layout", default="masked", help="layout used while fine-tuning (masked)")
    p.add_argument("--epochs", type=int, default=15, help="dense training epochs (15)")
    p.add_argument("--finetune-epochs", type=int, default=5, help="sparse fine-tuning epochs (5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: the model is tiny)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    warnings.filterwarnings("ignore", category=sparsa.SparseFallbackWarning)
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, args.threads))

    Xtr, ytr, Xte, yte = load_digits_split(args.seed)
    steps_per_epoch = len(Xtr) // 64
    label = lambda s: None if args.no_progress else s  # noqa: E731
    print(
        f"digits: {len(Xtr)} train / {len(Xte)} test samples; MLP 64-256-128-10; "
        f"torch threads: {torch.get_num_threads()}"
    )

    dense = make_mlp(args.seed)
    opt = train(dense, Xtr, ytr, args.epochs * steps_per_epoch, seed=args.seed, progress=label("dense training"))
    acc_pruned_dense_only = accuracy(dense, Xte, yte)
    # a fair dense baseline gets the same extra budget as the sparse fine-tuning
    baseline = copy.deepcopy(dense)
    base_opt = torch.optim.Adam(baseline.parameters(), lr=1e-3)
    base_opt.load_state_dict(opt.state_dict())
    train(
        baseline,
        Xtr,
        ytr,
        args.finetune_epochs * steps_per_epoch,
        seed=args.seed + 1,
        optimizer=base_opt,
        progress=label("dense (same budget)"),
    )
    acc_dense = accuracy(baseline, Xte, yte)

    rule = sparsa.Rule(sparsifier=Magnitude(args.sparsity), layout=args.layout, module_types=nn.Linear)
    sparse = sparsa.sparsify(copy.deepcopy(dense), rule)
    acc_pruned = accuracy(sparse, Xte, yte)
    train(
        sparse,
        Xtr,
        ytr,
        args.finetune_epochs * steps_per_epoch,
        seed=args.seed + 1,
        progress=label(f"sparse fine-tuning ({args.layout})"),
    )
    acc_sparse = accuracy(sparse, Xte, yte)

    sparsa.sparsify(sparse, sparsa.Rule(layout="csr", module_types=nn.Linear))  # same pattern, CSR storage
    assert accuracy(sparse, Xte, yte) == acc_sparse
    print()
    print(
        f"test accuracy  dense: {acc_dense:.2f}%   after pruning to {100 * args.sparsity:.0f}%: {acc_pruned:.2f}%   "
        f"sparse fine-tuned: {acc_sparse:.2f}%   (dense before the extra epochs: {acc_pruned_dense_only:.2f}%)"
    )
    print()
    print(sparsa.format_report(sparsa.sparsity_report(sparse)))
    print()
    dense_size = _torch_save_size(baseline.state_dict())
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "sparse.safetensors")
        sparse_size = sparsa.save(sparse, path)
        reloaded = sparsa.load(make_mlp(args.seed + 99), path)
        same = torch.equal(reloaded(Xte), sparse(Xte))
    print(
        f"checkpoint  dense torch.save: {dense_size / 1024:.1f} KiB   "
        f"sparsa.save (CSR): {sparse_size / 1024:.1f} KiB   "
        f"({dense_size / sparse_size:.2f}x smaller; reloaded model identical: {same})"
    )
    elapsed = time.perf_counter() - t0
    print(f"total time {elapsed:.1f} s")
    return {
        "acc_dense": acc_dense,
        "acc_pruned": acc_pruned,
        "acc_sparse": acc_sparse,
        "dense_bytes": dense_size,
        "sparse_bytes": sparse_size,
        "reload_identical": same,
        "seconds": elapsed,
    }


if __name__ == "__main__":
    main()
