"""Policy: per layer, dense or sparse, from the monitored sparsity and the calibrated cost model.

A layer switches dense -> sparse when the predicted forward+backward speedup of the sparse path is
at least ``enter`` and back to dense when it drops below ``exit`` (hysteresis: a layer near the
break-even point does not flip-flop). ``force`` pins every layer to one path (for tests and A/B runs).
Layers on the sparse path predicted below ``verify_below`` are timed in training, both paths, and
the measurements correct their prediction (:mod:`sparsa.adaptive.feedback`); so are layers on the
dense path predicted at ``explore_above`` or more (near break-even, where a cost model fitted on other
inputs may be wrong either way). ``verify_below=0`` turns all timing off.

Example::

    >>> from sparsa.adaptive import Policy
    >>> p = Policy(enter=1.1, exit=1.02)
    >>> p.choose("dense", 1.05), p.choose("sparse", 1.05), p.choose("dense", 1.3)
    ('dense', 'sparse', 'sparse')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["Policy", "PATHS"]

PATHS = ("dense", "sparse")


@dataclass
class Policy:
    """Hysteresis thresholds on the predicted speedup (dense time / sparse time)."""

    enter: float = 1.10
    exit: float = 1.02
    force: Optional[str] = None
    verify_below: float = 1.3
    explore_above: float = 0.85

    def __post_init__(self):
        if self.force is not None and self.force not in PATHS:
            raise ValueError(f"force must be None, 'dense' or 'sparse', got {self.force!r}")
        if not (self.enter >= self.exit > 0):
            raise ValueError(
                f"need enter >= exit > 0, got enter={self.enter!r}, exit={self.exit!r}; "
                "e.g. Policy(enter=1.1, exit=1.02)"
            )
        if not self.verify_below >= 0:
            raise ValueError(f"verify_below must be >= 0 (0: no timing in training), got {self.verify_below!r}")
        if not self.explore_above > 0:
            raise ValueError(
                f"explore_above must be > 0 (a value >= enter times no dense layer), got {self.explore_above!r}"
            )

    def choose(self, current: str, speedup: Optional[float]) -> str:
        """The path for a layer now on ``current`` whose predicted speedup is ``speedup``."""
        if self.force is not None:
            return self.force
        if speedup is None:
            return current
        if current == "sparse":
            return "sparse" if speedup >= self.exit else "dense"
        return "sparse" if speedup >= self.enter else "dense"
