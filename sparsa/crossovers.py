"""Crossovers of the sparse kernels: data measured on this CPU, not constants in code.

A crossover splits a choice between two ways to compute a product in two. Most split by density
(``unit="density"``): below its crossover density a sparse kernel (a weight-sparse backward, the
activation-sparse ops of the ``relu_compact`` layout, or the bitmask panel kernels for many tokens)
computes a product faster than the dense path; above it, the dense path wins. Some split by token count
(``unit="tokens"``): up to the crossover the ``low`` side runs (the bitmask stream loop for decoding, the
row-block GEMMs of a bitmask expansion), above it the ``high`` one. The adaptive union kernels' group
size splits by an activation's union ratio (``unit="ratio"``, the work per kept element of 4-pixel
groups): 4-pixel groups up to the crossover, 2-pixel groups above.
Each crossover has a default, the one measured on this CPU class if one was (``Crossover.by_class``,
keyed by :func:`sparsa.cpu.cpu_class`), used until
``sparsa cost --refit`` (or :func:`refit`) times both sides on this CPU and stores the measured
crossover in the cost table (:mod:`sparsa.cost_model`, a fitted model under ``crossover|<name>``;
the measurement is in :mod:`sparsa.ops.crossover_refit`). ``sparsa cost --clear`` forgets it again.

Example::

    >>> from sparsa import crossovers
    >>> 0 < crossovers.crossover("row_group.backward") <= 1
    True
    >>> crossovers.CROSSOVERS["bitmask.stream_bf16"].unit
    'tokens'
    >>> crossovers.describe("bitmask.stream_bf16", 12)
    'stream up to 12 tokens, panel, amx or expand above'
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Tuple

from . import cpu
from .cost_model import CostModel, default_cost_model

__all__ = [
    "Crossover",
    "CROSSOVERS",
    "crossover",
    "token_crossover",
    "builtin_default",
    "measured_on_this_class",
    "describe",
    "nominal_density",
    "PREFIX",
    "UNITS",
]

PREFIX = "crossover|"
#: what a crossover's value counts, and the key its fit is stored under in the cost table
UNITS = {"density": "max_density", "tokens": "max_tokens", "ratio": "max_ratio"}


@dataclass(frozen=True)
class Crossover:
    """A named crossover: its default, what it decides and, if not the refit's usual ones, the grid of
    densities (or token counts) and the shapes ``sparsa cost --refit`` times it at (``shapes``: the
    dimensions its measurement in :mod:`sparsa.ops.crossover_refit` takes; the stored crossover is the
    median of the shapes' crossovers). ``unit``: ``"density"`` (the ``low`` side runs at or below the
    crossover density), ``"tokens"`` (the ``low`` side runs up to the crossover token count) or ``"ratio"``
    (the ``low`` side runs up to the crossover union ratio)."""

    default: float
    decides: str
    grid: Tuple[float, ...] = ()
    shapes: Tuple[Tuple[int, ...], ...] = ()
    #: the crossover ``sparsa cost --refit`` measured on a CPU class (2 threads), which replaces
    #: ``default`` there until this machine is refitted
    by_class: Mapping[str, float] = field(default_factory=dict)
    unit: str = "density"
    #: what runs at or below the crossover, and above it (for ``sparsa cost``)
    low: str = "sparse"
    high: str = "dense"
    #: whether ``sparsa cost --refit`` (``refit()`` without names) measures it; False where its timing
    #: case is not yet known to carry over to real models (``refit(names=[...])`` still measures it)
    refit_by_default: bool = True
    #: the side a refit stores where a side's kernel does not run on this CPU (nothing timed): ``"high"``
    #: (the crossover below every grid point) or ``"low"`` (the top of the grid)
    absent: str = "high"
    #: a token crossover at the top of its grid keeps the low side beyond it too (``"never"`` the high one)
    #: rather than handing the larger counts to the high side
    low_beyond_top: bool = False

    def __post_init__(self):
        if self.unit not in UNITS:
            raise ValueError(f"Crossover: unit must be one of {sorted(UNITS)}, got {self.unit!r}")
        if self.absent not in ("low", "high"):
            raise ValueError(f"Crossover: absent must be 'low' or 'high', got {self.absent!r}")


#: (out_features, in_features, tokens) of the weight-sparse backward crossovers: a BERT-base attention
#: projection and both MLP projections
_WEIGHT_SHAPES = ((768, 768, 512), (3072, 768, 512), (768, 3072, 512))

#: (out_features, in_features, tokens) of the bitmask prefill crossovers: 0.5B Llama projections (the
#: narrow k/v one, a square one, the MLP's up and down) at a 256-token prompt
_PREFILL_SHAPES = ((512, 1536, 256), (1536, 1536, 256), (4096, 1536, 256), (1536, 4096, 256))
_PANEL_DENSITIES = (0.3, 0.4, 0.5, 0.55, 0.6, 0.7)
#: the same projections at 16 tokens (batched decoding)
_BATCH_SHAPES = tuple((r, k, 16) for r, k, _ in _PREFILL_SHAPES)
_BATCH_DENSITIES = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
#: (out_features, in_features) of the same projections, for the token crossovers (timed at one density)
_WEIGHTS = tuple((r, k) for r, k, _ in _PREFILL_SHAPES)
_STREAM_TOKENS = (4, 6, 8, 10, 12, 16, 20, 24, 32)
#: token counts of the 2:4 panel crossover: decoding batches to a long prompt
_NM24_TOKENS = (1, 4, 8, 12, 16, 24, 32, 64, 128, 512, 2048)
#: the 0.5B projections and the 1B ones: a bf16 weight past the last-level cache (the 1B MLP's 32 MiB)
#: makes expanding it for batched decoding cost more
_DECODE_WEIGHTS = _WEIGHTS + ((512, 2048), (2048, 2048), (8192, 2048), (2048, 8192))
_ROW_BLOCK_TOKENS = (64, 128, 256, 384, 512, 768, 1024)
_FUSED_TOKENS = (32, 64, 96, 128, 192, 256, 384, 512)
_UNION_RATIOS = (1.2, 1.4, 1.65, 1.9, 2.2, 2.6, 3.0, 3.5)


def _union_group4(default: float, decides: str, shapes: Tuple[Tuple[int, ...], ...]) -> Crossover:
    """A union kernels' group-size crossover: 4-pixel groups up to a union ratio, 2-pixel above;
    refitted on request only (see the entries below)."""
    return Crossover(
        default,
        decides,
        _UNION_RATIOS,
        shapes,
        unit="ratio",
        low="4-pixel groups",
        high="2-pixel groups",
        refit_by_default=False,
    )


CROSSOVERS: Dict[str, Crossover] = {
    "row_group.backward": Crossover(
        0.15,
        "row_group grad_input and grad_weight: gather + batched matmul kernels against BLAS on the dense weight",
        shapes=_WEIGHT_SHAPES,
        by_class={"amd-avx2": 0.0625, "amd-avx512": 0.0625, "intel-amx": 0.0625},
    ),
    "sliced_ell.grad_input": Crossover(
        0.10,
        "sliced_ell grad_input: the forward kernel on the transposed pattern against grad_y @ dense weight",
        shapes=_WEIGHT_SHAPES,
        by_class={"amd-avx2": 0.0, "amd-avx512": 0.0, "intel-amx": 0.0},  # at most break-even from 0.0625 up
    ),
    # density = stored entries over out x in features; where unmeasured the dot-product rows stay on (as
    # before the FMA rows had 16-float vectors)
    "sliced_ell.fma_rows_bf16": Crossover(
        0.0,
        "sliced_ell_linear with bf16 tokens (two or more) on CPUs with AVX512-BF16: the FMA rows (widened "
        "to fp32) against the VDPBF16PS rows",
        (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5),
        ((768, 768, 1024), (3072, 768, 1024), (768, 3072, 1024)),
        {"intel-amx": 0.3},
        low="fma rows",
        high="dp rows",
    ),
    "grouped_nm.grad_weight": Crossover(
        0.15,
        "grouped_nm grad_weight: the sddmm kernel against dense grad_y.T @ x then masking",
        shapes=_WEIGHT_SHAPES,
        by_class={"amd-avx2": 0.125, "amd-avx512": 0.125, "intel-amx": 0.0},
    ),
    # density = the kept fraction of a bitmask weight; the two sides are its prefill strategies (many tokens).
    # Where unmeasured the bf16 panel stays off: a dense bf16 GEMM ranges from slow to AMX-fast by CPU.
    "bitmask.panel_bf16": Crossover(
        0.0,
        "bitmask_linear with bf16 tokens above BATCH_MAX_TOKENS: the panel kernel (only kept weights, "
        "VDPBF16PS) against the AMX tiles (where they run) or expanding the weight for the dense bf16 GEMM",
        _PANEL_DENSITIES,
        _PREFILL_SHAPES,
        {"amd-avx512": 0.5, "intel-amx": 0.0},
    ),
    # unmeasured classes: only weights sparse enough to win where dense fp32 has twice the panel's FMA width
    "bitmask.panel_f32": Crossover(
        0.3,
        "bitmask_linear with float32 tokens above BATCH_MAX_TOKENS: the panel kernel (only kept weights, "
        "AVX2 or AVX-512 FMA) against expanding the weight for the dense float32 GEMM",
        _PANEL_DENSITIES,
        _PREFILL_SHAPES,
        {"amd-avx512": 0.55, "intel-amx": 0.3},
    ),
    # the same two strategies from above the stream loop's tokens to 32 (batched decoding), where the
    # panel kernels run one narrow panel and the dense GEMM is short: timed at 16 tokens on copies of the
    # weight past the cache
    "bitmask.batch_panel_bf16": Crossover(
        0.0,
        "bitmask_linear with bf16 tokens above the stream loop's, up to BATCH_MAX_TOKENS: the panel kernel (one "
        "16-token panel) against the AMX tiles (where they run) or expanding the weight for the dense bf16 GEMM",
        _BATCH_DENSITIES,
        _BATCH_SHAPES,
        {"amd-avx512": 0.4, "intel-amx": 0.0},
    ),
    "bitmask.batch_panel_f32": Crossover(
        0.3,
        "bitmask_linear with float32 tokens above the stream loop's, up to BATCH_MAX_TOKENS: the panel kernel (one "
        "16-token panel) against expanding the weight for the dense float32 GEMM",
        _BATCH_DENSITIES,
        _BATCH_SHAPES,
        {"amd-avx512": 0.9, "intel-amx": 0.9},  # the top of the grid: the panel won at every density timed
    ),
    # tokens: how many tokens the bitmask stream loop takes (it re-expands the weight for every 4 tokens)
    # before the best many-token strategy (panel or expand) wins; timed at half the weight kept
    "bitmask.stream_bf16": Crossover(
        8,
        "bitmask_linear with bf16 tokens: the stream loop (decoding) against the fastest of the panel kernel, "
        "the AMX tiles (where they run) and the expansion",
        _STREAM_TOKENS,
        _WEIGHTS,
        {"amd-avx512": 12, "intel-amx": 3},
        unit="tokens",
        low="stream",
        high="panel, amx or expand",
    ),
    "bitmask.stream_f32": Crossover(
        8,
        "bitmask_linear with float32 tokens: the stream loop (decoding) against the faster of the panel "
        "kernel and the expansion",
        _STREAM_TOKENS,
        _WEIGHTS,
        {"amd-avx512": 6, "intel-amx": 10},
        unit="tokens",
        low="stream",
        high="panel, fused or expand",
    ),
    # tokens: above the stream loop's tokens, a bf16 weight too dense for the panel kernel runs the stream
    # loop up to this many tokens, else the expansion (timed at half the weight kept)
    "bitmask.batch_stream_bf16": Crossover(
        0,
        "bitmask_linear with bf16 tokens above the stream loop's, up to BATCH_MAX_TOKENS, on a weight too "
        "dense for the panel kernel: the stream loop against the AMX tiles (where they run) or expanding the "
        "weight for the dense bf16 GEMM",
        (4, 6, 8, 10, 12, 16, 20, 24, 32),
        _DECODE_WEIGHTS,
        {"amd-avx512": 16, "intel-amx": 3},
        unit="tokens",
        low="stream",
        high="amx or expand",
    ),
    # tokens: a 2:4 bf16 weight (the N:M layout) runs the bitmask strategies up to this many tokens, the 2:4
    # panel kernel above; at the top of the grid (the default: a dense bf16 GEMM on AMX tiles can win) never
    "nm24.panel_bf16": Crossover(
        _NM24_TOKENS[-1],
        "F.linear with bf16 tokens on a 2:4 weight: the bitmask strategies (stream, panel, expand) against the "
        "2:4 panel kernel (each kept pair one VDPBF16PS per 16 tokens, X reused across a block of rows)",
        _NM24_TOKENS,
        _WEIGHTS,
        {"amd-avx512": 12},
        unit="tokens",
        low="the bitmask strategies",
        high="the 2:4 panel kernel",
        absent="low",
        low_beyond_top=True,
    ),
    # tokens: a float32 expansion's row-block GEMMs (W_block @ X^T, then a transposed output) against
    # the whole weight expanded and one F.linear
    "bitmask.row_blocks_f32": Crossover(
        511,
        "bitmask_linear's float32 expansion: dense row blocks, each multiplied as W_block @ X^T, against "
        "the whole weight expanded into a kept buffer and one F.linear",
        _ROW_BLOCK_TOKENS,
        _WEIGHTS,
        {"amd-avx512": 256, "intel-amx": 63},
        unit="tokens",
        low="row blocks",
        high="the whole weight",
    ),
    # tokens: float32 tokens up to which the fused kernel (the weight expanded into L1 blocks inside an
    # AVX-512 GEMM) is the dense side; above, the expansion for a BLAS GEMM (timed at half the weight kept,
    # on weight copies past the cache, as a model's prefill reads each weight from memory)
    "bitmask.fused_f32": Crossover(
        128,
        "bitmask_linear's dense side for float32 tokens on CPUs with AVX-512: the fused kernel against "
        "expanding the weight for a BLAS GEMM",
        _FUSED_TOKENS,
        _WEIGHTS,
        {"intel-amx": 192},
        unit="tokens",
        low="fused",
        high="expand",
    ),
    # ratio: an activation's union ratio (4 x its (4-pixel group, channel) pairs with a nonzero / its
    # nonzeros, from 1 to 4): up to it the union kernels take 4 output pixels a group, above it 2, which
    # waste less on channels set in only some pixels but reuse each weight row half as often. Timed at
    # 25% nonzeros on synthetic patterns of each ratio, whose figures did not carry over to the
    # clustered activations of benchmarks/adaptive_bf16.py: refitted on request only (docs/benchmarks.md)
    "conv_union.fwd_group4": _union_group4(
        1.65,
        "the union conv forward on images without 2x2 tiles (float32 and bf16): 4-pixel groups against 2-pixel groups",
        # (batch, channels in = out, height = width) of 3x3 convs on small images: VGG's last stages
        ((16, 256, 8), (16, 512, 4), (16, 128, 8)),
    ),
    "conv_union.fwd_group4_bf16_tiles": _union_group4(
        2.4,
        "the bf16 union conv forward on images of 2x2 tiles: 4-pixel groups against 2-pixel groups",
        ((8, 128, 16), (8, 64, 32), (8, 256, 16)),
    ),
    # ratio: relu(x)'s union ratio, over runs of 4 pixels. Real VGG-16 activations (zeros clustered in space, ratio
    # 1.2-1.7) favour the union kernel's 4x4 register blocks; scattered zeros (ratio 1.8 and up) the exact lists
    "conv_union.dx_x_lists": Crossover(
        1.8,
        "the input gradient at relu(x)'s nonzeros (float32 and bf16): 4-pixel unions against per-channel pixel lists",
        _UNION_RATIOS,
        ((16, 64, 32), (16, 128, 16), (16, 256, 8)),
        unit="ratio",
        low="4-pixel unions",
        high="per-channel pixel lists",
        refit_by_default=False,
    ),
    "conv_union.dy_group4": _union_group4(
        2.2,
        "the union conv input gradient over dY's mask (timed in float32, used for bf16 too): 4-pixel groups "
        "against 2-pixel groups (behind a max-pool dY has at most one nonzero per 2x2 window)",
        ((16, 128, 16), (16, 256, 8), (16, 64, 32)),
    ),
    # density = the fraction of relu(x) that is nonzero
    "relu_compact.linear": Crossover(
        0.25,
        "F.linear on a relu_compact input: the activation-sparse kernels (forward and both gradients) "
        "against the dense linear on relu(x)",
        (0.1, 0.2, 0.3, 0.4, 0.5),
        # (tokens, in_features, out_features): attention-sized and both MLP projections
        ((512, 768, 768), (512, 768, 3072), (512, 3072, 768)),
        {"amd-avx2": 0.2, "amd-avx512": 0.3, "intel-amx": 0.1},
    ),
    "relu_compact.conv2d": Crossover(
        0.55,
        "F.conv2d on a relu_compact input: the activation-sparse kernels (forward and both gradients) "
        "against the dense conv on relu(x)",
        (0.3, 0.4, 0.5, 0.6, 0.7),
        # (batch, channels in = out, height = width) of 3x3 convs: the stages of a CIFAR ResNet/VGG
        ((8, 64, 32), (8, 128, 16), (8, 256, 8)),
        {"amd-avx2": 0.6, "amd-avx512": 0.4, "intel-amx": 0.0},
    ),
}


def _check_name(name: str) -> Crossover:
    c = CROSSOVERS.get(name)
    if c is None:
        raise ValueError(f"crossover: unknown name {name!r}; known: {sorted(CROSSOVERS)}")
    return c


@functools.lru_cache(maxsize=1)
def _this_class() -> str:
    return cpu.cpu_class()


def measured_on_this_class(name: str) -> bool:
    """Whether ``name`` has a figure measured on this CPU class (``Crossover.by_class``)."""
    return _this_class() in _check_name(name).by_class


def builtin_default(name: str) -> float:
    """The crossover ``name`` uses before a refit: the one measured on this CPU class, else ``default``."""
    c = _check_name(name)
    return float(c.by_class.get(_this_class(), c.default))


#: per cost model (weakly held), name -> (its fits version, CPU class, crossover entry, the value): the
#: token crossovers are read on every decoding call
_READ: "weakref.WeakKeyDictionary[CostModel, Dict[str, tuple]]" = weakref.WeakKeyDictionary()


def nominal_density(kept: int, total: int) -> float:
    """``kept / total`` to 3 places: the density a weight is compared with the density crossovers at. They
    are measured and stored at grid points, and a weight pruned row by row to 70% of 1536 columns keeps 461
    of them (0.30013), which a crossover measured at 0.3 must still cover."""
    return round(kept / max(1, total), 3)


def crossover(name: str, cost_model: Optional[CostModel] = None) -> float:
    """The density (or, for a ``unit="tokens"`` crossover, the token count) at or below which the ``low``
    side of ``name`` runs: measured here if refitted, else :func:`builtin_default`."""
    cm = cost_model if cost_model is not None else default_cost_model()
    c, cls, version = CROSSOVERS.get(name), _this_class(), cm.fits_version
    read = _READ.get(cm)
    hit = None if read is None else read.get(name)
    if hit is not None and hit[0] == version and hit[1] == cls and hit[2] is c:
        return hit[3]
    c = _check_name(name)
    fit = cm.fit(PREFIX + name)
    value = float(fit[UNITS[c.unit]]) if fit is not None and UNITS[c.unit] in fit else builtin_default(name)
    _READ.setdefault(cm, {})[name] = (version, cls, c, value)
    return value


def token_crossover(name: str, cost_model: Optional[CostModel] = None) -> int:
    """:func:`crossover` of a ``unit="tokens"`` crossover, as a token count."""
    unit = _check_name(name).unit
    if unit != "tokens":
        raise ValueError(f"token_crossover: {name!r} is a {unit} crossover; use crossover()")
    return int(crossover(name, cost_model))


def describe(name: str, value: float) -> str:
    """What the crossover ``value`` of ``name`` means, e.g. ``"sparse at density <= 0.2"``."""
    c = _check_name(name)
    if c.unit == "tokens":
        if c.low_beyond_top and c.grid and value >= c.grid[-1]:
            return f"{c.low} at every token count, never {c.high}"
        return f"{c.low} up to {int(value)} tokens, {c.high} above"
    if c.unit == "ratio":
        return f"{c.low} up to a union ratio of {value:g}, {c.high} above"
    return f"{c.low} at density <= {value:g}"
