"""Step guard: time whole training steps and send the model back to dense when adaptive is slower.

Per-layer predictions can all say "faster" while the step is slower: the glue around the sparse
GEMMs (compaction, packs, monitor, Python per layer) is not in any layer's cost model, and a cost
table measured under other conditions misleads. The guard measures what the user pays for.

A *step* is timed from a training forward of the root module to the last gradient accumulated into
one of its parameters before its next forward (forward + backward, the part the layers change; the
optimizer, data loading and anything else the process does in between are left out, so their noise
is too). Without parameter gradients (e.g. a frozen model) it is the time to the next forward. No
change to the training loop is needed. Forwards in eval mode or without autograd are not steps; they
break the chain instead.

After ``warmup`` steps the guard times ``window`` adaptive and ``window`` dense steps (every adaptive
layer suspended: PyTorch's dense op, no monitor), alternating step by step so that a drift of the
machine's speed (several percent within seconds on a shared host) falls on both alike, and compares the
medians. If adaptive is slower than ``margin`` x dense, the model stays dense; either way both are
timed again after ``recheck`` steps (doubling, up to ``max_recheck``), because sparsity changes as
training goes on. A comparison within ``tie`` (relative) of the margin is too close for one round:
another round is timed (up to ``max_rounds``) and the medians over all of them decide. Steps in which
a layer was calibrated are dropped (calibration times kernels).

Example::

    >>> from sparsa.adaptive.step_guard import StepGuard
    >>> g = StepGuard(warmup=0, window=3, recheck=10)
    >>> for ms in (10, 8, 10, 8, 10):           # adaptive, dense, adaptive, ... step by step
    ...     g.record(ms)
    >>> g.suspended                              # the next step is a dense one
    True
    >>> g.record(8)                              # dense is faster: the model stays dense
    >>> g.suspended, g.decision, g.phase
    (True, 'dense', 'hold')
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, List, Optional

from torch import nn
import torch

__all__ = ["StepGuard"]


class StepGuard:
    """The state machine of whole-step timing; :meth:`attach` hooks it to a model."""

    def __init__(
        self,
        warmup: int = 20,
        window: int = 5,
        recheck: int = 100,
        max_recheck: int = 1600,
        margin: float = 1.0,
        tie: float = 0.03,
        max_rounds: int = 3,
    ):
        for name, v, lo in (
            ("warmup", warmup, 0),
            ("window", window, 1),
            ("recheck", recheck, 1),
            ("max_recheck", max_recheck, 1),
            ("max_rounds", max_rounds, 1),
        ):
            if int(v) != v or int(v) < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        if not margin > 0:
            raise ValueError(
                f"margin must be > 0 (adaptive is kept when its step is below margin x dense), got {margin!r}"
            )
        if not 0 <= tie < 1:
            raise ValueError(
                f"tie must be in [0, 1) (a comparison within tie of the margin times another round), got {tie!r}"
            )
        self.warmup, self.window, self.margin = int(warmup), int(window), float(margin)
        self.tie, self.max_rounds = float(tie), int(max_rounds)
        self.recheck, self.max_recheck = int(recheck), int(max(recheck, max_recheck))
        #: True while the adaptive layers run dense (a dense window, or the guard's verdict)
        self.suspended = False
        #: "adaptive" / "dense" after the first comparison, None before
        self.decision: Optional[str] = None
        self.steps = 0
        self.adaptive_ms: Optional[float] = None
        self.dense_ms: Optional[float] = None
        self.comparisons: List[dict] = []
        self._phase = "warmup"
        self._left = self.warmup
        self._adaptive: List[float] = []  # every adaptive sample of the comparison under way
        self._dense: List[float] = []
        self._rounds = 0
        self._next_recheck = self.recheck
        self._last: Optional[float] = None
        self._grad_end: Optional[float] = None
        self._dirty = False
        self._handle = None
        self._grad_handles: list = []
        self._listeners: List[Callable[[bool], None]] = []
        if self._left == 0:
            self._start("adaptive")

    # ---------------------------------------------------------------------------- state machine
    def record(self, ms: float) -> None:
        """One step's time in milliseconds, on the path the layers are on now."""
        self.steps += 1
        if self._phase in ("adaptive", "dense"):
            self._measured(float(ms))
            return
        self._left -= 1
        if self._left <= 0:  # warm-up or hold over: time both paths
            self._start("adaptive")

    def _measured(self, ms: float) -> None:
        (self._dense if self._phase == "dense" else self._adaptive).append(ms)
        na, nd = len(self._adaptive), len(self._dense)
        if min(na, nd) >= self.window * (self._rounds + 1):
            self._rounds += 1
            a, d = statistics.median(self._adaptive), statistics.median(self._dense)
            if self._rounds >= self.max_rounds or abs(a / (self.margin * d) - 1.0) > self.tie:
                self._compare(a, d)
                return
        # the path with fewer samples next (dropped steps can unbalance them), else the other one
        nxt = "dense" if nd < na else "adaptive" if na < nd else ("adaptive" if self._phase == "dense" else "dense")
        self._start(nxt)

    def _start(self, phase: str) -> None:
        self._phase, self._left = phase, 0
        self._set_suspended(phase == "dense")

    def _compare(self, adaptive_ms: float, dense_ms: float) -> None:
        self.adaptive_ms, self.dense_ms = adaptive_ms, dense_ms
        keep = adaptive_ms <= self.margin * dense_ms
        self.decision = "adaptive" if keep else "dense"
        self.comparisons.append(
            {
                "step": self.steps,
                "adaptive_ms": adaptive_ms,
                "dense_ms": dense_ms,
                "rounds": self._rounds,
                "decision": self.decision,
            }
        )
        self._adaptive, self._dense, self._rounds = [], [], 0
        self._phase, self._left = "hold", self._next_recheck
        self._next_recheck = min(self.max_recheck, 2 * self._next_recheck)
        self._set_suspended(not keep)

    def _set_suspended(self, value: bool) -> None:
        if value != self.suspended:
            self.suspended = value
            for f in self._listeners:
                f(value)

    def on_change(self, listener: Callable[[bool], None]) -> None:
        """Call ``listener(suspended)`` whenever the layers switch between adaptive and suspended."""
        self._listeners.append(listener)

    @property
    def phase(self) -> str:
        """warmup, adaptive / dense (timing: the next step runs that path) or hold."""
        return self._phase

    @property
    def speedup(self) -> Optional[float]:
        """Dense step time over adaptive step time at the last comparison (None before one)."""
        if self.adaptive_ms is None or not self.dense_ms:
            return None
        return self.dense_ms / self.adaptive_ms

    # ---------------------------------------------------------------------------- wiring
    def mark_dirty(self) -> None:
        """The current step did something that is not steady-state work (e.g. calibrated a layer)."""
        self._dirty = True

    def attach(self, model: nn.Module) -> None:
        """Time steps from ``model``'s training forwards (a forward pre-hook on the root module)."""
        if self._handle is not None:
            raise RuntimeError("this StepGuard is already attached to a model")
        self._handle = model.register_forward_pre_hook(self._on_forward)
        for p in model.parameters():
            if p.requires_grad:
                self._grad_handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        for h in self._grad_handles:
            h.remove()
        self._grad_handles.clear()
        self._set_suspended(False)

    def _on_grad(self, param) -> None:
        self._grad_end = time.perf_counter()

    def _on_forward(self, module: nn.Module, args) -> None:
        now = time.perf_counter()
        if not (module.training and torch.is_grad_enabled()):
            self._last = None  # an evaluation forward: the interval around it is not a training step
            return
        if self._last is not None:
            end = self._grad_end if self._grad_end is not None and self._grad_end > self._last else now
            if not self._dirty:
                self.record((end - self._last) * 1e3)
        self._dirty = False
        self._grad_end = None
        self._last = time.perf_counter()

    def summary(self) -> dict:
        """The guard's state for reports: phase, decision, last medians, the comparisons so far."""
        return {
            "phase": self._phase,
            "decision": self.decision,
            "suspended": self.suspended,
            "steps": self.steps,
            "adaptive_step_ms": self.adaptive_ms,
            "dense_step_ms": self.dense_ms,
            "step_speedup": self.speedup,
            "comparisons": list(self.comparisons),
        }
