"""Adaptive layers: Conv2d / Linear that pick the dense or the sparse path per call.

A layer takes the sparse path only when its input is *known* to be a ReLU output (tagged by the
runtime's ReLU hook and unchanged since: the tag records the tensor's version counter), the shape is
supported by the native kernels, and the policy says the sparse path pays at the monitored
sparsity. Everything else runs PyTorch's own dense op, so results never depend on the path beyond
float rounding. The layers share their parameters with the modules they replace.

Example::

    >>> import torch, sparsa.adaptive as sa
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
    ...                           torch.nn.Conv2d(16, 16, 3, padding=1))
    >>> rt = sa.enable(net, policy=sa.Policy(force="sparse"))
    >>> type(net[2]).__name__, net(torch.randn(2, 3, 8, 8)).shape
    ('AdaptiveConv2d', torch.Size([2, 16, 8, 8]))
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .autocast import autocast_bf16, sparse_under_autocast
from .calibration import Calibration, CostEntry
from .conv import conv_supported, relu_conv2d
from .conv_union import kernel_family, union_path_supported_for
from .feedback import Feedback, time_backward
from .linear import linear_supported, relu_linear
from .monitor import SparsityMonitor
from .policy import Policy
from .step_guard import StepGuard

__all__ = ["AdaptiveConv2d", "AdaptiveLinear", "LayerState", "tag_nonnegative", "is_tagged_nonnegative"]

_TAG = "_sparsa_relu_version"


def tag_nonnegative(t: Tensor) -> None:
    """Mark ``t`` as a ReLU output (valid until ``t`` is modified in place)."""
    if isinstance(t, Tensor):
        setattr(t, _TAG, t._version)


def is_tagged_nonnegative(t: Tensor) -> bool:
    """True when ``t`` was tagged by :func:`tag_nonnegative` and has not been modified since."""
    v = getattr(t, _TAG, None)
    return v is not None and v == t._version


@dataclass
class LayerState:
    """What the runtime knows about one adaptive layer (read by the report)."""

    name: str
    kind: str
    monitor: SparsityMonitor
    policy: Policy
    calibration: Calibration
    slice: int
    path: str = "dense"
    supported: bool = True
    speedup: Optional[float] = None
    cost: Optional[CostEntry] = None
    calls: int = 0
    paired_calls: int = 0
    sparse_calls: int = 0
    fwd_ms: Dict[str, float] = field(default_factory=dict)
    switches: int = 0
    #: zero fraction of the output gradient dY (sampled in backward on refresh calls; None until then)
    grad_sparsity: Optional[float] = None
    grad_monitor: Optional[SparsityMonitor] = None
    #: how clustered relu(x)'s zeros are (UnionOperand.union_ratio), from the last refresh on the union
    #: kernels; scales the calibrated cost, which was measured on some input of this shape
    union_ratio: Optional[float] = None
    #: "union" or "list": the kernel family of the sparse path (set at the first decision)
    kernels: Optional[str] = None
    #: forward+backward times measured in training (layers predicted below Policy.verify_below)
    feedback: Feedback = field(default_factory=Feedback)
    #: the cost model's own prediction; ``speedup`` is this times the feedback's correction
    model_speedup: Optional[float] = None
    #: the runtime's whole-step guard (shared by every layer); while it is suspended the layer runs dense
    guard: Optional[StepGuard] = None

    def __deepcopy__(self, memo: dict) -> "LayerState":
        # the calibration is the machine's shared cost table (it holds a lock): a copied layer uses it too
        memo.setdefault(id(self.calibration), self.calibration)
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            setattr(new, k, copy.deepcopy(v, memo))
        return new

    def predicted_ms(self, path: str) -> Optional[float]:
        """The calibrated forward+backward time of ``path`` at the monitored sparsity (None before both exist)."""
        if self.cost is None or self.monitor.sparsity is None:
            return None
        if path == "dense":
            return self.cost.dense_ms
        gd = None if self.grad_sparsity is None else 1.0 - self.grad_sparsity
        return self.cost.sparse_ms(1.0 - self.monitor.sparsity, gd, self.union_ratio)


def _paired(state: LayerState, x: Tensor) -> bool:
    return (
        state.supported
        and x.device.type == "cpu"
        and is_tagged_nonnegative(x)
        and (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and autocast_bf16()))
    )


def _decide(state: LayerState, x: Tensor, weight: Tensor, bias: Optional[Tensor], conv_args: dict) -> None:
    if state.kernels is None:
        state.kernels = kernel_family(state.kind, x, weight, bias)
    if state.policy.force is not None:
        new = state.policy.force
    else:
        if state.cost is None:
            state.cost = state.calibration.entry(state.kind, x, weight, bias, conv_args, state.slice)
            if state.guard is not None:
                state.guard.mark_dirty()  # this step ran calibration timings: not a steady-state step
        density = 1.0 - (state.monitor.sparsity or 0.0)
        grad_density = None if state.grad_sparsity is None else 1.0 - state.grad_sparsity
        state.model_speedup = state.cost.speedup(density, grad_density, state.union_ratio)
        kappa = state.feedback.kappa()
        state.speedup = state.model_speedup * (1.0 if kappa is None else kappa)
        new = state.policy.choose(state.path, state.speedup)
    if new != state.path:
        state.switches += 1
        state.path = new


def _watch_grad(state: LayerState, y: Tensor) -> None:
    """Sample the zeros of dY when it arrives in backward (a tensor hook, this call only)."""
    if not (isinstance(y, Tensor) and y.requires_grad and torch.is_grad_enabled()):
        return
    if state.grad_monitor is None:
        m = state.monitor
        state.grad_monitor = SparsityMonitor(1, m.pixels, m.slice, seed=m.refreshes + 7919, elements=m.elements)

    def hook(g: Tensor) -> None:
        state.grad_monitor.observe(g)
        state.grad_sparsity = state.grad_monitor.sparsity

    y.register_hook(hook)


def _run(state: LayerState, x: Tensor, dense, sparse, weight, bias, conv_args) -> Tensor:
    state.calls += 1
    if not _paired(state, x) or (state.guard is not None and state.guard.suspended and state.policy.force is None):
        return dense(x)
    state.paired_calls += 1
    mon = state.monitor
    if mon.due():
        y = _run_paired(state, x, dense, sparse, weight, bias, conv_args)
        _watch_grad(state, y)
        return y
    return _run_paired(state, x, dense, sparse, weight, bias, conv_args)


def _verifying(state: LayerState) -> bool:
    """Whether this layer is timed in training: on the sparse path with a marginal prediction; on the dense
    path because the measurements vetoed what the cost model predicts (so it can come back), or because the
    prediction is near break-even (``Policy.explore_above``: the cost model, fitted on other inputs, may
    underrate the sparse path)."""
    p = state.policy
    if p.force is not None or state.speedup is None or state.cost is None:
        return False
    if state.path == "sparse":
        return state.speedup < p.verify_below
    if state.model_speedup is None:
        return False
    if state.model_speedup >= p.enter:
        return state.feedback.kappa() is not None
    return p.verify_below > 0 and state.model_speedup >= p.explore_above


def _run_paired(state: LayerState, x: Tensor, dense, sparse, weight, bias, conv_args) -> Tensor:
    mon = state.monitor
    timed = _verifying(state) and state.feedback.due()
    probe = timed and state.feedback.probe_now()  # this call runs the other path, to time it
    t0 = time.perf_counter()
    if (state.path == "sparse") != probe:
        refresh = mon.tick()
        stats: Optional[dict] = {} if refresh else None
        y = sparse(x, stats)
        if refresh:
            mon.record_count(stats["nnz"], x.numel())
            if stats.get("union_ratio") is not None:
                state.union_ratio = stats["union_ratio"]
            _decide(state, x, weight, bias, conv_args)
        state.sparse_calls += 1
        path = "sparse"
    else:
        if mon.observe(x):
            _decide(state, x, weight, bias, conv_args)
        if state.path == "sparse" and not probe:  # switched on this call
            y = sparse(x, None)
            state.sparse_calls += 1
            path = "sparse"
        else:
            y = dense(x)
            path = "dense"
    ms = (time.perf_counter() - t0) * 1e3
    prev = state.fwd_ms.get(path)
    state.fwd_ms[path] = ms if prev is None else 0.8 * prev + 0.2 * ms
    if timed:
        fb, pred = state.feedback, state.predicted_ms(path)
        time_backward(x, y, lambda bwd_ms: fb.add(path, ms + bwd_ms, pred))
    return y


def _adopt(cls: type, module: nn.Module) -> nn.Module:
    """A ``cls`` instance sharing ``module``'s attributes and its very same Parameter objects (so
    optimizers, hooks and state dicts keep working)."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    new.__dict__.update({k: v for k, v in module.__dict__.items() if k not in ("_parameters", "_buffers", "_modules")})
    new._parameters = module._parameters
    new._buffers = module._buffers
    new._modules = module._modules
    return new


class AdaptiveConv2d(nn.Conv2d):
    """``nn.Conv2d`` whose forward and backward use the activation-sparse kernels when they pay."""

    sparsa_state: LayerState

    @classmethod
    def from_module(cls, conv: nn.Conv2d, state: LayerState) -> "AdaptiveConv2d":
        new = _adopt(cls, conv)
        state.supported = conv_supported(conv.weight, conv.groups, conv.padding_mode, conv.padding)
        new.sparsa_state = state
        return new

    def _conv_args(self) -> dict:
        return dict(stride=self.stride, padding=self.padding, dilation=self.dilation)

    def forward(self, x: Tensor) -> Tensor:
        args = self._conv_args()
        return _run(
            self.sparsa_state,
            x,
            lambda t: self._conv_forward(t, self.weight, self.bias),
            lambda t, stats: sparse_under_autocast(
                lambda u: relu_conv2d(
                    u, self.weight, self.bias, slice=self.sparsa_state.slice, stats=stats, nonnegative=True, **args
                ),
                t,
                bf16_operands=autocast_bf16()
                and union_path_supported_for(torch.bfloat16, t.device, self.weight, self.bias),
            ),
            self.weight,
            self.bias,
            args,
        )


class AdaptiveLinear(nn.Linear):
    """``nn.Linear`` whose forward and backward use the activation-sparse kernels when they pay."""

    sparsa_state: LayerState

    @classmethod
    def from_module(cls, lin: nn.Linear, state: LayerState) -> "AdaptiveLinear":
        new = _adopt(cls, lin)
        state.supported = linear_supported(lin.weight)
        new.sparsa_state = state
        return new

    def forward(self, x: Tensor) -> Tensor:
        return _run(
            self.sparsa_state,
            x,
            lambda t: F.linear(t, self.weight, self.bias),
            lambda t, stats: sparse_under_autocast(
                lambda u: relu_linear(u, self.weight, self.bias, slice=self.sparsa_state.slice, stats=stats), t
            ),
            self.weight,
            self.bias,
            {},
        )
