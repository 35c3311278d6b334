"""Dynamic sparse training at constant sparsity: SET (Mocanu et al., 2018) and RigL (Evci et al., 2020).

Every ``update_every`` steps each sparse parameter drops the ``k`` active weights of smallest
magnitude and regrows ``k`` inactive positions: at random (SET) or where the dense gradient is
largest (RigL). ``k`` is ``drop_fraction`` of the active weights, decayed with a cosine to zero at
``end_step``. Regrown weights start at zero and their optimizer state (Adam moments, momentum) is
reset, so they are not pushed by stale averages. The new pattern is written into the parameter's
layout (:func:`~sparsa.methods.pattern.set_pattern`), which stays the same parameter object.

Distributed: under ``torch.distributed`` the gradients RigL reads are already all-reduced by DDP,
so every rank computes the same pattern; the pattern chosen on rank 0 is broadcast anyway
(``sync=True``), which also covers SET's random choice and floating-point ties.

>>> import torch, torch.nn as nn, sparsa
>>> from sparsa.sparsifiers import Magnitude
>>> model = sparsa.sparsify(nn.Linear(32, 16), Magnitude(0.9))
>>> opt = torch.optim.Adam(model.parameters(), lr=1e-3)
>>> rigl = RigL([model.weight], opt, update_every=1, end_step=10)
>>> model(torch.randn(8, 32)).pow(2).mean().backward()
>>> rigl.step(1)   # after backward, before optimizer.step()
True
>>> round(model.weight.sparsity, 2)
0.9
"""
from __future__ import annotations

import math
from typing import Iterable, List, Optional, Sequence

import torch
from torch import Tensor

from ..layouts.base import check_fraction
from ..tensor import SparseTensor
from .pattern import _iter_sparse, reset_optimizer_state, set_pattern

__all__ = ["DynamicSparsity", "RigL", "SET", "erk_sparsities"]


def erk_sparsities(shapes: Sequence[Sequence[int]], sparsity: float) -> List[float]:
    """Per-layer sparsities with overall ``sparsity`` by Erdos-Renyi-Kernel (RigL's default): a layer's
    density is proportional to ``sum(shape) / prod(shape)`` (small layers stay denser), capped at dense.

    >>> [round(s, 3) for s in erk_sparsities([(16, 1, 3, 3), (256, 512)], 0.9)]
    [0.0, 0.901]
    """
    sizes = [math.prod(s) for s in shapes]
    raw = [sum(s) / n for s, n in zip(shapes, sizes)]
    dense: set = set()
    while len(dense) < len(sizes):
        budget = (1 - check_fraction(sparsity, "sparsity")) * sum(sizes) - sum(sizes[i] for i in dense)
        eps = budget / sum(raw[i] * sizes[i] for i in range(len(sizes)) if i not in dense)
        over = {i for i in range(len(sizes)) if i not in dense and eps * raw[i] >= 1}
        if not over:
            return [0.0 if i in dense else 1 - eps * raw[i] for i in range(len(sizes))]
        dense |= over
    return [0.0] * len(sizes)


class DynamicSparsity:
    """Shared drop-and-grow loop; subclasses define :meth:`grow_score`. Call :meth:`step` once per
    training step between ``backward()`` and ``optimizer.step()``."""

    def __init__(self, params: Iterable[Tensor], optimizer: Optional[torch.optim.Optimizer] = None, *,
                 update_every: int = 100, drop_fraction: float = 0.3, end_step: Optional[int] = None,
                 seed: int = 0, sync: bool = True):
        self.params = _iter_sparse(params)
        if isinstance(update_every, bool) or not isinstance(update_every, int) or update_every <= 0:
            raise ValueError(f"update_every must be a positive int, got {update_every!r}")
        self.optimizer, self.update_every = optimizer, update_every
        self.drop_fraction = check_fraction(drop_fraction, "drop_fraction")
        self.end_step, self.seed, self.sync = end_step, seed, sync

    def fraction_at(self, step: int) -> float:
        """Cosine-decayed drop fraction (0 from ``end_step`` on)."""
        if self.end_step is None:
            return self.drop_fraction
        if step >= self.end_step:
            return 0.0
        return self.drop_fraction * 0.5 * (1.0 + math.cos(math.pi * step / self.end_step))

    def step(self, step: int) -> bool:
        """Update the patterns if ``step`` is an update step; returns whether it was."""
        frac = self.fraction_at(step)
        if step <= 0 or step % self.update_every or frac <= 0.0:
            return False
        for i, p in enumerate(self.params):
            self._update(i, p, frac, step)
        return True

    def grow_score(self, index: int, param: SparseTensor, step: int) -> Tensor:
        """Score of every position for regrowth (higher grows first)."""
        raise NotImplementedError

    def _update(self, i: int, p: SparseTensor, frac: float, step: int) -> None:
        mask = p.pattern()
        dense = p.sparse_layout.to_dense()
        k = int(frac * int(mask.sum()))
        if k == 0 or bool(mask.all()):  # a dense layer (e.g. from ERK) has nothing to swap with
            return
        flat = mask.flatten()
        drop_score = torch.where(flat, dense.abs().flatten(), torch.inf)
        kept = flat.clone()
        kept[drop_score.topk(k, largest=False).indices] = False
        grow = self.grow_score(i, p, step).flatten().float()
        grow = torch.where(kept, -torch.inf, grow)
        new = kept.clone()
        new[grow.topk(k).indices] = True
        new, kept = self._broadcast(new.view_as(mask)), self._broadcast(kept.view_as(mask))
        set_pattern(p, new, values=dense * kept)  # regrown weights (also just-dropped ones) start at zero
        reset_optimizer_state(self.optimizer, p, new & ~kept)

    def _broadcast(self, mask: Tensor) -> Tensor:
        dist = torch.distributed
        if not (self.sync and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return mask
        buf = mask.to(torch.uint8)
        dist.broadcast(buf, src=0)
        return buf.bool()


class RigL(DynamicSparsity):
    """Regrow where the dense gradient magnitude is largest (needs ``param.grad`` with values at every
    position: the masked layout's gradient is dense; a gradient restricted to the pattern cannot rank
    inactive positions and raises)."""

    def grow_score(self, index: int, param: SparseTensor, step: int) -> Tensor:
        g = param.grad
        if g is None:
            raise ValueError("RigL.step needs gradients: call it after loss.backward() and before "
                             "optimizer.zero_grad()")
        if isinstance(g, SparseTensor):
            raise ValueError("RigL needs the dense gradient of every position, but this parameter's .grad is "
                             f"stored sparsely ({g.layout_name}); drop the target='grad' rule for it")
        return g.abs()


class SET(DynamicSparsity):
    """Regrow at random positions (seeded by ``seed``, the step and the parameter index, so every
    process draws the same)."""

    def grow_score(self, index: int, param: SparseTensor, step: int) -> Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1_009 + index)
        return torch.rand(param.shape, generator=gen)
