"""Measure the density crossovers of :mod:`sparsa.crossovers` on this CPU (``sparsa cost --refit``).

Each crossover's two sides are timed side by side (round robin, median) at the points of its grid (a few
densities, or token counts) on each of its representative shapes (``Crossover.shapes``). A density
crossover's figure at a shape is the highest density at which its low (sparse) side wins; a token
crossover's is the most tokens up to which its low side wins at every token count timed (one below the
grid's first if it loses there). The stored crossover is the median over the shapes, each shape's
figures kept beside it.

Example::

    >>> from sparsa.cost_model import CostModel
    >>> from sparsa.ops.crossover_refit import refit
    >>> out = refit(CostModel(None), names=["row_group.backward"], densities=(0.125,), shape=(32, 32),
    ...             tokens=8, rounds=1)
    >>> list(out)
    ['row_group.backward']
"""

from __future__ import annotations

import math
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
from ..layouts.nm import nm_mask
from ..layouts.row_group import RowGroup
from ..layouts.sliced_ell import SlicedELL
from ..timing import round_robin_ms
from ..crossovers import CROSSOVERS, PREFIX, UNITS, crossover
from .native_grouped_nm import _grad_weight_dense, _grad_weight_sparse
from .native_linear import _rg_grad_input, _rg_grad_weight

__all__ = [
    "refit",
    "union_pattern",
    "DEFAULT_DENSITIES",
    "STREAM_BYTES",
    "TOKEN_CASE_DENSITY",
    "UNION_CASE_DENSITY",
    "WEIGHT_SHAPE",
    "WEIGHT_TOKENS",
]

#: the densities a crossover without its own grid is timed at
DEFAULT_DENSITIES = (0.0625, 0.125, 0.1875, 0.25, 0.375)

# (the grid point actually built, {"low": fn, "high": fn, ...}); "low" is the side that runs at or below the
# crossover, every other key a way the high side can run (the fastest counts); None where the low side
# (a sparse kernel) does not run on this CPU
Case = Tuple[float, Dict[str, Callable[[], object]]]
Dims = Tuple[int, ...]


def _row_group_case(d: float, R: int, K: int, T: int) -> Case:
    w = RowGroup.from_dense(torch.randn(R, K), group=16, sparsity=1.0 - d)
    g2, x2 = torch.randn(T, R), torch.randn(T, K)
    return w.values.shape[1] / K, {
        "low": lambda: (_rg_grad_input(g2, w, True), _rg_grad_weight(g2, x2, w, True)),
        "high": lambda: (_rg_grad_input(g2, w, False), _rg_grad_weight(g2, x2, w, False)),
    }


def _sliced_ell_case(d: float, R: int, K: int, T: int) -> Case:
    w = SlicedELL.from_dense(torch.randn(R, K), sparsity=1.0 - d)
    g2 = torch.randn(T, R)

    def sparse() -> Tensor:  # what SlicedELLLinear's backward runs below the crossover
        wt = SlicedELL.from_dense(w.to_dense().t(), mask=w.mask().t())
        return se.sliced_ell_linear_kernel(g2, wt.slice_ptr, wt.columns, wt.values, None, K)

    return w.density, {"low": sparse, "high": lambda: g2 @ w.to_dense()}


def _sliced_ell_rows_case(d: float, R: int, K: int, T: int) -> Optional[Case]:
    if not se.has_dpbf16():
        return None  # no VDPBF16PS rows here: the FMA rows always run, nothing to time
    w = SlicedELL.from_dense(torch.randn(R, K), sparsity=1.0 - d)
    x, v = torch.randn(T, K).to(torch.bfloat16), w.values.to(torch.bfloat16)

    def run(rows: str) -> Callable[[], object]:
        return lambda: se.sliced_ell_linear_impl(x, w.slice_ptr, w.columns, v, None, R, rows=rows)

    return v.numel() / (R * K), {"low": run("fma"), "high": run("dp")}


def _grouped_nm_case(d: float, R: int, K: int, T: int) -> Case:
    m = 8  # n:8 patterns build in well under a second; larger m takes the greedy assignment much longer
    n = max(1, min(m - 1, round(d * m)))
    w = GroupedNM.from_dense(torch.randn(R, K), n=n, m=m, g=4)
    g2, x2 = torch.randn(T, R), torch.randn(T, K)
    return n / m, {"low": lambda: _grad_weight_sparse(w, g2, x2), "high": lambda: _grad_weight_dense(w, g2, x2)}


#: bytes of weight copies a batched-decoding case cycles through: a decoder reads each weight from memory
#: once per step, so the batch crossovers are timed on weights well past the last-level cache
STREAM_BYTES = 128 << 20


#: the kept fraction of the weights the bitmask token crossovers are timed on
TOKEN_CASE_DENSITY = {
    "bitmask.stream_bf16": 0.5,
    "bitmask.stream_f32": 0.5,
    "bitmask.batch_stream_bf16": 0.5,
    "bitmask.row_blocks_f32": 0.7,
    "bitmask.fused_f32": 0.5,
}


def _bitmask_weights(dtype: torch.dtype, d: float, R: int, K: int, streamed: bool) -> Tuple[Bitmask, list]:
    """A bitmask weight keeping about ``d`` and the component tuples a call cycles through: ``streamed``
    (decoding), copies in their own memory, so that each call streams its weight from memory."""
    w = Bitmask.from_dense(torch.randn(R, K).to(dtype), sparsity=1.0 - d)
    parts = [(w.bits, w.row_ptr, w.values, None, R)]
    if streamed:
        copies = min(1024, -(-STREAM_BYTES // max(1, w.nbytes)))
        parts += [(w.bits.clone(), w.row_ptr.clone(), w.values.clone(), None, R) for _ in range(copies - 1)]
    return w, parts


def _dense_side(dtype: torch.dtype, T: int) -> str:
    """The strategy the bitmask op's automatic choice runs for ``T`` tokens of a weight too dense for the
    panel kernel."""
    return bm.dense_strategy(T, dtype)


def _bitmask_panel_case(dtype: torch.dtype) -> Callable[..., Optional[Case]]:
    def case(d: float, R: int, K: int, T: int) -> Optional[Case]:
        has_panel = bm.has_panel_bf16 if dtype == torch.bfloat16 else bm.has_panel_f32
        if not has_panel():
            return None  # the panel kernel does not run here: nothing to time
        w, parts = _bitmask_weights(dtype, d, R, K, T <= bm.BATCH_MAX_TOKENS)
        x = torch.randn(T, K).to(dtype)

        def run(strategy: str) -> Callable[[], object]:
            return lambda: [bm.bitmask_linear_impl(x, *p, strategy) for p in parts]

        return w.values.numel() / (R * K), {"low": run("panel"), "high": run(_dense_side(dtype, T))}

    return case


def _bitmask_stream_case(dtype: torch.dtype, name: str, panel: bool = True):
    """The stream loop against expand, and the faster of expand and (where they run) the AMX tiles and
    (``panel``) the panel."""

    def case(T: float, R: int, K: int) -> Optional[Case]:
        if bm.native_library() is None:
            return None  # no native kernels here: the reference runs whatever the strategy
        T = int(T)
        _, parts = _bitmask_weights(dtype, TOKEN_CASE_DENSITY[name], R, K, True)
        x = torch.randn(T, K).to(dtype)

        def run(strategy: str) -> Callable[[], object]:
            return lambda: [bm.bitmask_linear_impl(x, *p, strategy) for p in parts]

        sides = {"low": run("stream"), "high_expand": run("expand")}
        if _dense_side(dtype, T) in ("amx", "fused"):
            sides["high_" + _dense_side(dtype, T)] = run(_dense_side(dtype, T))
        if panel and (bm.has_panel_bf16 if dtype == torch.bfloat16 else bm.has_panel_f32)():
            sides["high_panel"] = run("panel")
        return T, sides

    return case


def _nm24_case(T: float, R: int, K: int) -> Optional[Case]:
    """A 2:4 bf16 weight: the strategy the bitmask strategies' own choice picks against ``"nm24"`` (decoding
    batches on weight copies past the cache, as the stream crossovers are)."""
    if not bm.has_nm24_panel():
        return None  # the 2:4 kernel does not run here: the bitmask strategies everywhere
    T = int(T)
    dense = torch.randn(R, K).to(torch.bfloat16)
    w = Bitmask.from_dense(dense, mask=nm_mask(dense.float(), 2, 4))
    copies = min(1024, -(-STREAM_BYTES // max(1, w.nbytes))) if T <= bm.BATCH_MAX_TOKENS else 1
    parts = [(w.bits, w.row_ptr, w.values)] + [(w.bits.clone(), w.row_ptr, w.values.clone()) for _ in range(copies - 1)]
    x = torch.randn(T, K).to(torch.bfloat16)
    own = bm.choose_strategy(T, torch.bfloat16, 0.5)

    def run(strategy: str) -> Callable[[], object]:
        return lambda: [bm.bitmask_linear_impl(x, b, rp, v, None, R, strategy) for b, rp, v in parts]

    return T, {"low": run(own), "high": run("nm24")}


def _bitmask_row_blocks_case(T: float, R: int, K: int) -> Optional[Case]:
    lib = bm.native_library()
    if lib is None:
        return None
    T = int(T)
    w, _ = _bitmask_weights(torch.float32, TOKEN_CASE_DENSITY["bitmask.row_blocks_f32"], R, K, False)
    x = torch.randn(T, K)
    parts = (lib, "f32", x, w.bits, w.row_ptr, w.values, None, R)
    return T, {"low": lambda: bm._expand(*parts, whole=False), "high": lambda: bm._expand(*parts, whole=True)}


def _bitmask_fused_case(T: float, R: int, K: int) -> Optional[Case]:
    """The fused kernel against the expansion for a BLAS GEMM, on float32 weight copies past the cache."""
    if not bm.has_fused_f32():
        return None  # no fused kernel here: the expansion at every token count
    T = int(T)
    _, parts = _bitmask_weights(torch.float32, TOKEN_CASE_DENSITY["bitmask.fused_f32"], R, K, True)
    x = torch.randn(T, K)

    def run(strategy: str) -> Callable[[], object]:
        return lambda: [bm.bitmask_linear_impl(x, *p, strategy) for p in parts]

    return T, {"low": run("fused"), "high": run("expand")}


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
        "low": _fwd_bwd(relu_linear, x, w),
        "high": _fwd_bwd(lambda a, b: F.linear(a.relu(), b), x, w),
    }


def _relu_conv2d_case(d: float, N: int, C: int, H: int) -> Case:
    # a 3x3 conv, C -> C channels, padding 1, on an N x C x H x H input
    x, w = _relu_input((N, C, H, H), d), torch.randn(C, C, 3, 3)
    return float((x > 0).float().mean()), {
        "low": _fwd_bwd(lambda a, b: relu_conv2d(a, b, padding=1), x, w),
        "high": _fwd_bwd(lambda a, b: F.conv2d(a.relu(), b, padding=1), x, w),
    }


#: the fraction of an activation kept in the union group-size cases (about VGG's mid-training relu(x))
UNION_CASE_DENSITY = 0.25


def _nonempty_runs(k: int) -> float:
    """The expected nonempty runs of 4 pixels (of its two rows) in a 2 x 4 pixel block holding ``k`` (1-8)
    nonzeros at random."""
    return 2.0 * (1.0 - math.comb(4, k) / math.comb(8, k))


def _block_ratio(k: int) -> float:
    """The union ratio of such a block: 4 x its nonempty runs / ``k``."""
    return 4.0 * _nonempty_runs(k) / k


def union_pattern(shape: Tuple[int, int, int, int], ratio: float, density: float = UNION_CASE_DENSITY) -> Tensor:
    """A ``[N, C, H, W]`` activation (nonnegative) whose union ratio is about ``ratio`` (1-4), with about
    ``density`` of it nonzero (less from a ratio of about 3, where the pattern cannot hold that many).
    Each (2 x 4 pixel block, channel) holds nonzeros or not, and one that does holds ``k`` of its 8
    pixels, ``k`` one of the two counts whose block ratios bracket ``ratio``: runs of 4 pixels along a row
    and 2 x 2 tiles see the same clustering, as in a real ReLU output."""
    N, C, H, W = shape
    if H % 2 or W % 4:
        raise ValueError(f"union_pattern: the height must be even and the width a multiple of 4, got {H}x{W}")
    r = min(4.0, max(1.0, float(ratio)))
    k_hi = next(k for k in range(8, 0, -1) if k == 1 or _block_ratio(k - 1) > r)  # ratio(k_hi) <= r
    k_lo = max(1, k_hi - 1)
    e = {k: _nonempty_runs(k) for k in (k_lo, k_hi)}
    den = r * (k_lo - k_hi) - 4.0 * (e[k_lo] - e[k_hi])
    p = 0.0 if den == 0 else min(1.0, max(0.0, (4.0 * e[k_hi] - r * k_hi) / den))  # P(k = k_lo)
    blocks = (N, C, H // 2, W // 4)
    k = torch.where(torch.rand(blocks) < p, k_lo, k_hi)
    mean_k = p * k_lo + (1.0 - p) * k_hi
    full = torch.rand(blocks) < min(1.0, 8.0 * density / mean_k)
    rank = torch.rand(*blocks, 8).argsort(-1).argsort(-1)  # k of a block's 8 pixels: rank below k
    keep = (rank < k.unsqueeze(-1)) & full.unsqueeze(-1)
    keep = keep.reshape(N, C, H // 2, W // 4, 2, 4).permute(0, 1, 2, 4, 3, 5).reshape(N, C, H, W)
    return torch.where(keep, torch.rand(N, C, H, W) + 0.1, torch.zeros(()))


def _conv_geo(x: Tensor, w: Tensor):
    from ..kernels.geometry import ConvGeometry

    return ConvGeometry.of_conv(x.shape, w.shape, (1, 1), (1, 1), (1, 1))


def _union_fwd_case(bf16: bool) -> Callable[..., Optional[Case]]:
    def case(r: float, N: int, C: int, H: int) -> Optional[Case]:
        from ..kernels import adaptive_union as u
        from ..kernels import adaptive_union_bf16 as b

        if not (b.union_dpbf16() and b.union_supported_bf16(C, C) if bf16 else u.union_supported(C, C)):
            return None
        x, w = union_pattern((N, C, H, H), r), torch.randn(C, C, 3, 3) * 0.05
        geo = _conv_geo(x, w)
        if bf16:
            op = b.union_operand_bf16(x.to(torch.bfloat16))
            wf2 = b.union_pair_packs(w, flipped=False).wf2

            def run(g: int) -> Callable[[], object]:
                return lambda: b.union_conv_fwd_bf16(op, w, None, geo, group=g, wf2=wf2)
        else:
            op = u.union_operand(x)
            wf = u.union_packs(w, flipped=False)[0]

            def run(g: int) -> Callable[[], object]:
                return lambda: u.union_conv_fwd(op, w, None, geo, wf=wf, group=g)

        return op.union_ratio(), {"low": run(4), "high": run(2)}

    return case


def _union_dy_case(r: float, N: int, C: int, H: int) -> Optional[Case]:
    from ..kernels import adaptive_union as u

    if not u.union_supported(C, C):
        return None
    x, w = _relu_input((N, C, H, H), 0.5), torch.randn(C, C, 3, 3) * 0.05
    geo = _conv_geo(x, w)
    xop = u.union_operand(x)
    gop = u.union_operand(union_pattern((N, C, H, H), r).contiguous(memory_format=torch.channels_last), relu=False)
    wfl = u.union_packs(w, flipped=True)[1]
    return gop.union_ratio(), {
        "low": lambda: u.union_conv_igrad(gop, None, xop, geo, wflip=wfl, group=4),
        "high": lambda: u.union_conv_igrad(gop, None, xop, geo, wflip=wfl, group=2),
    }


def _union_dx_x_case(r: float, N: int, C: int, H: int) -> Optional[Case]:
    from ..kernels import adaptive_union as u

    if not u.union_supported(C, C):
        return None
    x, w = union_pattern((N, C, H, H), r), torch.randn(C, C, 3, 3) * 0.05
    geo = _conv_geo(x, w)
    op = u.union_operand(x)
    wc = u.union_wc(u.union_packs(w, flipped=False)[0], C, C, 3, 3)
    dy = torch.randn(N, H, H, C)  # dense: the kernel's case (behind a BatchNorm)
    return op.union_ratio(), {
        "low": lambda: u.union_conv_igrad_x(op, dy, geo, wc=wc, lists=False),
        "high": lambda: u.union_conv_igrad_x(op, dy, geo, wc=wc, lists=True),
    }


_CASES: Dict[str, Callable[..., Optional[Case]]] = {
    "row_group.backward": _row_group_case,
    "sliced_ell.grad_input": _sliced_ell_case,
    "sliced_ell.fma_rows_bf16": _sliced_ell_rows_case,
    "grouped_nm.grad_weight": _grouped_nm_case,
    "bitmask.panel_bf16": _bitmask_panel_case(torch.bfloat16),
    "bitmask.panel_f32": _bitmask_panel_case(torch.float32),
    "bitmask.batch_panel_bf16": _bitmask_panel_case(torch.bfloat16),
    "bitmask.batch_panel_f32": _bitmask_panel_case(torch.float32),
    "bitmask.stream_bf16": _bitmask_stream_case(torch.bfloat16, "bitmask.stream_bf16"),
    "bitmask.stream_f32": _bitmask_stream_case(torch.float32, "bitmask.stream_f32"),
    "bitmask.batch_stream_bf16": _bitmask_stream_case(torch.bfloat16, "bitmask.batch_stream_bf16", panel=False),
    "bitmask.row_blocks_f32": _bitmask_row_blocks_case,
    "bitmask.fused_f32": _bitmask_fused_case,
    "nm24.panel_bf16": _nm24_case,
    "relu_compact.linear": _relu_linear_case,
    "relu_compact.conv2d": _relu_conv2d_case,
    "conv_union.fwd_group4": _union_fwd_case(bf16=False),
    "conv_union.fwd_group4_bf16_tiles": _union_fwd_case(bf16=True),
    "conv_union.dy_group4": _union_dy_case,
    "conv_union.dx_x_lists": _union_dx_x_case,
}

#: the size (out_features, in_features) and token count an explicit ``shape`` / ``tokens`` completes
WEIGHT_SHAPE, WEIGHT_TOKENS = (768, 768), 512


def _dims(name: str, shape: Optional[Tuple[int, int]], tokens: Optional[int]) -> List[Dims]:
    """The shapes ``name`` is timed at: its own (``Crossover.shapes``), or one built from an explicit
    ``shape`` (out, in) and ``tokens`` (a token crossover: ``shape`` only, its grid is the tokens)."""
    c = CROSSOVERS[name]
    if c.unit == "tokens":
        return list(c.shapes) if shape is None else [tuple(shape)]
    if c.unit == "ratio":  # its own conv shapes, or a 3x3 conv over 16x16 images with in_features channels
        return list(c.shapes) if shape is None else [(2, int(shape[1]), 16)]
    own = c.shapes
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
    """The crossover at ``dims`` and the high / low side time ratio at each grid point built (keyed by it;
    the high side's fastest way). A density crossover: the highest density at which the low side wins (0.0
    if none). A token or ratio crossover: the top of the points up to which the low side wins at every one
    (one below the grid's first token count, or a ratio of 1, if it loses there). A side that cannot run
    on this CPU: the crossover's ``absent`` side everywhere (the high side unless it says otherwise)."""
    unit = CROSSOVERS[name].unit
    tokens = unit == "tokens"
    # a token or ratio crossover below which nothing was timed: the high side from the smallest there is
    floor = {"tokens": min(grid) - 1, "ratio": 1.0}.get(unit, 0.0)
    timings: Dict[float, Dict[str, float]] = {}
    for d in sorted(grid):
        case = _CASES[name](d, *dims)
        if case is None:
            if CROSSOVERS[name].absent == "low":
                return (int(max(grid)) if tokens else max(grid) if unit == "ratio" else 1.0), {}
            return floor, {}
        actual, fns = case
        actual = round(float(actual), 2 if unit == "ratio" else 4)
        if actual not in timings:
            with torch.no_grad():
                ms = round_robin_ms(fns, rounds)
            timings[actual] = {"low": ms["low"], "high": min(v for k, v in ms.items() if k != "low")}
    ratios = {str(int(d) if tokens else d): round(ms["high"] / ms["low"], 3) for d, ms in timings.items()}
    if unit != "density":
        best = floor
        for d in sorted(timings):
            if timings[d]["low"] >= timings[d]["high"]:
                break
            best = d
        return (int(best) if tokens else best), ratios
    wins = [d for d, ms in timings.items() if ms["low"] < ms["high"]]
    return (max(wins) if wins else 0.0), ratios


def refit(
    cost_model: Optional[CostModel] = None,
    names: Optional[Sequence[str]] = None,
    densities: Optional[Sequence[float]] = None,
    shape: Optional[Tuple[int, int]] = None,
    tokens: Optional[int] = None,
    rounds: int = 5,
) -> Dict[str, float]:
    """Time the low and high side of each crossover (``names``; None: every one with
    ``refit_by_default``) at the points of its grid (side by side, round robin,
    at the current thread count) on each of its shapes, store the median over the shapes of each shape's
    crossover (:func:`_crossover_at`) and return them by name. A layout that cannot hold a density exactly
    is timed at the nearest one it holds (grouped_nm: n/8). ``densities``: the grid of every density
    crossover (None: each one's own, ``Crossover.grid``, else :data:`DEFAULT_DENSITIES`); a token
    crossover always takes its own, a ratio crossover too. ``shape`` (out, in) / ``tokens``: time every
    crossover at that one size instead of its own shapes (:data:`WEIGHT_SHAPE`, :data:`WEIGHT_TOKENS`
    for what is not given; a token crossover takes ``shape`` only, a ratio crossover a 16x16 conv with
    ``shape[1]`` channels)."""
    cm = cost_model if cost_model is not None else default_cost_model()
    names = [n for n, c in CROSSOVERS.items() if c.refit_by_default] if names is None else list(names)
    for n in names:
        crossover(n)  # a ValueError names an unknown crossover
    if densities is not None and (not densities or not all(0 < d < 1 for d in densities)):
        raise ValueError(f"refit: densities must be fractions in (0, 1), got {list(densities)}")
    out: Dict[str, float] = {}
    for name in names:
        c = CROSSOVERS[name]
        key = UNITS[c.unit]
        if c.unit != "density":
            grid = c.grid
        else:
            grid = densities if densities is not None else (c.grid or DEFAULT_DENSITIES)
        per_shape = []
        for dims in _dims(name, shape, tokens):
            best, ratios = _crossover_at(name, dims, grid, rounds)
            per_shape.append({"dims": list(dims), key: best, "ratios": ratios})
        bests = sorted(p[key] for p in per_shape)
        median = bests[(len(bests) - 1) // 2]  # the lower median: one of the measured points
        cm.set_fit(
            PREFIX + name,
            {
                key: median,
                "threads": torch.get_num_threads(),
                "ratios": next(p["ratios"] for p in per_shape if p[key] == median),
                "shapes": per_shape,
            },
            save=False,
        )
        out[name] = median
    cm.save()
    return out
