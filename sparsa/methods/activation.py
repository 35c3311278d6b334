"""Activation sparsity as a :func:`sparsa.sparsify` config: the adaptive runtime of :mod:`sparsa.adaptive`.

``sparsa.sparsify(model, ActivationSparsity(...))`` makes every ``ReLU -> Conv2d / Linear`` pair of
``model`` sparsity-adaptive (the layers compact ``relu(x)`` into the ``relu_compact`` layout and run
the activation-sparse kernels where the cost model says it pays) and returns the model. It is
:func:`sparsa.adaptive.enable` with its settings held in a config; the runtime it starts (the per-layer
report, ``disable()``) is :func:`sparsa.adaptive.runtime_of` ``(model)``.

The runtime runs on the CPU; on a GPU its layers run dense. There, mark ReLU outputs with the
``masked`` layout instead (see ``docs/guide.md``): ``F.linear`` / ``F.conv2d`` then run sparsa's
activation-sparse Triton kernels.

>>> import torch, torch.nn as nn, sparsa
>>> from sparsa.methods.activation import ActivationSparsity
>>> net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
>>> net = sparsa.sparsify(net, ActivationSparsity(policy=sparsa.adaptive.Policy(force="sparse")))
>>> net(torch.randn(4, 8)).sum().backward()
>>> [(r["layer"], r["path"]) for r in sparsa.adaptive.runtime_of(net).report()]
[('0', 'dense'), ('2', 'sparse')]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from torch import nn

from ..adaptive.calibration import Calibration
from ..adaptive.compaction import DEFAULT_SLICE
from ..adaptive.enable import enable
from ..adaptive.policy import Policy
from ..adaptive.step_guard import StepGuard
from ..nn.config import FilterFn, SparsifyConfig

__all__ = ["ActivationSparsity"]


def _positive_int(value: object, arg: str, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{arg} must be a positive int, got {value!r}; e.g. {example}")


@dataclass
class ActivationSparsity(SparsifyConfig):
    """Turn on sparsity-adaptive training for the ``ReLU -> Conv2d / Linear`` pairs of a model.

    The arguments are those of :func:`sparsa.adaptive.enable`: ``every`` (monitor refresh period in
    calls), ``policy`` (hysteresis thresholds or a forced path), ``calibration`` (the cost table; the
    machine's cached one by default), ``slice`` (channels per slice of the ``relu_compact`` operand),
    ``pixels`` (monitor sample size), ``recalibrate``, ``retain_memory`` and ``guard``.
    ``sparsa.sparsify(model, config, filter_fn)`` makes only the Conv2d / Linear modules ``filter_fn``
    accepts adaptive.
    """

    every: int = 10
    policy: Optional[Policy] = None
    calibration: Optional[Calibration] = None
    slice: int = DEFAULT_SLICE
    pixels: int = 512
    recalibrate: bool = False
    retain_memory: bool = False
    guard: Union[bool, StepGuard] = True

    def __post_init__(self) -> None:
        _positive_int(self.every, "every", "every=10")
        _positive_int(self.pixels, "pixels", "pixels=512")
        _positive_int(self.slice, "slice", "slice=64")
        if self.policy is not None and not isinstance(self.policy, Policy):
            raise TypeError(f"policy must be a sparsa.adaptive.Policy or None, got {type(self.policy).__name__}")
        if self.calibration is not None and not isinstance(self.calibration, Calibration):
            raise TypeError(
                f"calibration must be a sparsa.adaptive.Calibration or None, got {type(self.calibration).__name__}"
            )
        if not isinstance(self.guard, (bool, StepGuard)):
            raise TypeError(f"guard must be True, False or a StepGuard, got {type(self.guard).__name__}")

    def apply(self, model: nn.Module, filter_fn: Optional[FilterFn] = None) -> None:
        enable(
            model,
            every=self.every,
            policy=self.policy,
            calibration=self.calibration,
            slice=self.slice,
            pixels=self.pixels,
            recalibrate=self.recalibrate,
            retain_memory=self.retain_memory,
            guard=self.guard,
            filter_fn=filter_fn,
        )
