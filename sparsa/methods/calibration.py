"""Calibration: statistics of the inputs of ``nn.Linear`` layers, captured with forward hooks.

Post-training pruning (Wanda, SparseGPT) ranks weights with the layer's inputs on a little
calibration data: Wanda needs the L2 norm of every input feature, SparseGPT the Gram matrix
``X^T X`` (the layer-wise Hessian). Both are accumulated on the fly, never the raw inputs. The
data is a list of ``batches``, each fed as ``forward(model, batch)`` (default ``model(batch)``).

>>> import torch, torch.nn as nn
>>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
>>> stats = collect_input_stats(model, [torch.randn(16, 4)], hessian=True)
>>> sorted(stats), stats["2"].sq_norm.shape, stats["2"].hessian.shape, stats["2"].count
(['0', '2'], torch.Size([8]), torch.Size([8, 8]), 16)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

__all__ = ["InputStats", "collect_input_stats", "forward_groups"]

Forward = Callable[[nn.Module, Any], Any]


@dataclass
class InputStats:
    """Per-layer input statistics over ``count`` input rows (tokens or samples)."""

    sq_norm: Tensor  # (in_features,) sum of x_j^2
    hessian: Optional[Tensor] = None  # (in, in) sum of x x^T
    count: int = 0

    @property
    def norm(self) -> Tensor:
        """L2 norm of every input feature (what Wanda multiplies ``|W|`` with)."""
        return self.sq_norm.sqrt()

    def add(self, x: Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        self.sq_norm += x.pow(2).sum(0)
        if self.hessian is not None:
            self.hessian.addmm_(x.T, x)
        self.count += x.shape[0]


class _Stop(Exception):
    """Raised by a hook once every wanted layer has seen this batch (the rest of the forward is skipped)."""


def _linears(model: nn.Module, names: Optional[Sequence[str]]) -> Dict[str, nn.Linear]:
    mods = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    missing = [n for n in names or () if n not in mods]
    if missing:
        raise ValueError(f"names: {missing} are not nn.Linear modules of the model; available: {sorted(mods)[:20]}")
    return mods if names is None else {n: mods[n] for n in names}


def _run(
    model: nn.Module,
    batches: Iterable[Any],
    forward: Optional[Forward],
    mods: Dict[str, nn.Module],
    on_input: Callable[[str, Tensor], None],
    stop_early: bool = False,
) -> None:
    """Feed ``batches`` under ``no_grad`` with ``on_input(name, x)`` called on each input of ``mods``."""
    seen: set = set()

    def hook(name: str, x: Tensor) -> None:
        on_input(name, x)
        seen.add(name)
        if stop_early and len(seen) == len(mods):
            raise _Stop

    with contextlib.ExitStack() as hooks, torch.no_grad():
        for n, m in mods.items():
            hooks.enter_context(m.register_forward_pre_hook(lambda _, args, n=n: hook(n, args[0])))
        for b in batches:
            seen.clear()
            with contextlib.suppress(_Stop):
                forward(model, b) if forward else model(b)


def collect_input_stats(
    model: nn.Module,
    batches: Iterable[Any],
    forward: Optional[Forward] = None,
    names: Optional[Sequence[str]] = None,
    hessian: bool = False,
    stop_early: bool = False,
) -> Dict[str, InputStats]:
    """:class:`InputStats` of the ``nn.Linear`` modules ``names`` (default: all the forward uses).

    ``stop_early`` ends each batch's forward as soon as every named layer has seen its input (for
    layer-by-layer calibration). Runs under ``torch.no_grad()``.
    """
    mods = _linears(model, names)
    stats = {
        n: InputStats(torch.zeros(m.in_features), torch.zeros(m.in_features, m.in_features) if hessian else None)
        for n, m in mods.items()
    }
    _run(model, batches, forward, mods, lambda n, x: stats[n].add(x), stop_early)
    unused = [n for n, s in stats.items() if s.count == 0]
    if unused and names is not None:
        raise ValueError(f"the forward never called the layers {unused}; leave them out of names=")
    return {n: s for n, s in stats.items() if s.count}


def forward_groups(
    model: nn.Module, batch: Any, forward: Optional[Forward] = None, names: Optional[Sequence[str]] = None
) -> List[List[str]]:
    """The ``nn.Linear`` modules in the order one forward first calls them, consecutive layers that
    read the very same input tensor grouped (e.g. attention's query, key and value).

    >>> import torch, torch.nn as nn
    >>> forward_groups(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), torch.randn(3, 4))
    [['0'], ['2']]
    """
    groups: List[List[str]] = []
    last: List[Any] = [None]  # the input of the last layer called for the first time

    def on_input(name: str, x: Tensor) -> None:
        if any(name in g for g in groups):
            return
        if x is not last[0]:
            groups.append([])
        groups[-1].append(name)
        last[0] = x

    _run(model, [batch], forward, _linears(model, names), on_input)
    return groups


def layer_sparsifiers(
    model: nn.Module, sparsifier: Any, sparsities: Optional[Mapping[str, float]]
) -> Callable[[nn.Module], Any]:
    """``module -> sparsifier`` for the one-shot methods: ``sparsifier.with_sparsity(sparsities[name])``
    for the modules named in ``sparsities`` (full names in ``model``), ``sparsifier`` for the rest.
    Raises ``ValueError`` naming ``sparsities`` for unknown names or a sparsifier without a sparsity."""
    if sparsities is None:
        return lambda m: sparsifier
    if not isinstance(sparsities, Mapping):
        raise TypeError(f"sparsities must be a dict {{module name: sparsity}} or None, got {type(sparsities).__name__}")
    mods = dict(model.named_modules())
    bad = [n for n in sparsities if not isinstance(mods.get(n), nn.Linear)]
    if bad:
        raise ValueError(f"sparsities: {bad[:5]} are not nn.Linear modules of the model")
    try:
        by_id = {id(mods[n]): sparsifier.with_sparsity(s) for n, s in sparsities.items()}
    except TypeError as e:
        raise ValueError(
            f"sparsities: per-layer sparsity needs a sparsifier with a sparsity (e.g. Magnitude, "
            f"RowGroupSparsifier), not a fixed pattern: {e}"
        ) from None
    return lambda m: by_id.get(id(m), sparsifier)
