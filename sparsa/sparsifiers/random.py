"""Random: remove an exact fraction of positions chosen uniformly at random."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..layouts.base import check_fraction
from .base import Sparsifier, n_removed


class Random(Sparsifier):
    """Keep ``numel - round(sparsity * numel)`` positions chosen uniformly at random.

    Args:
        sparsity: fraction removed, in ``[0, 1)``.
        seed: if given, every call draws the same pattern for the same shape (reproducible).
        generator: a ``torch.Generator`` to draw from (advances on each call); used when
            ``seed`` is None. Without both, the global RNG is used.

    >>> import torch
    >>> from sparsa.sparsifiers import Random
    >>> int(Random(0.25, seed=0).mask(torch.ones(8)).sum())
    6
    """

    name = "random"

    def __init__(self, sparsity: float, seed: Optional[int] = None, generator: Optional[torch.Generator] = None):
        self.sparsity = check_fraction(sparsity, "sparsity")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        self.seed = seed
        self.generator = generator

    def _mask(self, dense: Tensor) -> Tensor:
        n = dense.numel()
        gen = self.generator
        if self.seed is not None:
            gen = torch.Generator().manual_seed(self.seed)
        keep = n - n_removed(self.sparsity, n)
        idx = torch.randperm(n, generator=gen)[:keep]
        out = torch.zeros(n, dtype=torch.bool)
        out[idx] = True
        return out.reshape(dense.shape).to(dense.device)

    def _repr_args(self):
        return {"sparsity": self.sparsity, "seed": self.seed}
