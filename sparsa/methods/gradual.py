"""Pruning schedules as a training callback: gradual magnitude pruning with the cubic schedule
(Zhu & Gupta, 2017), iterative prune-and-fine-tune, and one-shot pruning.

As a :func:`sparsa.sparsify` config: :class:`Gradual` (and :class:`~sparsa.methods.OneShot` for
one-shot). All three are one mechanism: a :class:`~sparsa.sparsifiers.Schedule` gives the target sparsity at
each step; whenever it changes, :class:`GradualPruning` re-ranks every sparse parameter with its
sparsifier and stores the new pattern in the parameter's layout (:func:`set_pattern`). Between
changes the pattern is kept by the optimizer steps themselves (sparsa refills it).

>>> import torch, torch.nn as nn, sparsa
>>> from sparsa.sparsifiers import CubicSchedule, KeepAll
>>> model = sparsa.sparsify(nn.Linear(32, 16), sparsa.Rule(sparsifier=KeepAll()))
>>> pruner = GradualPruning([model.weight], CubicSchedule(0.0, 0.9, start_step=0, end_step=100, every=10))
>>> for step in range(101):
...     _ = pruner.step(step)    # once per training step, after optimizer.step()
>>> round(model.weight.sparsity, 2)
0.9
"""

from __future__ import annotations

import warnings
from dataclasses import KW_ONLY, dataclass
from typing import Iterable, Optional

from torch import Tensor, nn

from ..layouts.base import check_fraction
from ..nn import Rule, sparsify
from ..nn.config import FilterFn, SparsifyConfig
from ..sparsifiers import Magnitude
from ..sparsifiers.base import Sparsifier
from ..sparsifiers.schedules import Schedule, _check_step
from ..tensor import SparseTensor
from .pattern import _iter_sparse, set_pattern

__all__ = ["GradualPruning", "IterativeSchedule", "Gradual", "one_shot"]


class GradualPruning:
    """Training callback: prune ``params`` to ``schedule(step)`` with ``sparsifier`` (default: magnitude
    per tensor). Already-pruned weights are zero, so magnitude ranking never brings them back."""

    applied: Optional[float] = None  # the target sparsity last applied

    def __init__(self, params: Iterable[Tensor], schedule: Schedule, sparsifier: Optional[Sparsifier] = None):
        if not isinstance(schedule, Schedule):
            raise TypeError(f"schedule must be a sparsa Schedule (e.g. CubicSchedule), got {type(schedule).__name__}")
        self.params, self.schedule = _iter_sparse(params), schedule
        self.sparsifier = sparsifier if sparsifier is not None else Magnitude(0.0)

    def step(self, step: int) -> bool:
        """Apply the target of ``step`` if it changed; returns whether the patterns were updated."""
        target = self.schedule(step)
        if target == self.applied:
            return False
        for p in self.params:
            set_pattern(p, self.sparsifier.with_sparsity(target).mask(p.sparse_layout.to_dense()))
        self.applied = target
        return True


class IterativeSchedule(Schedule):
    """Iterative prune-and-fine-tune (Han et al., 2015): ``rounds`` pruning events ``every`` steps apart
    from ``start_step``; each removes the same fraction of the remaining weights, ending at ``final``.

    >>> s = IterativeSchedule(0.75, rounds=2, every=10)
    >>> s(0), s(9), s(10), s(100)
    (0.5, 0.5, 0.75, 0.75)
    """

    def __init__(self, final: float, rounds: int, every: int, start_step: int = 0):
        self.final = check_fraction(final, "final")
        self.rounds = _check_step(rounds, "rounds", positive=True)
        self.every, self.start_step = _check_step(every, "every", positive=True), _check_step(start_step, "start_step")

    def sparsity_at(self, step: int) -> float:
        step = _check_step(step)
        if step < self.start_step:
            return 0.0
        done = min(self.rounds, (step - self.start_step) // self.every + 1)
        return 1.0 - (1.0 - self.final) ** (done / self.rounds)


@dataclass
class Gradual(SparsifyConfig):
    """Gradual magnitude pruning as a :func:`sparsa.sparsify` config: the selected ``nn.Linear`` weights
    (all by default) become sparse parameters in ``layout`` at ``schedule(0)``; :meth:`pruner` gives the
    training callback that follows ``schedule`` (call its ``step(step)`` after each optimizer step).

    ``sparsifier``: a fraction-based sparsifier re-ranked at each target (default per-tensor magnitude).

    >>> import torch.nn as nn, sparsa
    >>> from sparsa.sparsifiers import CubicSchedule
    >>> cfg = Gradual(CubicSchedule(0.0, 0.9, start_step=0, end_step=100, every=10))
    >>> model = sparsa.sparsify(nn.Linear(32, 16), cfg)
    >>> pruner = cfg.pruner(model)
    >>> for step in range(101):
    ...     _ = pruner.step(step)    # once per training step, after optimizer.step()
    >>> round(model.weight.sparsity, 2)
    0.9
    """

    schedule: Schedule
    _: KW_ONLY
    sparsifier: Optional[Sparsifier] = None
    layout: str = "masked"

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, Schedule):
            raise TypeError(
                f"schedule must be a sparsa Schedule (e.g. CubicSchedule(0.0, 0.9, start_step=0, "
                f"end_step=1000)), got {type(self.schedule).__name__}"
            )
        self._ranker = self.sparsifier if self.sparsifier is not None else Magnitude(0.0)
        self._ranker.with_sparsity(0.0)  # a fraction-based sparsifier is needed: fail here, not mid-training

    def apply(self, model: nn.Module, filter_fn: Optional[FilterFn] = None) -> None:
        start = self._ranker.with_sparsity(self.schedule(0))
        sparsify(model, Rule(sparsifier=start, layout=self.layout, module_types=nn.Linear), filter_fn)

    def pruner(self, model: nn.Module) -> GradualPruning:
        """The callback over every sparse ``nn.Linear`` weight of ``model`` (those :meth:`apply` made)."""
        params = [m.weight for m in model.modules() if isinstance(m, nn.Linear) and isinstance(m.weight, SparseTensor)]
        return GradualPruning(params, self.schedule, self._ranker)


def one_shot(model: nn.Module, sparsifier: Sparsifier, layout: str = "masked", **rule: object) -> nn.Module:
    """Deprecated: use ``sparsa.sparsify(model, sparsa.methods.OneShot(sparsifier=s, layout=layout), filter_fn)``.

    One-shot pruning: every ``nn.Linear`` (or what ``rule`` selects, e.g. ``module_types=``, ``names=``)
    stored in ``layout`` with ``sparsifier``'s pattern; returns the model.

    >>> import warnings, torch.nn as nn
    >>> from sparsa.sparsifiers import Magnitude
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", DeprecationWarning)
    ...     m = one_shot(nn.Linear(8, 4), Magnitude(0.5))
    >>> m.weight.layout_name
    'masked'
    """
    warnings.warn(
        "sparsa.methods.one_shot is deprecated: use model = sparsa.sparsify(model, "
        "sparsa.methods.OneShot(sparsifier=s, layout=...), filter_fn)",
        DeprecationWarning,
        stacklevel=2,
    )
    rule.setdefault("module_types", nn.Linear)
    return sparsify(model, Rule(sparsifier=sparsifier, layout=layout, **rule))
