"""Movement pruning (Sanh et al., 2020): keep the weights that move *away* from zero during
fine-tuning, i.e. the largest accumulated importance ``S = -sum_t w * dL/dw``.

A training callback: :meth:`MovementPruning.accumulate` after every ``backward()`` (needs the
dense gradient, which the masked layout gives), :meth:`MovementPruning.step` once per step; the
target sparsity follows a :class:`~sparsa.sparsifiers.Schedule` (usually cubic) and the pattern
is stored in each parameter's layout. Pruned positions are never regrown (their score is -inf).

>>> import torch, torch.nn as nn, sparsa
>>> from sparsa.sparsifiers import CubicSchedule, KeepAll
>>> model = sparsa.sparsify(nn.Linear(16, 8), sparsa.Rule(sparsifier=KeepAll()))
>>> mp = MovementPruning([model.weight], CubicSchedule(0.0, 0.5, start_step=0, end_step=4))
>>> for step in range(5):
...     model(torch.randn(4, 16)).pow(2).mean().backward()
...     mp.accumulate(); _ = mp.step(step); model.zero_grad()
>>> model.weight.sparsity
0.5
"""

from __future__ import annotations

from typing import Iterable, List, Optional

import torch
from torch import Tensor

from ..sparsifiers.base import n_removed, top_mask
from ..sparsifiers.schedules import Schedule
from ..tensor import to_dense
from .pattern import _iter_sparse, set_pattern

__all__ = ["MovementPruning"]


class MovementPruning:
    """Prune ``params`` to ``schedule(step)`` by accumulated movement score (per tensor)."""

    applied: Optional[float] = None  # the target sparsity last applied

    def __init__(self, params: Iterable[Tensor], schedule: Schedule):
        if not isinstance(schedule, Schedule):
            raise TypeError(f"schedule must be a sparsa Schedule (e.g. CubicSchedule), got {type(schedule).__name__}")
        self.params, self.schedule = _iter_sparse(params), schedule
        self.scores: List[Tensor] = [torch.zeros(p.shape) for p in self.params]

    def accumulate(self) -> None:
        """Add ``-w * grad`` to every score (call after ``backward()``)."""
        for p, s in zip(self.params, self.scores):
            if p.grad is None:
                raise ValueError("MovementPruning.accumulate needs gradients: call it after loss.backward()")
            s.sub_((p.sparse_layout.to_dense() * to_dense(p.grad)).float())

    def step(self, step: int) -> bool:
        """Apply the target of ``step`` if it changed; returns whether the patterns were updated."""
        target = self.schedule(step)
        if target == self.applied:
            return False
        for p, s in zip(self.params, self.scores):
            s.masked_fill_(~p.pattern(), -torch.inf)
            set_pattern(p, top_mask(s.reshape(1, -1), s.numel() - n_removed(target, s.numel())).view_as(s))
        self.applied = target
        return True
