"""Recovery to high sparsity: gradual pruning plus distillation from the dense teacher, on a clock.

One-shot pruning at 75-90% destroys a model; pruning *while* fine-tuning towards the dense model
keeps much more of it (Zhu & Gupta 2017; oBERT, Kurtic et al. 2022). :func:`recover` runs that
recipe on the CPU for a wall-clock ``time_budget``:

1. optionally, a one-shot start (``init="magnitude" | "wanda" | "sparsegpt"``) at ``init_sparsity``
   (default: the target itself);
2. gradual pruning with the cubic schedule (:class:`~sparsa.sparsifiers.CubicSchedule`, applied by
   :class:`~sparsa.methods.GradualPruning`), from each layer's starting sparsity to its target,
   reached at 70% of the budget (of ``steps`` when given); the schedule's steps run on the clock
   (1,000 ticks over the pruning window), so the final sparsity is reached on time however fast
   the steps are;
3. fine-tuning at the final pattern for the rest of the budget, the learning rate decaying linearly;
4. every pruned weight stored in the pattern's layout (exactly the pattern, at the target).

The loss is :func:`~sparsa.methods.distillation_loss` between the student's and the teacher's
outputs (``1 - cos`` + normalised MSE per output tensor): return a sentence embedding and hidden
states from ``forward`` to distil both. The data is unlabeled: a list of model inputs, cycled.

Patterns (the strings of ``sparsa prune --pattern``): ``"unstructured"`` (per output row; layout
``"masked"``, or ``"sliced_ell"``...), ``"N:M"`` such as ``"2:4"`` or ``"4:8"`` (layout ``"nm"``;
``layout="grouped_nm"`` stores it as grouped N:M), ``"grouped_N:M"`` (e.g. ``"grouped_2:4"``) and
``"row_group<G>"`` (``"row_group16"``...). While the sparsity grows, a fixed-density pattern (N:M)
is approached by keeping its survivors plus the largest other weights (so the pattern is met
exactly at the end); the weights train in the ``"masked"`` layout, as plain Parameters on its values
(:class:`~sparsa.methods.plain_masked.PlainMaskedWeights`: PyTorch's own forward and autocast, a fused
AdamW), and move to their layout at the end.

>>> import copy, torch, torch.nn as nn
>>> _ = torch.manual_seed(0)
>>> teacher = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
>>> model = copy.deepcopy(teacher)
>>> report = recover(model, teacher, [torch.randn(16, 16) for _ in range(4)], target_sparsity=0.75,
...                  steps=20, progress=False)
>>> report.steps, model[0].weight.layout_name, model[0].weight.sparsity, report.sparsity["2"]
(20, 'masked', 0.75, 0.75)
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ..layouts.base import check_fraction, get_layout
from ..nn import Rule
from ..sparsifiers import NM, ConstantSparsity, CubicSchedule, GroupedNM
from ..sparsifiers.base import Sparsifier, top_mask
from ..sparsifiers.pattern_names import parse_pattern
from ..tensor import SparseTensor, to_dense, to_sparse
from .allocation import check_allocation, owl_sparsities
from .distill import distillation_loss
from .gradual import GradualPruning
from .pattern import set_pattern
from .plain_masked import PlainMaskedWeights

__all__ = ["recover", "RecoverReport", "pattern_sparsifier", "INITS", "PRUNE_FRACTION"]

INITS = ("magnitude", "wanda", "sparsegpt")
#: what the gradual schedule ranks weights by (``recover(prune_by=...)``)
PRUNE_BY = ("magnitude", "wanda")
#: the fraction of the budget (time or steps) by which the final sparsity is reached
PRUNE_FRACTION = 0.7
_TICKS = 1000  # schedule steps over the pruning window when it runs on the clock
_EVENTS = 20  # pruning events over the pruning window

Forward = Callable[[nn.Module, Any], Any]


@dataclass
class RecoverReport:
    """What :func:`recover` did. ``sparsity``/``targets``: per layer, measured on the final weights /
    asked for; ``losses``: the distillation loss of every step; ``final_step``: the step at which the
    final sparsity was applied (``steps`` if only at the end)."""

    steps: int
    seconds: float
    pattern: str
    layout: str
    sparsity: Dict[str, float]
    targets: Dict[str, float]
    losses: List[float] = field(repr=False)
    final_step: int = 0
    init: Optional[str] = None
    init_seconds: float = 0.0
    checkpoint: Optional[str] = None

    @property
    def overall_sparsity(self) -> float:
        """Sparsity of all the pruned weights together (weighted by size)."""
        return 1.0 - sum(self._kept.values()) / sum(self._numel.values()) if self._numel else 0.0

    _numel: Dict[str, int] = field(default_factory=dict, repr=False)
    _kept: Dict[str, int] = field(default_factory=dict, repr=False)


# ----------------------------------------------------------------------------- patterns
class _Toward(Sparsifier):
    """A fixed-density pattern (N:M, grouped N:M) approached from below: keep the pattern's
    survivors plus the largest other values, ``1 - sparsity`` of the tensor in all; at the pattern's
    own sparsity (or above) exactly the pattern."""

    name = "toward"

    def __init__(self, base: Sparsifier, sparsity: float = 0.0):
        self.base, self.sparsity = base, check_fraction(sparsity, "sparsity")

    def _mask(self, dense: Tensor) -> Tensor:
        keep = self.base.mask(dense)
        want = dense.numel() - int(round(self.sparsity * dense.numel()))
        if want <= int(keep.sum()):
            return keep
        mag = dense.abs().float().reshape(-1)
        score = torch.where(keep.reshape(-1), mag.max() + 1.0, mag)
        return top_mask(score, want).reshape(dense.shape)

    def layout_params(self):
        return self.base.layout_params()

    def _repr_args(self):
        return {"base": self.base, "sparsity": self.sparsity}


class _InputWeighted(Sparsifier):
    """``base`` ranking ``|W| * input_norm.read()`` (Wanda's score) instead of ``|W|``: the gradual
    schedule's sparsifier when ``recover(prune_by="wanda")``."""

    name = "input_weighted"

    def __init__(self, base: Sparsifier, input_norm: "_InputNorm"):
        self.base, self.input_norm = base, input_norm

    def with_sparsity(self, sparsity: float) -> Sparsifier:
        return _InputWeighted(self.base.with_sparsity(sparsity), self.input_norm)

    def _mask(self, dense: Tensor) -> Tensor:
        norm = self.input_norm.read().to(dense.device)
        # a floor keeps a kept weight of a silent input above the zeros already pruned
        return self.base.mask(dense.abs() * norm.clamp_min(norm.max().clamp_min(1e-30) * 1e-6))

    def layout_params(self):
        return self.base.layout_params()

    def _repr_args(self):
        return {"base": self.base}


class _InputNorm:
    """The root mean square of each input feature of a Linear over the student's forwards since the
    last :meth:`read` (all ones before the first forward), collected by a forward pre-hook."""

    def __init__(self, module: nn.Module):
        self.sumsq = torch.zeros(module.in_features, dtype=torch.float64)
        self.rows = 0
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module: nn.Module, args: Tuple[Any, ...]) -> None:
        x = args[0].detach()
        self.sumsq += x.reshape(-1, x.shape[-1]).float().pow(2).sum(0).to(self.sumsq)
        self.rows += x.numel() // x.shape[-1]

    def read(self) -> Tensor:
        if not self.rows:
            return torch.ones(self.sumsq.numel())
        out = (self.sumsq / self.rows).sqrt().float()
        self.sumsq.zero_()
        self.rows = 0
        return out


def _fixed_sparsity(sp: Sparsifier) -> Optional[float]:
    return 1.0 - sp.n / sp.m if isinstance(sp, (NM, GroupedNM)) else None


def pattern_sparsifier(pattern: str, sparsity: float, layout: Optional[str] = None) -> Tuple[Sparsifier, str]:
    """``(sparsifier, layout)`` of a pattern name at ``sparsity``: :func:`sparsa.sparsifiers.parse_pattern`
    as a pair, ``layout`` (when given) replacing the pattern's natural one.

    >>> pattern_sparsifier("2:4", 0.5, "grouped_nm")
    (GroupedNM(n=2, m=4, g=4), 'grouped_nm')
    """
    p = parse_pattern(pattern, sparsity, layout)
    return p.sparsifier, layout or p.layout


def _check_layout(sp: Sparsifier, layout: str, pattern: str) -> Dict[str, Any]:
    """The layout parameters for ``sp``; raises ``ValueError`` naming ``layout`` if it cannot store
    the pattern (tried on a small random weight)."""
    try:
        get_layout(layout)
    except ValueError as e:
        raise ValueError(f"layout: {e}") from None
    params = Rule(sparsifier=sp, layout=layout).resolved_layout_params()
    probe = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    try:
        to_sparse(probe, layout, mask=sp.mask(probe), **params)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"layout {layout!r} cannot store pattern {pattern!r}: "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None
    return params


# ----------------------------------------------------------------------------- helpers
def _default_forward(model: nn.Module, batch: Any) -> Any:
    return model(**batch) if isinstance(batch, Mapping) else model(batch)


def _tensors(out: Any) -> List[Tensor]:
    """The floating-point tensors of a model output (a tensor, a tuple/list, a dict or a Hugging Face
    ``ModelOutput``), in order, nested tuples (e.g. ``hidden_states``) flattened."""
    if isinstance(out, Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, Mapping):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    return []


def _linear_names(model: nn.Module, names: Optional[Sequence[str]]) -> List[str]:
    if names is None:
        found = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        if not found:
            raise ValueError("model has no nn.Linear layers to prune; pass names=[...] of Linear modules")
        return found
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"names must be a list of nn.Linear module names, got {names!r}")
    names = list(dict.fromkeys(names))
    if not names:
        raise ValueError("names is empty: pass the nn.Linear module names to prune (or None for all)")
    mods = dict(model.named_modules())
    bad = [n for n in names if not isinstance(mods.get(n), nn.Linear)]
    if bad:
        raise ValueError(f"names: {bad[:5]} are not nn.Linear modules of the model")
    return names


def _layer_sparsity(w: Tensor) -> float:
    if isinstance(w, SparseTensor):
        return 1.0 - w.nnz / w.numel()
    return (w == 0).float().mean().item()


class _Progress:
    """tqdm when installed, else one printed line every ~5% (to stderr)."""

    def __init__(self, enabled: bool, total: float, unit: str):
        self.enabled, self.total, self.unit, self.bar, self.shown = enabled, total, unit, None, 0.0
        if enabled:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=round(total, 1), desc="recover", unit=unit)
            except ImportError:
                pass

    def update(self, done: float, step: int, loss: float, sparsity: float) -> None:
        if not self.enabled:
            return
        done = min(done, self.total)
        if self.bar is not None:
            self.bar.n = round(done, 1)
            self.bar.set_postfix(step=step, loss=f"{loss:.4f}", sparsity=f"{sparsity:.3f}", refresh=False)
            self.bar.refresh()
        elif done >= self.shown + 0.05 * self.total or done >= self.total:
            self.shown = done
            print(
                f"recover: {done:.0f}/{self.total:.0f} {self.unit}  step {step}  loss {loss:.4f}  "
                f"sparsity {sparsity:.3f}",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _remove_hooks(norms: Dict[str, _InputNorm]) -> None:
    for n in norms.values():
        n.handle.remove()


# ----------------------------------------------------------------------------- one-shot start
def _one_shot(
    model: nn.Module,
    init: str,
    names: List[str],
    sp_at: Callable[[str, float], Sparsifier],
    init_targets: Dict[str, float],
    calibration: List[Any],
    forward: Forward,
) -> None:
    """Prune ``names`` once to ``init_targets`` with ``init``; the weights end in the masked layout."""
    from .calibration import collect_input_stats
    from .sparsegpt import _sparsegpt
    from .wanda import WandaSparsifier

    if init == "magnitude":
        for n in names:
            w = model.get_submodule(n).weight
            set_pattern(w, sp_at(n, init_targets[n]).mask(w.sparse_layout.to_dense()))
        return
    if init == "wanda":
        stats = collect_input_stats(model, calibration, forward, names)
        for n in names:
            w = model.get_submodule(n).weight
            set_pattern(w, WandaSparsifier(sp_at(n, init_targets[n]), stats[n].norm).mask(w.sparse_layout.to_dense()))
        return
    # SparseGPT (block by block for transformers), each layer at its own sparsity; stays masked
    per_layer = {n: sp_at(n, init_targets[n]) for n in names}
    _sparsegpt(
        model,
        calibration,
        per_layer[names[0]],
        "masked",
        names,
        forward=forward,
        sparsities={n: sp.sparsity for n, sp in per_layer.items()},
    )


def _adamw(params: List[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """AdamW without weight decay, fused (one kernel over all tensors) where PyTorch supports it."""
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
    except (RuntimeError, ValueError):  # e.g. a device or dtype without the fused kernel
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


# ----------------------------------------------------------------------------- the pipeline
def recover(
    model: nn.Module,
    teacher: nn.Module,
    batches: Sequence[Any],
    *,
    target_sparsity: float,
    pattern: str = "unstructured",
    time_budget: float = 600.0,
    names: Optional[Sequence[str]] = None,
    forward: Optional[Forward] = None,
    lr: float = 2e-4,
    init: Optional[str] = None,
    calibration: Optional[Sequence[Any]] = None,
    allocation: Union[None, str, Mapping[str, float]] = None,
    checkpoint: Optional[Union[str, os.PathLike]] = None,
    progress: bool = True,
    layout: Optional[str] = None,
    steps: Optional[int] = None,
    init_sparsity: Optional[float] = None,
    loss: Callable[[Any, Any], Tensor] = distillation_loss,
    optimizer: Optional[Callable[[List[nn.Parameter]], torch.optim.Optimizer]] = None,
    teacher_cache_bytes: int = 1 << 30,
    dropout: Optional[float] = 0.0,
    prune_by: str = "magnitude",
    autocast: Optional[torch.dtype] = None,
) -> RecoverReport:
    """Prune ``model`` in place to ``target_sparsity`` in ``pattern`` while distilling it towards
    ``teacher`` (the dense model, e.g. ``copy.deepcopy(model)`` taken before), for ``time_budget``
    wall-clock seconds (or exactly ``steps`` optimizer steps when given). Returns a :class:`RecoverReport`.

    Args:
        batches: unlabeled model inputs (e.g. tokenized dicts), cycled in order.
        target_sparsity: the overall fraction of the pruned weights removed, in [0, 1); for N:M
            patterns it must be ``1 - N/M``.
        pattern, layout: see the module docstring (``layout=None``: the pattern's natural one).
        names: the ``nn.Linear`` modules to prune (default: every one).
        forward: ``forward(model, batch)`` -> outputs (a tensor, a list of them, a dict or a
            ``ModelOutput``; every floating-point tensor is distilled). Default ``model(**batch)``
            for dicts, else ``model(batch)``.
        lr: AdamW learning rate (``optimizer``: a factory ``params -> Optimizer`` instead).
        init: ``None`` (gradual from the current weights), or a one-shot start at
            ``init_sparsity``: ``"magnitude"``, ``"wanda"`` or ``"sparsegpt"``, calibrated on
            ``calibration`` (default: the first 8 of ``batches``). ``init_sparsity`` defaults to the
            target (one-shot, then the whole budget distils at the final pattern: best for short
            budgets); a lower one leaves the rest to the gradual schedule.
        allocation: per-layer sparsity: ``None`` (uniform), ``"owl"``
            (:func:`~sparsa.methods.owl_sparsities` on ``calibration``) or ``{name: sparsity}``.
        checkpoint: a path: the final model is written there with :func:`sparsa.save`.
        progress: a progress bar (tqdm if installed, else a printed line every 5%).
        loss: ``loss(student_outputs, teacher_outputs)`` (default :func:`distillation_loss`).
        teacher_cache_bytes: the teacher's outputs of each batch are kept, up to this many bytes in
            all, and reused when the batches cycle (the teacher is fixed and in eval mode, so its
            outputs do not change); ``0`` recomputes them every step. Batches beyond the limit are
            recomputed.
        dropout: the probability of every ``nn.Dropout`` of the student while it distils (restored
            afterwards); ``None`` keeps the model's own. Off by default: the student matches a
            deterministic teacher, and dropout noise only slows that.
        prune_by: what the gradual schedule ranks: ``"magnitude"`` (``|W|``) or ``"wanda"``
            (``|W| * ||X||``, ``||X||`` the root mean square of each input feature over the student's
            forwards since the last pruning event).
        autocast: ``torch.bfloat16`` (or ``torch.float16``) runs the student's forward under
            ``torch.autocast`` on its device (mixed precision: fp32 master weights, optimizer and loss);
            ``None`` trains in the model's dtype. The teacher's outputs stay in its own dtype.

    The budget covers calibration, the one-shot start and training (a step starts only if, at the mean
    step time so far, it ends within the budget); the student trains in train
    mode (its dropout on), the teacher runs in eval mode without gradients and is never changed.
    """
    t_start = time.perf_counter()
    # --------------------------------------------------------------- arguments
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(teacher, nn.Module):
        raise TypeError(f"teacher must be an nn.Module (the dense model), got {type(teacher).__name__}")
    if teacher is model:
        raise ValueError(
            "teacher is the same object as model; pass a dense copy taken before pruning, "
            "e.g. teacher = copy.deepcopy(model)"
        )
    shared = {id(p) for p in teacher.parameters()} & {id(p) for p in model.parameters()}
    if shared:
        raise ValueError(
            f"teacher shares {len(shared)} parameter(s) with model, so training would change the "
            "teacher; pass teacher = copy.deepcopy(model)"
        )
    target = check_fraction(target_sparsity, "target_sparsity")
    if (
        isinstance(time_budget, bool)
        or not isinstance(time_budget, (int, float))
        or not math.isfinite(time_budget)
        or time_budget <= 0
    ):
        raise ValueError(f"time_budget must be a positive number of seconds, got {time_budget!r}")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0):
        raise ValueError(f"steps must be a positive int (or None to run for time_budget), got {steps!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    if dropout is not None and (
        isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0
    ):
        raise ValueError(f"dropout must be a probability in [0, 1), or None for the model's own, got {dropout!r}")
    if isinstance(teacher_cache_bytes, bool) or not isinstance(teacher_cache_bytes, int) or teacher_cache_bytes < 0:
        raise ValueError(
            f"teacher_cache_bytes must be a non-negative int (0 turns the cache off), got {teacher_cache_bytes!r}"
        )
    if prune_by not in PRUNE_BY:
        raise ValueError(f"prune_by must be one of {PRUNE_BY}, got {prune_by!r}")
    if autocast is not None and autocast not in (torch.bfloat16, torch.float16):
        raise ValueError(f"autocast must be None, torch.bfloat16 or torch.float16, got {autocast!r}")
    if init is not None and init not in INITS:
        raise ValueError(f"init must be None or one of {INITS}, got {init!r}")
    if isinstance(batches, (Tensor, Mapping)) or not hasattr(batches, "__iter__"):
        raise TypeError(f"batches must be a list of model inputs (e.g. tokenized dicts), got {type(batches).__name__}")
    batches = list(batches)
    if not batches:
        raise ValueError("batches is empty: pass a list of unlabeled model inputs to distil on")
    calibration = list(calibration) if calibration is not None else batches[:8]
    if not calibration:
        raise ValueError("calibration is empty: pass a few model inputs (or None to use the first batches)")
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True or False, got {progress!r}")
    forward = forward or _default_forward
    if not callable(forward):
        raise TypeError(f"forward must be a function (model, batch) -> outputs, got {type(forward).__name__}")
    names = _linear_names(model, names)
    final_sp, layout = pattern_sparsifier(pattern, target, layout)
    layout_params = _check_layout(final_sp, layout, pattern)
    fixed = _fixed_sparsity(final_sp)
    if fixed is not None and not math.isclose(target, fixed, abs_tol=1e-3):
        raise ValueError(
            f"target_sparsity {target} does not match pattern {pattern!r}, which keeps "
            f"{final_sp.n} of every {final_sp.m} weights (sparsity {fixed:g}); pass "
            f"target_sparsity={fixed:g} or another pattern"
        )
    if isinstance(allocation, str) and allocation != "owl":
        raise ValueError(
            f"allocation must be None (uniform), 'owl' or a dict {{layer name: sparsity}}, got {allocation!r}"
        )
    if allocation is not None and fixed is not None:
        raise ValueError(
            f"allocation: pattern {pattern!r} has a fixed sparsity ({fixed:g}) in every layer; "
            "per-layer sparsity needs 'unstructured' or 'row_group<G>'"
        )
    targets = check_allocation(allocation, names)
    if init_sparsity is not None:
        init_sparsity = check_fraction(init_sparsity, "init_sparsity")
        if init is None:
            raise ValueError("init_sparsity needs init= (the one-shot method that prunes to it)")

    # --------------------------------------------------------------- per-layer targets and sparsifiers
    if allocation == "owl":
        targets = owl_sparsities(model, names, calibration, target, forward=forward)
    if targets is None:
        targets = {n: target for n in names}

    def sp_at(n: str, s: float) -> Sparsifier:
        """The pattern's sparsifier at sparsity ``s`` (fixed patterns: approached from below)."""
        return _Toward(final_sp, min(s, fixed)) if fixed is not None else final_sp.with_sparsity(s)

    # --------------------------------------------------------------- train in the masked layout
    trainable = {}
    for n in names:
        m = model.get_submodule(n)
        w = m.weight
        trainable[n] = w.requires_grad
        dense = to_dense(w).detach() if isinstance(w, SparseTensor) else w.detach()
        mask = w.sparse_layout.mask() if isinstance(w, SparseTensor) else torch.ones_like(dense, dtype=torch.bool)
        m.weight = nn.Parameter(to_sparse(dense, "masked", mask=mask), requires_grad=trainable[n])
    t0 = time.perf_counter()
    if init is not None:
        init_targets = {n: targets[n] if init_sparsity is None else min(init_sparsity, targets[n]) for n in names}
        _one_shot(model, init, names, sp_at, init_targets, calibration, forward)
    init_seconds = time.perf_counter() - t0
    start = {n: min(_layer_sparsity(model.get_submodule(n).weight), targets[n]) for n in names}

    # --------------------------------------------------------------- schedule
    clock = steps is None
    end_step = _TICKS if clock else max(1, round(PRUNE_FRACTION * steps))
    every = max(1, end_step // _EVENTS)
    growing = [n for n in names if targets[n] > start[n]]
    norms = {n: _InputNorm(model.get_submodule(n)) for n in growing} if prune_by == "wanda" else {}

    def ranked(n: str) -> Sparsifier:
        sp = sp_at(n, targets[n])
        return _InputWeighted(sp, norms[n]) if n in norms else sp

    pruners = [
        GradualPruning(
            [model.get_submodule(n).weight],
            CubicSchedule(start[n], targets[n], start_step=0, end_step=end_step, every=every)
            if targets[n] > start[n]
            else ConstantSparsity(targets[n]),
            ranked(n),
        )
        for n in names
    ]
    # plain Parameters on the masked values: PyTorch's own forward, autocast and fused optimizer paths
    plain = PlainMaskedWeights(model, names)
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        opt = optimizer(params) if optimizer is not None else _adamw(params, lr)
    except BaseException:  # a failing optimizer factory must not leave the plain Parameters behind
        plain.restore()
        raise
    base_lrs = [g["lr"] for g in opt.param_groups]
    device_type = next((p.device.type for p in model.parameters()), "cpu")
    teacher.eval()
    was_training = model.training
    model.train()
    own_dropout = {m: m.p for m in model.modules() if isinstance(m, nn.Dropout)} if dropout is not None else {}
    for m in own_dropout:
        m.p = dropout
    remaining = time_budget - (time.perf_counter() - t_start)
    t_train = time.perf_counter()
    bar = _Progress(progress, time_budget if clock else steps, "s" if clock else "step")
    losses: List[float] = []
    step, final_step, applied = 0, -1, -1.0
    sizes = {n: model.get_submodule(n).weight.numel() for n in names}
    # the teacher is fixed, so its outputs per batch can be reused each time the batches cycle
    cache: Dict[int, List[Tensor]] = {}
    cached_bytes = 0
    try:
        while True:
            elapsed = time.perf_counter() - t_train
            if clock:
                # stop when the next step, at the mean step time so far, would end past the budget
                if elapsed >= remaining or (step and elapsed * (step + 1) / step > remaining):
                    break
                progress_frac = elapsed / remaining
                sched_step = min(end_step, int(_TICKS * progress_frac / PRUNE_FRACTION))
            else:
                if step >= steps:
                    break
                progress_frac = step / steps
                sched_step = min(end_step, step)
            t_event = time.perf_counter()
            changed = [p.step(sched_step) for p in pruners]
            for pruner in (p for p, c in zip(pruners, changed) if c):
                for w in pruner.params:
                    plain.pattern_changed(w, opt)
            if any(changed) or applied < 0:
                applied = sum(sizes[n] * p.applied for n, p in zip(names, pruners)) / sum(sizes.values())
            if clock and step == 0:
                # masks that are slow to choose (grouped N:M) get fewer pruning events: at most a quarter
                # of the pruning window goes to choosing them
                cost = time.perf_counter() - t_event
                events = max(2, min(_EVENTS, int(0.25 * PRUNE_FRACTION * remaining / max(cost, 1e-9))))
                every = max(1, end_step // events)
                for p in pruners:
                    if isinstance(p.schedule, CubicSchedule):
                        p.schedule.every = every
            if final_step < 0 and sched_step >= end_step:
                final_step = step
                _remove_hooks(norms)
            # the learning rate: constant while pruning, then linear decay over the fine-tuning phase
            decay = (
                1.0
                if progress_frac < PRUNE_FRACTION
                else max(0.0, 1.0 - (progress_frac - PRUNE_FRACTION) / (1.0 - PRUNE_FRACTION))
            )
            for g, base in zip(opt.param_groups, base_lrs):
                g["lr"] = base * max(decay, 0.02)
            index = step % len(batches)
            b = batches[index]
            target_out = cache.get(index)
            if target_out is None:
                with torch.no_grad():
                    target_out = _tensors(forward(teacher, b))
                size = sum(t.numel() * t.element_size() for t in target_out)
                if cached_bytes + size <= teacher_cache_bytes:
                    cache[index], cached_bytes = target_out, cached_bytes + size
            if autocast is None:
                value = loss(_tensors(forward(model, b)), target_out)
            else:
                with torch.autocast(device_type, dtype=autocast):
                    outs = _tensors(forward(model, b))
                value = loss([t.float() for t in outs], target_out)
            opt.zero_grad(set_to_none=True)
            value.backward()
            plain.mask_grads()
            opt.step()
            if optimizer is not None:  # a user's optimizer need not keep zeros at zero
                plain.mask_weights()
            losses.append(value.item())
            step += 1
            bar.update(time.perf_counter() - t_start if clock else step, step, losses[-1], applied)
    finally:
        plain.restore()
        _remove_hooks(norms)
        bar.close()
        model.train(was_training)
        for m, p in own_dropout.items():
            m.p = p
    for p in pruners:  # the final sparsity, even if the budget ended before its time
        p.step(end_step)
    if final_step < 0:
        final_step = step

    # --------------------------------------------------------------- store in the pattern's layout
    report_sparsity, numel, kept = {}, {}, {}
    for n in names:
        m = model.get_submodule(n)
        lay = m.weight.sparse_layout
        with torch.no_grad():
            w = to_sparse(lay.to_dense(), layout, mask=lay.mask(), **layout_params)
        m.weight = nn.Parameter(w, requires_grad=trainable[n])
        numel[n], kept[n] = w.numel(), w.nnz
        report_sparsity[n] = round(1.0 - w.nnz / w.numel(), 6)
    path = None
    if checkpoint is not None:
        from ..io import save

        save(model, checkpoint)
        path = os.fspath(checkpoint)
    return RecoverReport(
        steps=step,
        seconds=round(time.perf_counter() - t_start, 3),
        pattern=pattern,
        layout=layout,
        sparsity=report_sparsity,
        targets=dict(targets),
        losses=losses,
        final_step=final_step,
        init=init,
        init_seconds=round(init_seconds, 3),
        checkpoint=path,
        _numel=numel,
        _kept=kept,
    )
