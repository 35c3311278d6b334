"""Feedback: measured forward+backward times that correct a layer's calibrated cost model.

The cost model is calibrated once per layer shape, on some input, on a machine whose speed drifts;
a layer predicted just above break-even can run below it in training. So layers on the sparse path whose predicted
speedup is marginal (below ``Policy.verify_below``) are timed in training: every ``every``-th call
the runtime times the layer's forward and, through tensor hooks, its backward (from dY's arrival to
dX's), and every ``probe_every``-th timed call it runs the dense path instead (a probe) so both sides
are measured under the same conditions. Layers on the dense path predicted near break-even
(``Policy.explore_above``) are timed the same way, their probes running the sparse path, so a layer the
cost model underrates is found. Each sample is divided by what the cost model predicts for
it (so samples at different sparsities compare), and the correction

    kappa = median(dense measured / predicted) / median(sparse measured / predicted)

multiplies the predicted speedup from then on (clamped to [0.5, 2]). A layer the correction sent back
to dense while the cost model alone would keep it sparse stays timed, its probes running the sparse
path, so it returns when the measurements improve. The first sample of each path is dropped
(first-call costs). Calls without autograd (inference) or whose input needs no gradient are not timed.

Example::

    >>> from sparsa.adaptive.feedback import Feedback
    >>> fb = Feedback()
    >>> for ms in (9.0, 10.0, 10.0, 10.0):        # dense calls: measured 10 ms, predicted 10 ms
    ...     fb.add("dense", ms, 10.0)
    >>> for ms in (9.0, 12.0, 12.0, 12.0):        # sparse calls: measured 12 ms, predicted 8 ms
    ...     fb.add("sparse", ms, 8.0)
    >>> round(fb.kappa(), 3)                       # the model's 1.25x is really 10 / 12 = 0.83x
    0.667
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Callable, Deque, Dict, Optional

import torch
from torch import Tensor

__all__ = ["Feedback", "time_backward"]


class Feedback:
    """Measured/predicted time ratios of one layer's two paths (the last ``window`` of each)."""

    def __init__(self, window: int = 5, every: int = 3, probe_every: int = 4):
        for name, v in (("window", window), ("every", every), ("probe_every", probe_every)):
            if int(v) < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        self.window, self.every, self.probe_every = int(window), int(every), int(probe_every)
        self.errors: Dict[str, Deque[float]] = {"dense": deque(maxlen=self.window), "sparse": deque(maxlen=self.window)}
        self.measured: Dict[str, Deque[float]] = {
            "dense": deque(maxlen=self.window),
            "sparse": deque(maxlen=self.window),
        }
        self.seen = {"dense": 0, "sparse": 0}
        self.calls = 0
        self.timed = 0
        self.probes = 0

    def due(self) -> bool:
        """Count one call; True when this call is timed."""
        due = self.calls % self.every == 0
        self.calls += 1
        return due

    def probe_now(self) -> bool:
        """On a timed call: whether the layer runs its other path instead. Twice as often until the
        dense side has 2 samples."""
        k = self.timed
        self.timed += 1
        period = self.probe_every if len(self.errors["dense"]) >= 2 else max(1, self.probe_every // 2)
        probe = k % period == period - 1
        self.probes += probe
        return probe

    def add(self, path: str, measured_ms: float, predicted_ms: Optional[float]) -> None:
        """Record one forward+backward time of ``path`` and the cost model's prediction for it."""
        if path not in self.errors:
            raise ValueError(f"path must be 'dense' or 'sparse', got {path!r}")
        self.seen[path] += 1
        if self.seen[path] == 1 or predicted_ms is None or predicted_ms <= 0:
            return  # the first call of a path pays one-off costs
        self.errors[path].append(measured_ms / predicted_ms)
        self.measured[path].append(measured_ms)

    def kappa(self) -> Optional[float]:
        """The correction of the predicted speedup, or None until each path has 2 samples."""
        if len(self.errors["dense"]) < 2 or len(self.errors["sparse"]) < 2:
            return None
        k = statistics.median(self.errors["dense"]) / statistics.median(self.errors["sparse"])
        return min(2.0, max(0.5, k))

    def measured_speedup(self) -> Optional[float]:
        """Median measured dense time over median measured sparse time (None until both have 2 samples;
        the samples may come from different sparsities, see :meth:`kappa` for the normalised form)."""
        if len(self.measured["dense"]) < 2 or len(self.measured["sparse"]) < 2:
            return None
        return statistics.median(self.measured["dense"]) / statistics.median(self.measured["sparse"])


def time_backward(x: Tensor, y: Tensor, done: Callable[[float], None]) -> bool:
    """Call ``done(ms)`` with the time from dY's arrival at ``y`` to dX's at ``x`` in the coming backward
    (this call only). Returns False (and times nothing) when there is no backward to time."""
    if not (
        torch.is_grad_enabled()
        and isinstance(y, Tensor)
        and y.requires_grad
        and isinstance(x, Tensor)
        and x.requires_grad
    ):
        return False
    start = []

    def on_dy(g: Tensor) -> None:
        start.append(time.perf_counter())

    def on_dx(g: Tensor) -> None:
        if start:
            done((time.perf_counter() - start[0]) * 1e3)
            start.clear()

    y.register_hook(on_dy)
    x.register_hook(on_dx)
    return True
