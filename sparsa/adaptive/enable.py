"""``enable(model)``: one call that makes a model's ReLU -> Conv2d/Linear pairs sparsity-adaptive.

It replaces every ``nn.Conv2d`` / ``nn.Linear`` by an adaptive layer sharing the same parameters
(optimizers keep working), adds forward hooks that tag ``nn.ReLU`` outputs and carry the tag through
zero-preserving modules (max/avg pooling, dropout, flatten, identity), and returns a runtime handle
with the per-layer report. A layer whose input is not a tagged ReLU output always runs dense, so the
pairing is found at run time whatever the model's forward does (Sequential or hand-written, as in a
ResNet block). ``runtime.disable()`` restores the original modules. :func:`runtime_of` finds the
runtime of a model again (e.g. after ``sparsa.sparsify(model, ActivationSparsity())``, which calls
:func:`enable`).

Example::

    >>> import torch, sparsa.adaptive as sa
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    >>> rt = sa.enable(net, policy=sa.Policy(force="sparse"))
    >>> net(torch.randn(4, 8)).sum().backward()
    >>> [(r["layer"], r["path"]) for r in rt.report()]
    [('0', 'dense'), ('2', 'sparse')]
    >>> rt.disable(); type(net[2]).__name__
    'Linear'
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple, Union

from torch import nn

from .calibration import Calibration, default_calibration
from .compaction import DEFAULT_SLICE
from .modules import AdaptiveConv2d, AdaptiveLinear, LayerState, tag_nonnegative, is_tagged_nonnegative
from .monitor import SparsityMonitor
from .memory import retain_freed_memory
from .policy import Policy
from .report import report as _report, format_report
from .step_guard import StepGuard

__all__ = ["enable", "AdaptiveRuntime", "ZERO_PRESERVING", "runtime_of"]

# the model attribute that holds its runtime (a plain attribute: not a parameter, buffer or state-dict entry)
_RUNTIME_ATTR = "_sparsa_adaptive_runtime"

#: modules whose output is zero wherever all the inputs it reads are zero, and nonnegative for a
#: nonnegative input: a ReLU tag survives them
ZERO_PRESERVING: Tuple[type, ...] = (
    nn.MaxPool2d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool2d,
    nn.Dropout,
    nn.Flatten,
    nn.Identity,
)


def _tag_hook(module, inputs, output):
    tag_nonnegative(output)


def _carry_hook(module, inputs, output):
    if inputs and is_tagged_nonnegative(inputs[0]):
        tag_nonnegative(output)


class AdaptiveRuntime:
    """Handle returned by :func:`enable`: the adaptive layers, the report, ``disable()``."""

    def __init__(
        self,
        model: nn.Module,
        layers: Dict[str, LayerState],
        handles: list,
        replaced: List[Tuple[nn.Module, str, nn.Module, nn.Module]],
        guard: Optional[StepGuard] = None,
    ):
        self.model = model
        self.layers = layers
        self.guard = guard
        self._handles = handles
        self._replaced = replaced

    def report(self) -> List[dict]:
        """Per-layer rows: sparsity, chosen path, predicted speedup, measured forward time."""
        return _report(self)

    def format(self) -> str:
        """The report as a text table (and the step guard's verdict, when there is a guard)."""
        text = format_report(self.report())
        g = self.guard
        if g is not None:
            if g.decision is None:
                text += f"\nstep guard: no comparison yet ({g.steps} steps timed, phase {g.phase})"
            else:
                text += (
                    f"\nstep guard: {g.decision} (adaptive step {g.adaptive_ms:.1f} ms, dense step "
                    f"{g.dense_ms:.1f} ms: {g.speedup:.2f}x at step {g.comparisons[-1]['step']}; "
                    f"now {g.phase})"
                )
        return text

    def set_policy(self, policy: Policy) -> None:
        """Use ``policy`` from now on in every layer (the next refresh applies it)."""
        for st in self.layers.values():
            st.policy = policy
            if policy.force is not None:
                st.path = policy.force

    def disable(self) -> None:
        """Remove the hooks and put the original modules back."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.guard is not None:
            self.guard.detach()
        for parent, attr, original, _ in self._replaced:
            setattr(parent, attr, original)
        self._replaced.clear()
        if self.model.__dict__.get(_RUNTIME_ATTR) is self:
            del self.model.__dict__[_RUNTIME_ATTR]

    def __deepcopy__(self, memo: dict) -> None:
        # hooks and replaced modules belong to the original model: a deep copy of the model keeps its
        # adaptive layers and ReLU hooks but has no runtime handle (runtime_of(copy) is None)
        return None


def runtime_of(model: nn.Module) -> Optional[AdaptiveRuntime]:
    """The :class:`AdaptiveRuntime` that :func:`enable` (or ``sparsa.sparsify(model, ActivationSparsity())``)
    returned for ``model``; None when activation sparsity is not on (or was disabled).

    >>> import torch, sparsa
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    >>> net = sparsa.sparsify(net, sparsa.ActivationSparsity())
    >>> sparsa.adaptive.runtime_of(net).layers.keys()
    dict_keys(['0', '2'])
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    rt = model.__dict__.get(_RUNTIME_ATTR)
    return rt if isinstance(rt, AdaptiveRuntime) else None


def enable(
    model: nn.Module,
    *,
    every: int = 10,
    policy: Optional[Policy] = None,
    calibration: Optional[Calibration] = None,
    slice: int = DEFAULT_SLICE,
    pixels: int = 512,
    recalibrate: bool = False,
    retain_memory: bool = False,
    guard: Union[bool, StepGuard] = True,
    filter_fn: Optional[Callable[[nn.Module, str], bool]] = None,
) -> AdaptiveRuntime:
    """Make ``model`` sparsity-adaptive in place and return the runtime handle.

    ``every``: monitor refresh period in calls; ``policy``: hysteresis thresholds or a forced path;
    ``calibration``: the cost table (default: the machine's cached one; ``recalibrate=True`` clears
    it first); ``slice``: channels per K-slice of the sparse kernels; ``pixels``: monitor sample size;
    ``retain_memory``: opt in to keeping freed heap memory in the process (glibc ``mallopt``, see
    :func:`sparsa.adaptive.memory.retain_freed_memory`), so the per-step buffers of both the sparse and
    the dense layers stop page-faulting every step; it changes the allocator of the whole process for
    its lifetime, so it is off by default; ``guard``: time whole training steps and run the
    model dense while its adaptive steps are slower than its dense ones (:mod:`sparsa.adaptive.step_guard`;
    ``True``: the default :class:`StepGuard`, ``False``: none; never with a forced policy);
    ``filter_fn(module, name) -> bool``: only the ``nn.Conv2d`` / ``nn.Linear`` modules it accepts become
    adaptive (a filter that accepts none is a ValueError). :func:`runtime_of` returns the runtime later.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if any(isinstance(m, (AdaptiveConv2d, AdaptiveLinear)) for m in model.modules()):
        raise ValueError("model is already adaptive; call runtime.disable() before enabling again")
    if not isinstance(guard, (bool, StepGuard)):
        raise TypeError(f"guard must be True, False or a StepGuard, got {type(guard).__name__}")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"filter_fn must be a callable filter_fn(module, name) -> bool or None, got {filter_fn!r}")
    policy = policy if policy is not None else Policy()
    if guard is True and policy.force is None:
        guard = StepGuard()
    elif guard is False or policy.force is not None:
        guard = None
    calibration = calibration if calibration is not None else default_calibration()
    if recalibrate:
        calibration.clear()
    if retain_memory:
        retain_freed_memory()
    handles, targets = [], []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ReLU):
            handles.append(mod.register_forward_hook(_tag_hook))
        elif isinstance(mod, ZERO_PRESERVING):
            handles.append(mod.register_forward_hook(_carry_hook))
        for attr, child in mod.named_children():
            full = f"{name}.{attr}" if name else attr
            if type(child) in (nn.Conv2d, nn.Linear) and (filter_fn is None or filter_fn(child, full)):
                targets.append((mod, attr, child, full))
    if filter_fn is not None and not targets:
        for h in handles:
            h.remove()
        raise ValueError(
            "filter_fn accepts none of the model's nn.Conv2d / nn.Linear modules; fix it so it returns "
            "True for the layers to make activation-sparse"
        )
    layers: Dict[str, LayerState] = {}
    replaced = []
    for parent, attr, child, full in targets:
        kind = "conv2d" if isinstance(child, nn.Conv2d) else "linear"
        st = LayerState(
            full,
            kind,
            SparsityMonitor(every, pixels, slice, seed=len(layers)),
            policy,
            calibration,
            int(slice),
            guard=guard,
        )
        cls = AdaptiveConv2d if kind == "conv2d" else AdaptiveLinear
        new = cls.from_module(child, st)
        if policy.force is not None:
            st.path = policy.force
        setattr(parent, attr, new)
        replaced.append((parent, attr, child, new))
        layers[full] = st
    if guard is not None:
        guard.attach(model)
    rt = AdaptiveRuntime(model, layers, handles, replaced, guard)
    model.__dict__[_RUNTIME_ATTR] = rt
    return rt
