"""Per-layer sparsity allocation: how sparse each layer should be for one overall target.

Layers differ in how much pruning hurts them. OWL (Outlier Weighted Layerwise sparsity, Yin et al.,
2023) keeps more of the layers with many *outliers*: weights whose Wanda score ``|W_ij| * ||X_j||``
is above ``M`` times the layer's mean score. Each layer's outlier ratio ``D`` is normalised to
``[0, 2 * lam]`` across the layers, and the layer gets ``target - D_norm + c``, clipped to
``[0, 0.99]``, with the shift ``c`` solved so that the **parameter-weighted mean equals the
target** (so the model has exactly as many weights left as with uniform sparsity).

>>> import torch, torch.nn as nn
>>> _ = torch.manual_seed(0)
>>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
>>> s = owl_sparsities(model, ["0", "2"], [torch.randn(64, 16)], 0.7)
>>> round(weighted_mean_sparsity(model, s), 6)
0.7
>>> uniform_sparsities(["0", "2"], 0.7)
{'0': 0.7, '2': 0.7}
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch
from torch import nn

from ..layouts.base import check_fraction
from ..tensor import to_dense
from .blockwise import find_blocks
from .calibration import collect_input_stats

__all__ = ["owl_sparsities", "outlier_ratios", "uniform_sparsities", "weighted_mean_sparsity", "MAX_SPARSITY"]

#: no layer is allocated more than this sparsity (OWL's clip; a layer with nothing left breaks the model)
MAX_SPARSITY = 0.99


def uniform_sparsities(names: Sequence[str], target: float) -> Dict[str, float]:
    """``{name: target}`` for every layer: the same sparsity everywhere."""
    target = check_fraction(target, "target")
    return {n: target for n in _check_names(names)}


def _check_names(names: Any) -> List[str]:
    if isinstance(names, str) or not all(isinstance(n, str) for n in names or ()):
        raise TypeError(f"names must be a list of module names, got {names!r}")
    if not names:
        raise ValueError("names is empty: pass the nn.Linear module names to allocate sparsity to")
    return list(names)


def _weight_sizes(model: nn.Module, names: Sequence[str]) -> Dict[str, int]:
    out = {}
    for n in names:
        try:
            m = model.get_submodule(n)
        except AttributeError:
            raise ValueError(f"names: {n!r} is not a module of the model") from None
        if not isinstance(m, nn.Linear):
            raise ValueError(f"names: {n!r} is a {type(m).__name__}, not an nn.Linear")
        out[n] = m.weight.numel()
    return out


def weighted_mean_sparsity(model: nn.Module, sparsities: Mapping[str, float]) -> float:
    """The overall sparsity of the layers in ``sparsities`` (each weighted by its number of weights)."""
    sizes = _weight_sizes(model, list(sparsities))
    return sum(sizes[n] * s for n, s in sparsities.items()) / sum(sizes.values())


def outlier_ratios(
    model: nn.Module,
    names: Optional[Sequence[str]],
    calibration_batches: Sequence[Any],
    forward: Optional[Callable[[nn.Module, Any], Any]] = None,
    M: float = 5.0,
    per: str = "layer",
) -> Dict[str, float]:
    """OWL's layer outlier ratio: the fraction of a layer's Wanda scores ``|W| * ||X||`` (``||X||``:
    the L2 norm of each input feature over ``calibration_batches``) above ``M`` times their mean.
    ``names=None``: every ``nn.Linear`` the forward uses. ``per="block"``: the ratio of all the
    scores of a transformer block's layers together (as the OWL paper does), given to each of them;
    layers outside the blocks (:func:`~sparsa.methods.find_blocks`) keep their own."""
    if per not in ("layer", "block"):
        raise ValueError(f"per must be 'layer' or 'block', got {per!r}")
    if isinstance(M, bool) or not isinstance(M, (int, float)) or not M > 0:
        raise ValueError(f"M must be a positive number (outlier threshold, in multiples of the mean score), got {M!r}")
    batches = list(calibration_batches)
    if not batches:
        raise ValueError("calibration_batches is empty: pass a few batches of model inputs")
    stats = collect_input_stats(model, batches, forward, None if names is None else _check_names(names))
    scores = {
        n: (to_dense(model.get_submodule(n).weight).detach().float().abs() * s.norm).reshape(-1)
        for n, s in stats.items()
    }
    groups: Dict[str, List[str]] = {}
    found = find_blocks(model) if per == "block" else None
    for n in scores:
        key = n
        if found is not None and n.startswith(found[0] + "."):
            key = ".".join(n.split(".")[: len(found[0].split(".")) + 1])  # e.g. encoder.layer.3
        groups.setdefault(key, []).append(n)
    out = {}
    for members in groups.values():
        score = torch.cat([scores[n] for n in members])
        ratio = (score > M * score.mean()).float().mean().item()
        out.update({n: ratio for n in members})
    return out


def owl_sparsities(
    model: nn.Module,
    names: Optional[Sequence[str]],
    calibration_batches: Sequence[Any],
    target: float,
    forward: Optional[Callable[[nn.Module, Any], Any]] = None,
    lam: float = 0.08,
    M: float = 5.0,
    per: str = "layer",
) -> Dict[str, float]:
    """OWL per-layer sparsities (see the module docstring) for the ``nn.Linear`` layers ``names``
    (``None``: every one the forward uses), whose weighted mean is ``target``.

    ``calibration_batches`` are fed as ``forward(model, batch)`` (default ``model(batch)``); ``lam``
    is the largest distance of a layer from the target (the spread is ``2 * lam``), ``M`` the
    outlier threshold in multiples of the mean score (the paper's defaults: 0.08 and 5). ``per``:
    ``"layer"`` (each layer its own ratio) or ``"block"`` (one ratio per transformer block, as in
    the paper; see :func:`outlier_ratios`).
    """
    target = check_fraction(target, "target")
    if target > MAX_SPARSITY:
        raise ValueError(
            f"target must be at most {MAX_SPARSITY} (the largest sparsity OWL gives a layer), got {target}"
        )
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not 0 <= lam < 1:
        raise ValueError(f"lam must be a number in [0, 1) (the largest change from the target), got {lam!r}")
    ratios = outlier_ratios(model, names, calibration_batches, forward, M, per)
    sizes = _weight_sizes(model, list(ratios))
    lo, hi = min(ratios.values()), max(ratios.values())
    norm = {n: 0.0 if hi == lo else 2 * lam * (d - lo) / (hi - lo) for n, d in ratios.items()}
    return _shift_to_mean({n: target - v for n, v in norm.items()}, sizes, target)


def _shift_to_mean(raw: Dict[str, float], sizes: Dict[str, int], target: float) -> Dict[str, float]:
    """``clip(raw + c, 0, MAX_SPARSITY)`` with ``c`` such that the size-weighted mean is ``target``
    (bisection: the mean is continuous and non-decreasing in ``c``)."""
    total = sum(sizes.values())

    def mean(c: float) -> float:
        return sum(sizes[n] * min(max(v + c, 0.0), MAX_SPARSITY) for n, v in raw.items()) / total

    lo, hi = -2.0, 2.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean(mid) < target else (lo, mid)
    c = (lo + hi) / 2
    out = {n: min(max(v + c, 0.0), MAX_SPARSITY) for n, v in raw.items()}
    assert math.isclose(mean(c), target, abs_tol=1e-9), (mean(c), target)
    return out


def check_allocation(allocation: Any, names: Sequence[str], arg: str = "allocation") -> Optional[Dict[str, float]]:
    """Validate a ``{name: sparsity}`` dict covering exactly ``names`` (``None`` passes through)."""
    if allocation is None or isinstance(allocation, str):
        return None
    if not isinstance(allocation, Mapping):
        raise TypeError(
            f"{arg} must be None (uniform), 'owl' or a dict {{layer name: sparsity}}, got {type(allocation).__name__}"
        )
    missing = [n for n in names if n not in allocation]
    extra = [n for n in allocation if n not in names]
    if missing or extra:
        raise ValueError(
            f"{arg} must give a sparsity for exactly the layers pruned; missing {missing[:5]}, unknown {extra[:5]}"
        )
    return {n: check_fraction(allocation[n], f"{arg}[{n!r}]") for n in names}
