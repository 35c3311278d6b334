"""Measure the density crossovers of :mod:`sparsa.ops.crossovers` on this CPU (``sparsa cost --refit``).

Each crossover's sparse and dense sides are timed side by side (round robin, median) at a few densities
on one representative shape, and the highest density at which the sparse side wins is stored.

Example::

    >>> from sparsa.cost_model import CostModel
    >>> from sparsa.ops.crossover_refit import refit
    >>> out = refit(CostModel(None), names=["row_group.backward"], densities=(0.125,), shape=(32, 32),
    ...             tokens=8, rounds=1)
    >>> list(out)
    ['row_group.backward']
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..adaptive.conv import relu_conv2d
from ..adaptive.linear import relu_linear
from ..cost_model import CostModel, default_cost_model
from ..kernels import sliced_ell as se
from ..layouts.grouped_nm import GroupedNM
from ..layouts.row_group import RowGroup
from ..layouts.sliced_ell import SlicedELL
from ..timing import round_robin_ms
from .crossovers import CROSSOVERS, PREFIX, crossover
from .native_grouped_nm import _grad_weight_dense, _grad_weight_sparse
from .native_linear import _rg_grad_input, _rg_grad_weight

__all__ = ["refit", "DEFAULT_DENSITIES"]

#: the densities a crossover without its own grid is timed at
DEFAULT_DENSITIES = (0.0625, 0.125, 0.1875, 0.25, 0.375)

Case = Tuple[float, Dict[str, Callable[[], object]]]  # (the density actually built, {"sparse": fn, "dense": fn})


def _row_group_case(d: float, R: int, K: int, T: int) -> Case:
    w = RowGroup.from_dense(torch.randn(R, K), group=16, sparsity=1.0 - d)
    g2, x2 = torch.randn(T, R), torch.randn(T, K)
    return w.values.shape[1] / K, {
        "sparse": lambda: (_rg_grad_input(g2, w, True), _rg_grad_weight(g2, x2, w, True)),
        "dense": lambda: (_rg_grad_input(g2, w, False), _rg_grad_weight(g2, x2, w, False)),
    }


def _sliced_ell_case(d: float, R: int, K: int, T: int) -> Case:
    w = SlicedELL.from_dense(torch.randn(R, K), sparsity=1.0 - d)
    g2 = torch.randn(T, R)

    def sparse() -> Tensor:  # what SlicedELLLinear's backward runs below the crossover
        wt = SlicedELL.from_dense(w.to_dense().t(), mask=w.mask().t())
        return se.sliced_ell_linear_kernel(g2, wt.slice_ptr, wt.columns, wt.values, None, K)

    return w.density, {"sparse": sparse, "dense": lambda: g2 @ w.to_dense()}


def _grouped_nm_case(d: float, R: int, K: int, T: int) -> Case:
    m = 8  # n:8 patterns build in well under a second; larger m takes the greedy assignment much longer
    n = max(1, min(m - 1, round(d * m)))
    w = GroupedNM.from_dense(torch.randn(R, K), n=n, m=m, g=4)
    g2, x2 = torch.randn(T, R), torch.randn(T, K)
    return n / m, {"sparse": lambda: _grad_weight_sparse(w, g2, x2), "dense": lambda: _grad_weight_dense(w, g2, x2)}


def _relu_input(shape: Tuple[int, ...], d: float) -> Tensor:
    """A pre-activation whose ``relu`` keeps about the fraction ``d`` (a shifted normal)."""
    shift = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1.0 - d)).item()
    return torch.randn(shape) - shift


def _fwd_bwd(fn: Callable[[Tensor, Tensor], Tensor], x: Tensor, w: Tensor) -> Callable[[], object]:
    """One forward and backward of ``fn(x, w)`` with gradients for both, under grad mode."""

    def run():
        with torch.enable_grad():
            xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
            fn(xg, wg).sum().backward()
        return xg.grad, wg.grad

    return run


def _relu_linear_case(d: float, R: int, K: int, T: int) -> Case:
    x, w = _relu_input((T, K), d), torch.randn(R, K)
    return float((x > 0).float().mean()), {
        "sparse": _fwd_bwd(relu_linear, x, w),
        "dense": _fwd_bwd(lambda a, b: F.linear(a.relu(), b), x, w),
    }


def _relu_conv2d_case(d: float, R: int, K: int, T: int) -> Case:
    # one representative 3x3 conv, 64 -> 64 channels at 16x16, batch from the token count
    x, w = _relu_input((max(1, T // 64), 64, 16, 16), d), torch.randn(64, 64, 3, 3)
    return float((x > 0).float().mean()), {
        "sparse": _fwd_bwd(lambda a, b: relu_conv2d(a, b, padding=1), x, w),
        "dense": _fwd_bwd(lambda a, b: F.conv2d(a.relu(), b, padding=1), x, w),
    }


_CASES: Dict[str, Callable[[float, int, int, int], Case]] = {
    "row_group.backward": _row_group_case,
    "sliced_ell.grad_input": _sliced_ell_case,
    "grouped_nm.grad_weight": _grouped_nm_case,
    "relu_compact.linear": _relu_linear_case,
    "relu_compact.conv2d": _relu_conv2d_case,
}


def refit(
    cost_model: Optional[CostModel] = None,
    names: Optional[Sequence[str]] = None,
    densities: Optional[Sequence[float]] = None,
    shape: Tuple[int, int] = (768, 768),
    tokens: int = 512,
    rounds: int = 5,
) -> Dict[str, float]:
    """Time the sparse and dense side of each crossover at ``densities`` (side by side, round robin, on a
    ``shape`` weight and ``tokens`` rows at the current thread count), store the highest density at which
    the sparse side was faster (0.0 if at none) and return them by name. A layout that cannot hold a
    density exactly is timed at the nearest one it holds (grouped_nm: n/8). ``densities=None``: each
    crossover's own grid (``Crossover.densities``), else :data:`DEFAULT_DENSITIES`."""
    cm = cost_model if cost_model is not None else default_cost_model()
    names = list(CROSSOVERS) if names is None else list(names)
    for n in names:
        crossover(n)  # a ValueError names an unknown crossover
    if densities is not None and (not densities or not all(0 < d < 1 for d in densities)):
        raise ValueError(f"refit: densities must be fractions in (0, 1), got {list(densities)}")
    R, K = shape
    out: Dict[str, float] = {}
    for name in names:
        grid = densities if densities is not None else (CROSSOVERS[name].densities or DEFAULT_DENSITIES)
        timings: Dict[float, Dict[str, float]] = {}
        for d in sorted(grid):
            actual, fns = _CASES[name](d, R, K, tokens)
            actual = round(float(actual), 4)
            if actual not in timings:
                with torch.no_grad():
                    timings[actual] = round_robin_ms(fns, rounds)
        wins = [d for d, ms in timings.items() if ms["sparse"] < ms["dense"]]
        best = max(wins) if wins else 0.0
        cm.set_fit(
            PREFIX + name,
            {
                "max_density": best,
                "shape": [R, K],
                "tokens": tokens,
                "threads": torch.get_num_threads(),
                "ratios": {str(d): round(ms["dense"] / ms["sparse"], 3) for d, ms in timings.items()},
            },
            save=False,
        )
        out[name] = best
    cm.save()
    return out
