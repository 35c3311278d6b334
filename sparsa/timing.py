"""Side-by-side timing for benchmarks: warm up, alternate baseline and candidate, take medians.

Alternating the two calls in one process means both see the same machine state (clock, cache,
other load), so their *ratio* is much steadier than two separately measured times.

Example::

    >>> import torch
    >>> from sparsa.timing import compare
    >>> a, b = torch.randn(256, 256), torch.randn(256, 256)
    >>> c = compare(lambda: a @ b, lambda: a @ b, reps=5)
    >>> c.ratio > 0            # baseline time / candidate time (> 1: candidate is faster)
    True
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List

__all__ = ["Comparison", "compare", "median_time", "round_robin_ms", "best_dense", "speedups"]


@dataclass(frozen=True)
class Comparison:
    """Median seconds per call of the baseline and the candidate, and their ratio."""

    baseline_s: float
    candidate_s: float

    @property
    def ratio(self) -> float:
        """``baseline_s / candidate_s``: the candidate's speed-up (below 1 means slower)."""
        return self.baseline_s / self.candidate_s if self.candidate_s > 0 else float("inf")


def _calls_for(fn: Callable[[], object], min_seconds: float) -> int:
    """How many back-to-back calls make one timed sample last at least ``min_seconds``."""
    t0 = time.perf_counter()
    fn()
    dt = max(time.perf_counter() - t0, 1e-7)
    return max(1, min(1000, int(min_seconds / dt) + 1))


def _sample(fn: Callable[[], object], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def median_time(fn: Callable[[], object], *, reps: int = 7, warmup: int = 2, min_seconds: float = 0.005) -> float:
    """Median seconds per call of ``fn`` over ``reps`` samples (each at least ``min_seconds`` long)."""
    for _ in range(warmup):
        fn()
    n = _calls_for(fn, min_seconds)
    return statistics.median(_sample(fn, n) for _ in range(reps))


def compare(
    baseline: Callable[[], object],
    candidate: Callable[[], object],
    *,
    reps: int = 7,
    warmup: int = 2,
    min_seconds: float = 0.005,
) -> Comparison:
    """Time ``baseline`` and ``candidate`` alternately; medians over ``reps`` samples each.

    Each sample runs a function enough times back to back to last ``min_seconds`` (so tiny calls
    are not dominated by timer resolution). Lower ``reps`` for slow candidates.
    """
    for _ in range(warmup):
        baseline()
        candidate()
    nb, nc = _calls_for(baseline, min_seconds), _calls_for(candidate, min_seconds)
    tb: List[float] = []
    tc: List[float] = []
    for _ in range(max(1, reps)):
        tb.append(_sample(baseline, nb))
        tc.append(_sample(candidate, nc))
    return Comparison(statistics.median(tb), statistics.median(tc))


def round_robin_ms(fns: Dict[str, Callable[[], object]], rounds: int, min_seconds: float = 0.003) -> Dict[str, float]:
    """Median milliseconds per call of each function, timed round-robin (one block of calls of each
    per round, after one warm-up call each; calls under ``min_seconds`` are batched), so a burst of
    machine noise hits every candidate alike."""
    reps = {}
    for k, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        reps[k] = max(1, min(200, int(min_seconds / max(time.perf_counter() - t0, 1e-7))))
    ts: Dict[str, list] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(reps[k]):
                fn()
            ts[k].append((time.perf_counter() - t0) / reps[k])
    return {k: sorted(v)[len(v) // 2] * 1e3 for k, v in ts.items()}


def best_dense(ms: Dict[str, float]) -> str:
    """The label of the fastest dense baseline in ``ms`` (label -> ms)."""
    if not ms:
        raise ValueError("best_dense needs at least one timed dense baseline, got none")
    return min(ms, key=lambda k: ms[k])


def speedups(ms: Dict[str, float], candidate: str = "sparse") -> Dict[str, Any]:
    """From one side-by-side timing ``{"fp32": ..., <other dense labels>: ..., candidate: ...}`` (ms): the
    candidate's speed-up vs dense fp32 eager and vs the fastest dense path timed with it (never above
    the first), which that was, and the times.

    >>> speedups({"fp32": 10.0, "bf16": 5.0, "sparse": 4.0})["speedup_vs_best_dense"]
    1.25
    """
    if "fp32" not in ms or candidate not in ms:
        raise ValueError(f"speedups needs 'fp32' and {candidate!r} times, got {sorted(ms)}")
    dense = {k: v for k, v in ms.items() if k != candidate}
    best = best_dense(dense)
    c = ms[candidate]
    return {
        "speedup_vs_dense": round(ms["fp32"] / c, 3),
        "speedup_vs_best_dense": round(dense[best] / c, 3),
        "best_dense": best,
        "dense_ms": round(ms["fp32"], 1),
        "best_dense_ms": round(dense[best], 1),
        "sparse_ms": round(c, 1),
    }
