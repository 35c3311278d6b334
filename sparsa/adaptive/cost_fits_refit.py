"""Refit the conv backward cost models of :mod:`sparsa.adaptive.cost_fits` on this CPU (``sparsa cost --refit``).

Each family of kernels is timed side by side (round robin, the fastest of a few rounds) on synthetic
stride-1 3x3 convs with clustered zeros at a few densities of relu(x) and dY, and the coefficients of its
models are fitted by least squares and stored in the cost table, unless the timings fit too poorly (a busy
machine): such a model keeps its coefficients and is reported as skipped. The list kernels are timed on
four convs (64 and 128 channels, in = out and in != out both ways) and fitted over all of them at once; the
union kernels on one, whose size-class terms (``big_weight``, ``small_c``) are not varied and keep their
defaults. Only kernels this
CPU runs are timed: the union kernels need AVX-512 and the native build, the list kernels the native build;
the others are reported as skipped, with the reason.

Example::

    >>> from sparsa.cost_model import CostModel
    >>> from sparsa.adaptive.cost_fits_refit import refit
    >>> fitted, skipped = refit(CostModel(None), names=["conv_list.dw.dy"], shape=(2, 16, 8, 8), rounds=1,
    ...                         max_residual=float("inf"))
    >>> sorted(fitted) + sorted(skipped)
    ['conv_list.dw.dy']
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..cost_model import CostModel, default_cost_model
from ..kernels import adaptive as _k
from ..kernels import adaptive_union as _u
from ..kernels import adaptive_union_bf16 as _b
from . import cost_fits as _fits
from .compaction import DEFAULT_SLICE
from .conv import dy_path_terms

__all__ = ["refit", "skip_reason"]

CL = torch.channels_last
#: relu(x) and dY densities timed (3 points per fitted line)
DENSITIES = (0.1, 0.25, 0.5)
#: a refit whose timings stray further than this from its line (RMS over the mean) is not stored
MAX_RESIDUAL = 0.3
#: a model's coefficients and the relative residual of the fit behind them
Fit = Tuple[Dict[str, float], float]


def skip_reason(kernels: str) -> Optional[str]:
    """Why this CPU cannot time the ``kernels`` family ("union" / "list"), or None when it can."""
    if not _k.native_available():
        return "the native adaptive kernels are not built here (no compiler, or SPARSA_NO_NATIVE is set)"
    if kernels in ("union", "union_bf16") and not _u.union_native():
        return "the union kernels need AVX-512 (this CPU runs the list kernels instead)"
    if kernels == "union_bf16" and not _b.union_dpbf16():
        return "the bf16 union kernels need AVX512-BF16 (bf16 inputs run the fp32 kernels here)"
    return None


def _fastest_ms(fns: Dict[str, Callable[[], object]], rounds: int) -> Dict[str, float]:
    """Fastest ms per call of each function over ``rounds`` round-robin rounds, after one warm-up call each.
    The fastest rather than the median: other work on the machine only ever adds time, and a fit needs the
    kernels' own cost ratios, steady from one refit to the next."""
    for fn in fns.values():
        fn()
    best = {k: float("inf") for k in fns}
    for _ in range(max(1, rounds)):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], (time.perf_counter() - t0) * 1e3)
    return best


def _clustered(shape: Sequence[int], density: float, gen: torch.Generator) -> Tensor:
    """A mask with about ``density`` of ones whose zeros cluster per pixel, like a ReLU output's."""
    N, C, H, W = shape
    a = torch.randn(*shape, generator=gen) + 0.5 * torch.randn(N, 1, H, W, generator=gen)
    flat = a.reshape(-1)[:200000]
    t = flat.kthvalue(max(1, min(flat.numel(), round((1.0 - density) * flat.numel())))).values
    return a > t


def _lstsq(rows: List[List[float]], ys: List[float]) -> Tuple[List[float], float]:
    """Least-squares coefficients, and the RMS residual relative to the mean of ``ys`` (how well they fit)."""
    A = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
    coef = torch.linalg.lstsq(A, y).solution
    rel = float((A @ coef - y).pow(2).mean().sqrt() / y.abs().mean().clamp_min(1e-30))
    return [float(v) for v in coef.squeeze(1)], rel


def _through_origin(xs: List[float], ys: List[float]) -> Tuple[float, float]:
    """Slope of the least-squares line through the origin, and its relative residual (as :func:`_lstsq`)."""
    (k,), rel = _lstsq([[x] for x in xs], ys)
    return k, rel


def _inputs(shape, densities, gen, O=None):
    """Per density, relu(x) (channels-last, >= 0) and dY (channels-last, signed, ``O`` channels; default C)
    with clustered zeros."""
    N, C, H, W = shape
    O = C if O is None else O
    xs = {
        d: (torch.randn(*shape, generator=gen).abs() * _clustered(shape, d, gen)).contiguous(memory_format=CL)
        for d in densities
    }
    gys = {
        d: (torch.randn(N, O, H, W, generator=gen) * _clustered((N, O, H, W), d, gen)).contiguous(memory_format=CL)
        for d in densities
    }
    return xs, gys


def _dy_row(nnz_dy: int, numel_dy: int, C: int, O: int) -> List[float]:
    """The regressors of ``conv_list.dx.dy``'s coefficients ``per_nnz`` and ``fixed``, as ``conv._dy_rule``
    weighs them (its ``sqrt(max(1, C / O))`` factor included)."""
    f = max(1.0, C / O) ** 0.5
    return [v * f for v in dy_path_terms(nnz_dy, numel_dy, C, O)]


def _time_list(shape, densities, rounds) -> Dict[str, list]:
    """Time the list kernels on one stride-1 3x3 conv ``(N, C, H, W, O)`` (the lists of :data:`_LIST_TIMINGS`)."""
    acc: Dict[str, list] = {k: [] for k in _LIST_TIMINGS}
    gen = torch.Generator().manual_seed(0)
    N, C, H, W, O = shape
    S = DEFAULT_SLICE
    w = torch.randn(O, C, 3, 3, generator=gen) * 0.05
    geo = _k.geometry((N, C, H, W), w.shape, (1, 1), (1, 1), (1, 1), S)
    _, wc = _k.packed_weight(w)
    wfl = _k.packed_weight_flipped(w)
    xs, gys = _inputs((N, C, H, W), densities, gen, O)
    g_dense = torch.randn(N, H, W, O, generator=gen)
    for dx_ in densities:
        x = xs[dx_]
        cnt, idx, val = _k.compact(x, S)
        nnz_x = int(cnt.sum())
        fns: Dict[str, Callable[[], object]] = {
            "x": lambda: _k.conv_bwd_packed(cnt, idx, val, g_dense, wc, geo, True, True, False),
            "both": lambda: _k.conv_bwd_packed(cnt, idx, val, g_dense, wc, geo, True, True, True, w.stride()),
            "dw_x": lambda: _k.conv_bwd_packed(cnt, idx, val, g_dense, wc, geo, True, False, True, w.stride()),
        }
        nnz_g = {}
        for dg in densities:
            gn = gys[dg]
            gc, gi, gv = _k.compact_signed(gn, S)
            nnz_g[dg] = int(gc.sum())

            def dy(gn=gn, cnt=cnt, idx=idx):  # compacting dY is part of the path's cost
                gc, gi, gv = _k.compact_signed(gn, S)
                return _k.conv_igrad_dy(gc, gi, gv, wfl, cnt, idx, geo, S, True)

            fns[f"dy{dg}"] = dy
            fns[f"dwdy{dg}"] = lambda gc=gc, gi=gi, gv=gv, x=x: _k.conv_wgrad_dy(
                gc, gi, gv, x.permute(0, 2, 3, 1), geo, S, w.stride()
            )
        with torch.no_grad():
            t = _fastest_ms(fns, rounds)
        acc["x_work"].append(nnz_x * O)
        acc["x_t"].append(t["x"])
        acc["both_share"].append((t["both"] - t["dw_x"]) / t["x"])
        acc["dwx_work"].append(nnz_x * O)
        acc["dwx_t"].append(t["dw_x"])
        for dg in densities:
            acc["dy_rows"].append(_dy_row(nnz_g[dg], N * H * W * O, C, O))
            acc["dy_t"].append(t[f"dy{dg}"])
            acc["dwdy_work"].append(nnz_g[dg] * C)
            acc["dwdy_t"].append(t[f"dwdy{dg}"])
    return acc


def _refit_list(shapes, densities, rounds) -> Dict[str, Fit]:
    """``conv_list.dx.dy`` and ``conv_list.dw.dy`` from the list kernels, one least-squares fit over the
    timings of every shape ``(N, C, H, W, O)``."""
    return _fit_list([_time_list(shape, densities, rounds) for shape in shapes])


#: what :func:`_time_list` collects: work and time of the x path, of the dY input gradient (regressor rows),
#: of both weight gradients, and the x path's share of the fused dx + dW call
_LIST_TIMINGS = ("x_work", "x_t", "both_share", "dwx_work", "dwx_t", "dy_rows", "dy_t", "dwdy_work", "dwdy_t")


def _fit_list(per_shape: Sequence[Mapping[str, list]]) -> Dict[str, Fit]:
    """The list models' coefficients from :func:`_time_list`'s timings of one or more shapes. The rules
    compare the dY path with the x path of the same layer, so each shape's dY times are first divided by
    its own x-path unit (ms per unit of work), then one line is fitted through all of them."""
    rows, ys, r_x, g_work, g_t, r_a = [], [], 0.0, [], [], 0.0
    for acc in per_shape:
        u, r = _through_origin(acc["x_work"], acc["x_t"])  # ms per unit of the x path's work
        a, ra = _through_origin(acc["dwx_work"], acc["dwx_t"])  # the same for the x-driven weight gradient
        r_x, r_a = max(r_x, r), max(r_a, ra)
        rows += acc["dy_rows"]
        ys += [t / u for t in acc["dy_t"]]
        g_work += acc["dwdy_work"]
        g_t += [t / a for t in acc["dwdy_t"]]
    (per_nnz, fixed), r_dy = _lstsq(rows, ys)
    b, r_b = _through_origin(g_work, g_t)  # dY-driven weight gradient in units of the x-driven one
    margin = _fits.builtin("conv_list.dx.dy")["margin"]  # a safety factor, not measured
    share = min(1.0, max(0.05, statistics.median([v for acc in per_shape for v in acc["both_share"]])))
    return {
        "conv_list.dx.dy": (
            {
                "per_nnz": max(0.0, per_nnz),
                "fixed": max(0.0, fixed),
                "margin": margin,
                "margin_with_dw": margin * share,
            },
            max(r_x, r_dy),
        ),
        "conv_list.dw.dy": ({"ratio": 1.0 / max(1e-30, b)}, max(r_a, r_b)),
    }


def _refit_union(shapes, densities, rounds) -> Dict[str, Fit]:
    """The ``conv_union.*`` models: each kernel's time over the dense GEMM's, against d_x or d_g, on the
    first shape (C = O; the size-class terms are not fitted)."""
    return _time_and_fit_union(shapes, densities, rounds, bf16=False)


def _refit_union_bf16(shapes, densities, rounds) -> Dict[str, Fit]:
    """The ``conv_union_bf16.*`` models, as :func:`_refit_union` for a bf16 input: the bf16 kernels (the list
    kernels widen as they read) and the fp32 union dY-side weight gradient on the widened operands, over the
    dense bf16 GEMMs."""
    return _time_and_fit_union(shapes, densities, rounds, bf16=True)


def _time_and_fit_union(shapes, densities, rounds, bf16: bool) -> Dict[str, Fit]:
    gen = torch.Generator().manual_seed(0)
    N, C, H, W, _ = shapes[0]
    shape = (N, C, H, W)
    O = C
    native = _b.union_dpbf16() if bf16 else _u.union_native()
    dt = torch.bfloat16 if bf16 else torch.float32
    w = torch.randn(O, C, 3, 3, generator=gen) * 0.05
    wd = w.to(dt)  # the dense GEMMs' weight (autocast rounds it)
    geo = _k.geometry(shape, w.shape, (1, 1), (1, 1), (1, 1), DEFAULT_SLICE)
    if not native:
        wf = wfl = None
    elif bf16:
        packs = _b.union_pair_packs(w)
        wf, wfl = packs.wc, packs.wfl2  # bf16: the input gradient's rows in the forward pack's place
    else:
        wf, wfl = _u.union_packs(w)
    xs, gys = _inputs(shape, densities, gen)
    xs, gys = {d: v.to(dt) for d, v in xs.items()}, {d: v.to(dt) for d, v in gys.items()}
    g_dense = torch.randn(N, O, H, W, generator=gen).to(dt).contiguous(memory_format=CL)
    gd = g_dense.permute(0, 2, 3, 1)  # NHWC, contiguous: what the backward passes the kernels
    pts: Dict[str, List[Tuple[float, float]]] = {
        k: [] for k in ("dx.x", "dx.dy", "dw.lists", "dw.x", "dw.dy", "dw.dy_lists")
    }
    operand = _b.union_operand_bf16 if bf16 else _u.union_operand
    wide = _b.widened if bf16 else (lambda o: o)  # the union dY-side weight gradient is fp32 (widening timed too)

    def bw(x, mask, stride=1, gy=g_dense):
        return torch.ops.aten.convolution_backward(
            gy, x, wd, None, [stride] * 2, [1, 1], [1, 1], False, [0, 0], 1, mask
        )

    def dx_x(op):  # fp32: the backward rebuilds the weight rows from the forward pack each time (part of the cost)
        if bf16:
            return _b.union_conv_igrad_x_bf16(op, gd, geo, weight=w, wc=wf if native else None)
        return _u.union_conv_igrad_x(op, gd, geo, weight=w, wc=_u.union_wc(wf, O, C, 3, 3) if native else None)

    def dx_dy(gop, op):
        if bf16:
            return _b.union_conv_igrad_bf16(gop, w, op, geo, wfl2=wfl)
        return _u.union_conv_igrad(gop, w, op, geo, wflip=wfl)

    for dx_ in densities:
        x = xs[dx_]
        op = operand(x)
        r = op.union_ratio()
        r = 2.0 if r is None else min(4.0, max(1.0, r))
        fns: Dict[str, Callable[[], object]] = {
            "dx_dense": lambda: bw(x, [True, False, False]),
            "dw_dense": lambda: bw(x, [False, True, False]),
            "dx_x": lambda: dx_x(op),
            "dw_lists": lambda: _u.union_conv_wgrad(op, gd, geo, w.stride(), lists=True),  # bf16 read as it is
            "dw_x": lambda: _u.union_conv_wgrad(wide(op), gd.float(), geo, w.stride()),
        }
        for dg in densities:
            g = gys[dg]
            fns[f"dx_dy{dg}"] = lambda g=g: dx_dy(operand(g, relu=False), op)
            fns[f"dw_dy{dg}"] = lambda g=g: _u.union_conv_wgrad_dy(
                wide(operand(g, relu=False)), wide(op).values, geo, w.stride()
            )
            fns[f"dw_dyl{dg}"] = lambda g=g: _u.union_conv_wgrad_dy(
                operand(g, relu=False), op.values, geo, w.stride(), lists=True
            )
        with torch.no_grad():
            t = _fastest_ms(fns, rounds)
        pts["dx.x"].append((dx_, t["dx_x"] / t["dx_dense"]))
        pts["dw.lists"].append((dx_, t["dw_lists"] / t["dw_dense"]))
        pts["dw.x"].append((dx_ * r, t["dw_x"] / t["dw_dense"]))
        for dg in densities:
            pts["dx.dy"].append((dg, t[f"dx_dy{dg}"] / t["dx_dense"]))
            pts["dw.dy"].append((dg, t[f"dw_dy{dg}"] / t["dw_dense"]))
            pts["dw.dy_lists"].append((dg, t[f"dw_dyl{dg}"] / t["dw_dense"]))
    out: Dict[str, Fit] = {}
    if not bf16:
        # strided convs: the dense input gradient, then masked by relu(x) != 0, against the dense one alone
        x = xs[sorted(densities)[len(densities) // 2]]
        g2 = torch.randn(N, O, (H + 1) // 2, (W + 1) // 2, generator=gen).contiguous(memory_format=CL)
        nz = x != 0
        with torch.no_grad():
            t = _fastest_ms(
                {
                    "plain": lambda: bw(x, [True, False, False], 2, g2),
                    "masked": lambda: bw(x, [True, False, False], 2, g2)[0].mul_(nz),
                },
                rounds,
            )
        out["conv_union.dx.dense"] = ({"base": t["masked"] / t["plain"]}, 0.0)
    family = "conv_union_bf16." if bf16 else "conv_union."
    for short, slope in (
        ("dx.x", "per_dx"),
        ("dx.dy", "per_dg"),
        ("dw.lists", "per_dx"),
        ("dw.x", "per_dx_ratio"),
        ("dw.dy", "per_dg"),
        ("dw.dy_lists", "per_dg"),
    ):
        name = family + short
        (base, k), rel = _lstsq([[1.0, v] for v, _ in pts[short]], [y for _, y in pts[short]])
        c = dict(_fits.builtin(name))  # size-class terms: not varied here, defaults kept
        c.update(base=base, **{slope: k})
        out[name] = (c, rel)
    return out


Shape = Tuple[int, int, int, int, int]  # (N, C, H, W, O) of a stride-1 3x3 conv
#: each family's timer and the convs it is timed on: for the list kernels channels in = out at two
#: sizes, and in != out both ways (the models' C / O terms)
_FAMILIES: Dict[str, Tuple[Callable[..., Dict[str, Fit]], Tuple[Shape, ...]]] = {
    "list": (_refit_list, ((16, 64, 32, 32, 64), (16, 128, 16, 16, 128), (16, 64, 16, 16, 128), (16, 128, 16, 16, 64))),
    "union": (_refit_union, ((16, 128, 16, 16, 128),)),
    "union_bf16": (_refit_union_bf16, ((16, 128, 16, 16, 128),)),
}


def _shape5(shape: Sequence[int]) -> Shape:
    """``(N, C, H, W)`` (C = O) or ``(N, C, H, W, O)`` as the latter."""
    if len(shape) not in (4, 5) or not all(isinstance(v, int) and v > 0 for v in shape):
        raise ValueError(f"refit: shape must be (N, C, H, W) or (N, C, H, W, O) positive ints, got {tuple(shape)}")
    return tuple(shape) if len(shape) == 5 else (*shape, shape[1])  # type: ignore[return-value]


def refit(
    cost_model: Optional[CostModel] = None,
    names: Optional[Sequence[str]] = None,
    shape: Optional[Sequence[int]] = None,
    densities: Sequence[float] = DENSITIES,
    rounds: int = 5,
    force: Sequence[str] = (),
    max_residual: float = MAX_RESIDUAL,
) -> Tuple[Dict[str, Mapping[str, float]], Dict[str, str]]:
    """Time the kernels of the cost models ``names`` (default: all) this CPU runs, fit and store their
    coefficients; returns ``(fitted, skipped)``: the coefficients by name, and why each other name was not
    timed. ``shape`` ``(N, C, H, W)`` (C = O) or ``(N, C, H, W, O)`` replaces each family's convs; ``force`` names
    families ("union", "union_bf16", "list") to time even where the native kernels are missing (their PyTorch fallbacks
    then run: for tests of the procedure, not figures to keep). A model whose timings fit its line worse than
    ``max_residual`` (RMS residual over the mean) is not stored: it is skipped as too unsteady."""
    cm = cost_model if cost_model is not None else default_cost_model()
    names = list(_fits.COST_FITS) if names is None else list(names)
    for n in names:
        _fits._check_name(n)  # a ValueError names an unknown model
    if not densities or not all(0 < d <= 1 for d in densities) or len(set(densities)) < 2:
        raise ValueError(f"refit: densities must be two or more distinct fractions in (0, 1], got {list(densities)}")
    fitted: Dict[str, Mapping[str, float]] = {}
    skipped: Dict[str, str] = {}
    for family, (run, default_shape) in _FAMILIES.items():
        mine = [n for n in names if _fits.COST_FITS[n].kernels == family]
        if not mine:
            continue
        why = None if family in force else skip_reason(family)
        if why is not None:
            skipped.update({n: why for n in mine})
            continue
        shapes = (_shape5(shape),) if shape is not None else default_shape
        threads = torch.get_num_threads()
        for n, (c, rel) in run(shapes, tuple(sorted(densities)), rounds).items():
            if n not in mine:
                continue
            if rel > max_residual:
                skipped[n] = (
                    f"the timings were too unsteady to fit (residual {rel:.0%} of the mean time, above "
                    f"{max_residual:.0%}): rerun on an idle machine"
                )
                continue
            params = {k: round(v, 4) for k, v in c.items()}
            cm.set_fit(
                _fits.PREFIX + n,
                {**params, "residual": round(rel, 4), "shapes": [list(x) for x in shapes], "threads": threads},
                save=False,
            )
            fitted[n] = _fits.coefficients(n, cm)
    cm.save()
    return fitted, skipped
