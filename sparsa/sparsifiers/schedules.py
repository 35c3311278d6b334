"""Sparsity schedules: the target sparsity as a function of the training step.

>>> from sparsa.sparsifiers import CubicSchedule
>>> s = CubicSchedule(0.0, 0.8, start_step=0, end_step=100, every=10)
>>> s(0), round(s(50), 3), s(100), s(1000)
(0.0, 0.7, 0.8, 0.8)
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from ..layouts.base import check_fraction
from .base import Sparsifier

__all__ = ["Schedule", "ConstantSparsity", "CubicSchedule"]


def _check_step(step: int, arg: str = "step", positive: bool = False) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < int(positive):
        raise ValueError(f"{arg} must be a {'positive' if positive else 'non-negative'} int, got {step!r}")
    return step


class Schedule(ABC):
    """Maps a step to a target sparsity in ``[0, 1)``; ``schedule(step)`` is the same as ``sparsity_at``."""

    @abstractmethod
    def sparsity_at(self, step: int) -> float:
        """Target sparsity at ``step``."""

    def __call__(self, step: int) -> float:
        return self.sparsity_at(step)

    def sparsifier_at(self, sparsifier: Sparsifier, step: int) -> Sparsifier:
        """``sparsifier`` with its target sparsity set for ``step``."""
        return sparsifier.with_sparsity(self.sparsity_at(step))


class ConstantSparsity(Schedule):
    """The same sparsity at every step (from ``begin_step`` on; 0 before)."""

    def __init__(self, sparsity: float, begin_step: int = 0):
        self.sparsity = check_fraction(sparsity, "sparsity")
        self.begin_step = _check_step(begin_step, "begin_step")

    def sparsity_at(self, step: int) -> float:
        return self.sparsity if _check_step(step) >= self.begin_step else 0.0

    def __repr__(self) -> str:
        return f"ConstantSparsity(sparsity={self.sparsity}, begin_step={self.begin_step})"


class CubicSchedule(Schedule):
    """Gradual pruning (Zhu & Gupta, 2017): from ``initial`` to ``final`` between ``start_step`` and
    ``end_step``, updated every ``every`` steps:
    ``s_t = final + (initial - final) * (1 - (t - start) / (end - start)) ** 3``,
    with ``t`` rounded down to the last update step. ``initial`` before ``start_step``, ``final`` after.
    """

    def __init__(self, initial: float, final: float, start_step: int, end_step: int, every: int = 1):
        self.initial, self.final = check_fraction(initial, "initial"), check_fraction(final, "final")
        self.start_step, self.end_step = _check_step(start_step, "start_step"), _check_step(end_step, "end_step")
        if self.end_step <= self.start_step:
            raise ValueError(f"end_step must be > start_step, got start_step={start_step}, end_step={end_step}")
        self.every = _check_step(every, "every", positive=True)

    def sparsity_at(self, step: int) -> float:
        if _check_step(step) >= self.end_step:
            return self.final
        t = max(step - self.start_step, 0) // self.every * self.every  # steps since the start, at the last update
        return self.initial + (self.final - self.initial) * (1.0 - (1.0 - t / (self.end_step - self.start_step)) ** 3)

    def is_update_step(self, step: int) -> bool:
        """Whether the target changes at ``step`` (a multiple of ``every`` after the start, up to the end)."""
        step = _check_step(step)
        return self.start_step <= step <= self.end_step and (step - self.start_step) % self.every == 0

    def __repr__(self) -> str:
        return (
            f"CubicSchedule(initial={self.initial}, final={self.final}, start_step={self.start_step}, "
            f"end_step={self.end_step}, every={self.every})"
        )
