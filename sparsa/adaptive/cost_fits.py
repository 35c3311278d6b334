"""Cost models of the activation-sparse conv backward: fitted coefficients as data, refitted per CPU.

``relu_conv2d``'s backward picks a kernel per GEMM from linear cost models in the densities of relu(x)
(``d_x``) and of dY (``d_g``). Each model is named here with the coefficients it was first fitted with as its
default, and with those measured on a CPU class, which replace the default there (``CostFit.by_class``, keyed
by :func:`sparsa.cpu.cpu_class`); ``sparsa cost --refit`` (:func:`sparsa.adaptive.cost_fits_refit.refit`)
times the kernels on this CPU and stores new coefficients in the one cost table (:mod:`sparsa.cost_model`, a
fitted model under ``costfit|<name>``), which then override the default; ``sparsa cost --clear`` forgets them
again.

- ``conv_union.*``: the union (bitmask-operand) kernels, costs relative to the dense (oneDNN) GEMM;
  ``big_weight`` applies when ``C * O >= BIG_WEIGHT``, ``small_c`` when ``C <= SMALL_C``.
- ``conv_union_bf16.*``: the same choices for a bf16 input under autocast, relative to the dense bf16 GEMM.
- ``conv_list.*``: the list kernels' dY-driven input and weight gradients, in units of the x-driven
  kernel's work (see :mod:`sparsa.adaptive.conv`).

Example::

    >>> from sparsa.adaptive import cost_fits
    >>> from sparsa.cost_model import CostModel
    >>> cm = CostModel(None)
    >>> cost_fits.coefficients("conv_union.dx.dy", cm)["per_dg"]
    0.65
    >>> cm.set_fit(cost_fits.PREFIX + "conv_union.dx.dy", {"base": 0.4, "per_dg": 0.5})
    >>> cost_fits.coefficients("conv_union.dx.dy", cm)["per_dg"]
    0.5
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Dict, Mapping, Optional

from .. import cpu
from ..cost_model import CostModel, default_cost_model

__all__ = [
    "CostFit",
    "COST_FITS",
    "builtin",
    "measured_on_this_class",
    "coefficients",
    "stored",
    "table",
    "PREFIX",
    "BIG_WEIGHT",
    "SMALL_C",
]

PREFIX = "costfit|"

#: size classes of the union fits: weights with ``C * O`` at least this, inputs with at most ``SMALL_C`` channels
BIG_WEIGHT = 512 * 256
SMALL_C = 64


@dataclass(frozen=True)
class CostFit:
    """A named cost model: its coefficients' defaults, what it prices and which kernels it needs."""

    defaults: Mapping[str, float]
    decides: str
    #: "union" (native union kernels: AVX-512), "union_bf16" (those with bf16 operands: AVX512-BF16) or "list"
    #: (the list kernels: any native build)
    kernels: str
    #: coefficients ``sparsa cost --refit`` measured on a CPU class (2 threads; the fitted ones, the others as
    #: in ``defaults``), which replace ``defaults`` there until this machine is refitted
    by_class: Mapping[str, Mapping[str, float]] = field(default_factory=dict)


def _fit(
    kernels: str, decides: str, by_class: Optional[Dict[str, Dict[str, float]]] = None, **defaults: float
) -> CostFit:
    measured = {cls: MappingProxyType({**defaults, **c}) for cls, c in (by_class or {}).items()}
    return CostFit(MappingProxyType(dict(defaults)), decides, kernels, MappingProxyType(measured))


COST_FITS: Dict[str, CostFit] = {
    "conv_union.dx.x": _fit(
        "union",
        "input gradient at relu(x)'s nonzeros: base + per_dx d_x (+ big_weight)",
        {"amd-avx512": {"base": 0.13, "per_dx": 1.63}, "intel-amx": {"base": 0.25, "per_dx": 1.24}},
        base=0.2,
        per_dx=1.6,
        big_weight=0.1,
    ),
    "conv_union.dx.dy": _fit(
        "union",
        "input gradient over dY's mask (stride 1): base + per_dg d_g",
        {"amd-avx512": {"base": 0.38, "per_dg": 1.24}, "intel-amx": {"base": 0.49, "per_dg": 1.77}},
        base=0.5,
        per_dg=0.65,
    ),
    "conv_union.dx.dense": _fit(
        "union",
        "strided input gradient, dense then masked: base",
        {"amd-avx512": {"base": 1.08}, "intel-amx": {"base": 1.22}},
        base=1.03,
    ),
    "conv_union.dw.lists": _fit(
        "union",
        "weight gradient, per-channel lists of relu(x)'s nonzeros: base + per_dx d_x (+ small_c, + big_weight)",
        {"amd-avx512": {"base": 0.16, "per_dx": 1.12}, "intel-amx": {"base": 0.11, "per_dx": 2.3}},
        base=0.04,
        per_dx=1.45,
        small_c=0.08,
        big_weight=0.12,
    ),
    "conv_union.dw.x": _fit(
        "union",
        "weight gradient over relu(x)'s 4-pixel unions: base + per_dx_ratio d_x r "
        "(r: union ratio, 2 when unknown; + big_weight)",
        {"amd-avx512": {"base": 0.14, "per_dx_ratio": 0.86}, "intel-amx": {"base": 0.29, "per_dx_ratio": 0.98}},
        base=0.3,
        per_dx_ratio=0.65,
        big_weight=-0.1,
    ),
    "conv_union.dw.dy": _fit(
        "union",
        "weight gradient over dY's mask: base + per_dg d_g",
        {"amd-avx512": {"base": 0.38, "per_dg": 1.2}, "intel-amx": {"base": 0.63, "per_dg": 1.61}},
        base=0.45,
        per_dg=0.75,
    ),
    # defaults: a refit on an amd-avx512 machine (docs/benchmarks.md)
    "conv_union.dw.dy_lists": _fit(
        "union",
        "weight gradient, per-channel lists of dY's nonzeros (stride 1): base + per_dg d_g",
        {"intel-amx": {"base": 0.2, "per_dg": 3.08}},
        base=0.11,
        per_dg=1.25,
    ),
    # bf16 mode (bf16 x under autocast, CPUs with AVX512-BF16): costs relative to the dense bf16 GEMM; the input
    # gradients and the union weight gradient run bf16 kernels, the list kernels read bf16 as they go, the union
    # dY-side weight gradient runs the fp32 one on the widened operands. Defaults: a refit on an amd-avx512 machine
    # (docs/benchmarks.md)
    "conv_union_bf16.dx.x": _fit(
        "union_bf16",
        "bf16 input gradient at relu(x)'s nonzeros: base + per_dx d_x (+ big_weight)",
        {"intel-amx": {"base": 0.1, "per_dx": 8.76}},
        base=0.16,
        per_dx=1.69,
        big_weight=0.1,
    ),
    "conv_union_bf16.dx.dy": _fit(
        "union_bf16",
        "bf16 input gradient over dY's mask (stride 1): base + per_dg d_g",
        {"intel-amx": {"base": 3.87, "per_dg": 6.21}},
        base=0.67,
        per_dg=0.86,
    ),
    "conv_union_bf16.dw.lists": _fit(
        "union_bf16",
        "weight gradient of bf16 operands, per-channel lists: base + per_dx d_x (+ small_c, + big_weight)",
        {"intel-amx": {"base": 0.07, "per_dx": 6.75}},
        base=0.04,
        per_dx=3.45,
        small_c=0.08,
        big_weight=0.12,
    ),
    "conv_union_bf16.dw.x": _fit(
        "union_bf16",
        "bf16 weight gradient over relu(x)'s 4-pixel unions: base + per_dx_ratio d_x r (+ big_weight)",
        {"intel-amx": {"base": 0.29, "per_dx_ratio": 3.28}},
        base=0.5,
        per_dx_ratio=1.72,
        big_weight=-0.1,
    ),
    "conv_union_bf16.dw.dy": _fit(
        "union_bf16",
        "weight gradient of bf16 operands over dY's mask: base + per_dg d_g",
        {"intel-amx": {"base": 1.99, "per_dg": 2.7}},
        base=1.04,
        per_dg=2.19,
    ),
    "conv_union_bf16.dw.dy_lists": _fit(
        "union_bf16",
        "weight gradient of bf16 operands, per-channel lists of dY's nonzeros (stride 1): base + per_dg d_g",
        {"intel-amx": {"base": 0.33, "per_dg": 5.27}},
        base=0.12,
        per_dg=3.3,
    ),
    "conv_list.dx.dy": _fit(
        "list",
        "input gradient over dY's nonzeros when (per_nnz nnz(dY) C + fixed numel(dY) O)"
        " sqrt(max(1, C/O)) < margin (margin_with_dw) nnz(x) O",
        {
            "amd-avx512": {"per_nnz": 0.3955, "fixed": 0.1035, "margin_with_dw": 0.514},
            "intel-amx": {"per_nnz": 0.3137, "fixed": 0.0837, "margin_with_dw": 0.628},
        },
        per_nnz=0.375,
        fixed=0.0625,
        margin=0.8,
        margin_with_dw=0.6,
    ),
    "conv_list.dw.dy": _fit(
        "list",
        "weight gradient over dY's nonzeros when nnz(dY) C < ratio nnz(x) O",
        {"amd-avx512": {"ratio": 0.98}, "intel-amx": {"ratio": 0.965}},
        ratio=0.75,
    ),
}


@functools.lru_cache(maxsize=1)
def _this_class() -> str:
    return cpu.cpu_class()


def builtin(name: str) -> Mapping[str, float]:
    """The coefficients ``name`` uses before a refit: those measured on this CPU class, else the defaults."""
    f = _check_name(name)
    return f.by_class.get(_this_class(), f.defaults)


def measured_on_this_class(name: str) -> bool:
    """Whether ``name`` has coefficients measured on this CPU class (``CostFit.by_class``)."""
    return _this_class() in _check_name(name).by_class


def _check_name(name: str) -> CostFit:
    f = COST_FITS.get(name)
    if f is None:
        raise ValueError(f"cost fit: unknown name {name!r}; known: {sorted(COST_FITS)}")
    return f


def _from_table(name: str, cm: CostModel) -> Optional[Mapping[str, float]]:
    fit = cm.fit(PREFIX + name)
    if fit is None:
        return None
    try:
        got = {k: float(fit[k]) for k in COST_FITS[name].defaults}
    except (KeyError, TypeError, ValueError):
        return None  # a fit missing a coefficient (an older model) is not trusted: the default stands
    return MappingProxyType(got)


# id(cost model) -> (the model, its fits_version, {name: stored coefficients or None}, {name: in effect}): the
# backward reads the coefficients on every call, the table changes only on a refit
_CACHE: Dict[int, tuple] = {}


def _tables(cm: Optional[CostModel]) -> tuple:
    cm = cm if cm is not None else default_cost_model()
    hit = _CACHE.get(id(cm))
    if hit is None or hit[0] is not cm or hit[1] != cm.fits_version:
        if len(_CACHE) > 16:
            _CACHE.clear()
        got = {n: _from_table(n, cm) for n in COST_FITS}
        used = {n: (c if c is not None else builtin(n)) for n, c in got.items()}
        hit = _CACHE[id(cm)] = (cm, cm.fits_version, MappingProxyType(got), MappingProxyType(used))
    return hit


def table(cost_model: Optional[CostModel] = None) -> Mapping[str, Mapping[str, float]]:
    """The coefficients in effect for every model by name (read-only; one cached lookup for a whole decision)."""
    return _tables(cost_model)[3]


def stored(name: str, cost_model: Optional[CostModel] = None) -> Optional[Mapping[str, float]]:
    """The refitted coefficients of ``name`` from the cost table (read-only), or None when not refitted."""
    _check_name(name)
    return _tables(cost_model)[2][name]


def coefficients(name: str, cost_model: Optional[CostModel] = None) -> Mapping[str, float]:
    """The coefficients of ``name`` in effect: refitted on this CPU if stored, else :func:`builtin`."""
    _check_name(name)
    return _tables(cost_model)[3][name]
