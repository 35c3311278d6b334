"""Measure the density crossovers of :mod:`sparsa.crossovers` on this CPU (``sparsa cost --refit``).

Each crossover's sparse and dense sides are timed side by side (round robin, median) at a few densities
on each of its representative shapes (``Crossover.shapes``). A shape's crossover is the highest density
at which the sparse side wins; the stored crossover is the median over the shapes, each shape's figures
kept beside it.

Example::

    >>> from sparsa.cost_model import CostModel
    >>> from sparsa.ops.crossover_refit import refit
    >>> out = refit(CostModel(None), names=["row_group.backward"], densities=(0.125,), shape=(32, 32),
    ...             tokens=8, rounds=1)
    >>> list(out)
    ['row_group.backward']
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..adaptive.conv import relu_conv2d
from ..adaptive.linear import relu_linear
from ..cost_model import CostModel, default_cost_model
from ..kernels import bitmask as bm
from ..kernels import sliced_ell as se
from ..layouts.bitmask import Bitmask
from ..layouts.grouped_nm import GroupedNM
from ..layouts.row_group import RowGroup
from ..layouts.sliced_ell import SlicedELL
from ..timing import round_robin_ms
from ..crossovers import CROSSOVERS, PREFIX, crossover
from .native_grouped_nm import _grad_weight_dense, _grad_weight_sparse
from .native_linear import _rg_grad_input, _rg_grad_weight

__all__ = ["refit", "DEFAULT_DENSITIES", "STREAM_BYTES", "WEIGHT_SHAPE", "WEIGHT_TOKENS"]

#: the densities a crossover without its own grid is timed at
DEFAULT_DENSITIES = (0.0625, 0.125, 0.1875, 0.25, 0.375)

# (the density actually built, {"sparse": fn, "dense": fn}); a case is None where its sparse kernel does not run
Case = Tuple[float, Dict[str, Callable[[], object]]]
Dims = Tuple[int, ...]


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


#: bytes of weight copies a batched-decoding case cycles through: a decoder reads each weight from memory
#: once per step, so the batch crossovers are timed on weights well past the last-level cache
STREAM_BYTES = 128 << 20


def _bitmask_panel_case(dtype: torch.dtype) -> Callable[..., Optional[Case]]:
    def case(d: float, R: int, K: int, T: int) -> Optional[Case]:
        has_panel = bm.has_panel_bf16 if dtype == torch.bfloat16 else bm.has_panel_f32
        if not has_panel():
            return None  # the panel kernel does not run here: nothing to time
        w = Bitmask.from_dense(torch.randn(R, K).to(dtype), sparsity=1.0 - d)
        x = torch.randn(T, K).to(dtype)
        parts = [(w.bits, w.row_ptr, w.values, None, R)]
        if T <= bm.BATCH_MAX_TOKENS:  # copies in their own memory, so that each call streams its weight
            copies = min(1024, -(-STREAM_BYTES // max(1, w.nbytes)))
            parts += [(w.bits.clone(), w.row_ptr.clone(), w.values.clone(), None, R) for _ in range(copies - 1)]

        def run(strategy: str) -> Callable[[], object]:
            return lambda: [bm.bitmask_linear_impl(x, *p, strategy) for p in parts]

        return w.values.numel() / (R * K), {"sparse": run("panel"), "dense": run("expand")}

    return case


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


def _relu_linear_case(d: float, T: int, K: int, R: int) -> Case:
    x, w = _relu_input((T, K), d), torch.randn(R, K)
    return float((x > 0).float().mean()), {
        "sparse": _fwd_bwd(relu_linear, x, w),
        "dense": _fwd_bwd(lambda a, b: F.linear(a.relu(), b), x, w),
    }


def _relu_conv2d_case(d: float, N: int, C: int, H: int) -> Case:
    # a 3x3 conv, C -> C channels, padding 1, on an N x C x H x H input
    x, w = _relu_input((N, C, H, H), d), torch.randn(C, C, 3, 3)
    return float((x > 0).float().mean()), {
        "sparse": _fwd_bwd(lambda a, b: relu_conv2d(a, b, padding=1), x, w),
        "dense": _fwd_bwd(lambda a, b: F.conv2d(a.relu(), b, padding=1), x, w),
    }


_CASES: Dict[str, Callable[..., Optional[Case]]] = {
    "row_group.backward": _row_group_case,
    "sliced_ell.grad_input": _sliced_ell_case,
    "grouped_nm.grad_weight": _grouped_nm_case,
    "bitmask.panel_bf16": _bitmask_panel_case(torch.bfloat16),
    "bitmask.panel_f32": _bitmask_panel_case(torch.float32),
    "bitmask.batch_panel_bf16": _bitmask_panel_case(torch.bfloat16),
    "bitmask.batch_panel_f32": _bitmask_panel_case(torch.float32),
    "relu_compact.linear": _relu_linear_case,
    "relu_compact.conv2d": _relu_conv2d_case,
}

#: the size (out_features, in_features) and token count an explicit ``shape`` / ``tokens`` completes
WEIGHT_SHAPE, WEIGHT_TOKENS = (768, 768), 512


def _dims(name: str, shape: Optional[Tuple[int, int]], tokens: Optional[int]) -> List[Dims]:
    """The shapes ``name`` is timed at: its own (``Crossover.shapes``), or one built from an explicit
    ``shape`` (out, in) and ``tokens``."""
    own = CROSSOVERS[name].shapes
    if shape is None and tokens is None and own:
        return list(own)
    R, K = shape if shape is not None else WEIGHT_SHAPE
    T = tokens if tokens is not None else WEIGHT_TOKENS
    if name == "relu_compact.linear":
        return [(T, K, R)]
    if name == "relu_compact.conv2d":  # a K -> K channel conv over about T pixels per channel
        return [(max(1, T // 256), K, 16)]
    return [(R, K, T)]


def _crossover_at(name: str, dims: Dims, grid: Sequence[float], rounds: int) -> Tuple[float, Dict[str, float]]:
    """The highest density of ``grid`` at which the sparse side wins at ``dims`` (0.0 if none), and the
    dense / sparse time ratio at each density built (keyed by it)."""
    timings: Dict[float, Dict[str, float]] = {}
    for d in sorted(grid):
        case = _CASES[name](d, *dims)
        if case is None:  # the sparse side cannot run on this CPU: the dense side everywhere
            return 0.0, {}
        actual, fns = case
        actual = round(float(actual), 4)
        if actual not in timings:
            with torch.no_grad():
                timings[actual] = round_robin_ms(fns, rounds)
    wins = [d for d, ms in timings.items() if ms["sparse"] < ms["dense"]]
    return (max(wins) if wins else 0.0), {str(d): round(ms["dense"] / ms["sparse"], 3) for d, ms in timings.items()}


def refit(
    cost_model: Optional[CostModel] = None,
    names: Optional[Sequence[str]] = None,
    densities: Optional[Sequence[float]] = None,
    shape: Optional[Tuple[int, int]] = None,
    tokens: Optional[int] = None,
    rounds: int = 5,
) -> Dict[str, float]:
    """Time the sparse and dense side of each crossover at ``densities`` (side by side, round robin, at
    the current thread count) on each of its shapes, store the median over the shapes of the highest
    density at which the sparse side was faster (0.0 if at none) and return them by name. A layout that
    cannot hold a density exactly is timed at the nearest one it holds (grouped_nm: n/8).
    ``densities=None``: each crossover's own grid (``Crossover.densities``), else
    :data:`DEFAULT_DENSITIES`. ``shape`` (out, in) / ``tokens``: time every crossover at that one size
    instead of its own shapes (:data:`WEIGHT_SHAPE`, :data:`WEIGHT_TOKENS` for what is not given)."""
    cm = cost_model if cost_model is not None else default_cost_model()
    names = list(CROSSOVERS) if names is None else list(names)
    for n in names:
        crossover(n)  # a ValueError names an unknown crossover
    if densities is not None and (not densities or not all(0 < d < 1 for d in densities)):
        raise ValueError(f"refit: densities must be fractions in (0, 1), got {list(densities)}")
    out: Dict[str, float] = {}
    for name in names:
        grid = densities if densities is not None else (CROSSOVERS[name].densities or DEFAULT_DENSITIES)
        per_shape = []
        for dims in _dims(name, shape, tokens):
            best, ratios = _crossover_at(name, dims, grid, rounds)
            per_shape.append({"dims": list(dims), "max_density": best, "ratios": ratios})
        bests = sorted(p["max_density"] for p in per_shape)
        median = bests[(len(bests) - 1) // 2]  # the lower median: one of the measured densities
        cm.set_fit(
            PREFIX + name,
            {
                "max_density": median,
                "threads": torch.get_num_threads(),
                "ratios": next(p["ratios"] for p in per_shape if p["max_density"] == median),
                "shapes": per_shape,
            },
            save=False,
        )
        out[name] = median
    cm.save()
    return out
