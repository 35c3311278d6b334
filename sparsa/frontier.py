"""Quality against speed for a pruned encoder: the pieces shared by ``benchmarks/pareto.py`` and
``sparsa prune --target-quality``.

* :func:`pattern_config`: a pattern name and a sparsity -> the sparsifier and the fast layout
  (``"unstructured"`` -> ``sliced_ell``, ``"2:4"``/``"4:8"`` -> ``nm``, ``"grouped_nm"`` -> the
  grouped N:M nearest the sparsity, ``"row_group<G>"`` -> ``row_group``);
* :func:`speed_layouts`: the layouts a configuration is timed in (both unstructured ones);
* :func:`prune_copy`: a pruned copy of a dense encoder by ``magnitude``, ``wanda`` or ``sparsegpt``;
* :func:`embedding_quality`: mean cosine to the dense sentence embeddings and top-1
  nearest-neighbour agreement (:func:`top1_agreement`) on held-out text;
* :class:`DenseBaselines`: dense fp32 eager, dense bf16 eager and ``torch.compile`` of the faster,
  timed once; :meth:`DenseBaselines.speedup` times a sparse model side by side with dense fp32 and
  the fastest of them (``speedup_vs_best_dense``), :meth:`DenseBaselines.best_path` the sparse
  model's own fastest way to run (dtype, GELU fusion, compilation), :meth:`DenseBaselines.best_layout`
  that in each layout of :func:`speed_layouts` (:func:`relaid` copies a model into another layout);
* :func:`pareto_frontier` (the non-dominated points) and :func:`highest_passing` (bisection over a
  sorted sparsity grid, for a quality that falls as sparsity rises).

Example::

    >>> pareto_frontier([(1.0, 0.99), (2.0, 0.90), (1.5, 0.80), (3.0, 0.50)])
    [0, 1, 3]
    >>> highest_passing([0.5, 0.6, 0.7, 0.8, 0.9], lambda s: s <= 0.7)
    0.7
"""

from __future__ import annotations

import copy
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .nn.blocks import prunable_linears
from .sparsifiers.pattern_names import grouped_nm_for, parse_pattern

__all__ = [
    "PATTERNS",
    "FIXED_SPARSITY",
    "PatternConfig",
    "pattern_config",
    "grouped_nm_for",
    "prune_copy",
    "speed_layouts",
    "relaid",
    "UNSTRUCTURED_LAYOUTS",
    "check_method_layout",
    "top1_agreement",
    "embedding_quality",
    "DenseBaselines",
    "pareto_frontier",
    "highest_passing",
    "encoder_inputs",
    "SEQ",
    "BATCH",
]

#: the pattern families of the frontier, in the order tables list them
PATTERNS: Tuple[str, ...] = ("unstructured", "2:4", "4:8", "grouped_nm", "row_group4", "row_group8", "row_group16")
#: patterns whose sparsity is fixed by their structure
FIXED_SPARSITY = {"2:4": 0.5, "4:8": 0.5}
METHODS = ("magnitude", "wanda", "sparsegpt")
BATCH, SEQ = 8, 128


@dataclass(frozen=True)
class PatternConfig:
    """One storage configuration: ``pattern`` family, its ``label`` (e.g. ``grouped_nm1:4``), the
    ``layout`` name, the exact ``sparsity`` it stores and its sparsifier."""

    pattern: str
    label: str
    layout: str
    sparsity: float
    sparsifier: Any = field(compare=False, repr=False)
    #: the pattern string :func:`sparsa.recover` takes for it
    recover_pattern: str = ""


def pattern_config(pattern: str, sparsity: float) -> PatternConfig:
    """The sparsifier and fast layout of ``pattern`` (see :data:`PATTERNS`; parsed by
    :func:`sparsa.sparsifiers.parse_pattern`) at ``sparsity``; N:M patterns ignore ``sparsity`` (theirs
    is fixed: ``1 - N/M``), ``grouped_nm`` rounds it to the nearest N:M of :func:`grouped_nm_for`.
    The frontier stores ``"unstructured"`` as ``sliced_ell`` (its fast layout), the rest in their natural one.

    >>> c = pattern_config("grouped_nm", 0.75); (c.label, c.layout, c.sparsity)
    ('grouped_nm1:4', 'grouped_nm', 0.75)
    """
    p = parse_pattern(pattern, sparsity)
    if p.canonical == "unstructured":
        label = layout = "sliced_ell"
    elif pattern == "grouped_nm":
        label, layout = "grouped_nm" + p.canonical.removeprefix("grouped_"), p.layout
    else:
        label, layout = pattern, p.layout
    return PatternConfig(pattern, label, layout, p.sparsity, p.sparsifier, p.canonical)


#: every layout that computes with an unstructured mask: which is fastest depends on the CPU and dtype
#: (bitmask's bf16 kernels on AVX512-BF16/AMX, sliced_ell's in fp32), so the frontier times each
UNSTRUCTURED_LAYOUTS = ("sliced_ell", "bitmask")


def speed_layouts(cfg: PatternConfig) -> Tuple[str, ...]:
    """The layouts to time ``cfg`` in: every one of :data:`UNSTRUCTURED_LAYOUTS` for an unstructured
    pattern (the mask, hence the quality, is the same in each), else ``cfg.layout`` alone.

    >>> speed_layouts(pattern_config("unstructured", 0.7)), speed_layouts(pattern_config("2:4", 0.5))
    (('sliced_ell', 'bitmask'), ('nm',))
    """
    return UNSTRUCTURED_LAYOUTS if cfg.recover_pattern == "unstructured" else (cfg.layout,)


#: the block Linears :func:`prune_copy` prunes by default (the name ``benchmarks/pareto.py`` imports)
_linear_names = prunable_linears


def check_method_layout(method: str, layout: str, arg: str = "method") -> None:
    """Raise ``ValueError`` (naming ``arg``) if ``method`` cannot produce masks ``layout`` stores:
    SparseGPT's column-block masks do not keep grouped N:M's row groups.

    >>> check_method_layout("wanda", "grouped_nm")
    """
    if method == "sparsegpt" and layout == "grouped_nm":
        raise ValueError(
            f"{arg} sparsegpt cannot produce grouped_nm masks (its N:M choice is per row, the layout "
            "shares it across row groups); use magnitude or wanda for grouped_nm, or another layout"
        )


def prune_copy(
    dense: nn.Module,
    method: str,
    cfg: PatternConfig,
    calibration: Sequence[Dict[str, Tensor]] = (),
    names: Optional[Sequence[str]] = None,
) -> nn.Module:
    """A copy of the encoder ``dense`` with its block Linears pruned by ``method`` (``magnitude``,
    ``wanda`` or ``sparsegpt``; the last two calibrate on ``calibration``, tokenized batches) into
    ``cfg``'s layout. Raises ``ValueError`` for a combination that cannot be stored (SparseGPT's
    column-block masks do not keep grouped N:M's row groups)."""
    from . import Rule, sparsify
    from .methods import SparseGPT, Wanda

    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    check_method_layout(method, cfg.layout)
    model = copy.deepcopy(dense)
    names = list(names) if names is not None else prunable_linears(model)
    if method == "magnitude":
        return sparsify(model, [Rule(sparsifier=cfg.sparsifier, layout=cfg.layout, names=names)])
    if not calibration:
        raise ValueError(f"method {method!r} needs calibration batches (tokenized text), got none")
    config = (Wanda if method == "wanda" else SparseGPT)(
        cfg.sparsity, sparsifier=cfg.sparsifier, layout=cfg.layout, calibration=calibration, forward=lambda m, b: m(**b)
    )
    wanted = set(names)
    return sparsify(model, config, lambda m, n: n in wanted)


def top1_agreement(reference: Tensor, embeddings: Tensor) -> float:
    """The fraction of texts whose nearest other text (cosine) is the same under ``embeddings`` as
    under ``reference`` (both ``(n, dim)``, n >= 2).

    >>> import torch
    >>> e = torch.eye(4) + 0.1
    >>> top1_agreement(e, e)
    1.0
    """
    if reference.shape != embeddings.shape or reference.dim() != 2 or reference.shape[0] < 2:
        raise ValueError(
            f"top1_agreement needs two (n >= 2, dim) tensors of one shape, got "
            f"{tuple(reference.shape)} and {tuple(embeddings.shape)}"
        )

    def nearest(e: Tensor) -> Tensor:
        e = F.normalize(e.double(), dim=1)
        sim = e @ e.T
        sim.fill_diagonal_(-float("inf"))
        return sim.argmax(1)

    return float((nearest(reference) == nearest(embeddings)).double().mean())


def embedding_quality(
    model: nn.Module,
    tokenizer: Any,
    texts: Dict[str, Sequence[str]],
    reference: Dict[str, Tensor],
    max_length: int = 128,
) -> Dict[str, float]:
    """Mean cosine and top-1 agreement of ``model``'s sentence embeddings (masked mean of the last
    hidden states) against ``reference`` (the dense model's, per domain) on the held-out ``texts`` of
    each domain: ``{"cosine_<domain>", "top1_<domain>", "quality_cosine", "quality_top1"}`` (the last
    two: the mean over the domains)."""
    from .models.minilm import embed

    out: Dict[str, float] = {}
    for dom, tx in texts.items():
        e = embed(model, tokenizer, list(tx), max_length=max_length)
        out[f"cosine_{dom}"] = round(F.cosine_similarity(e, reference[dom]).mean().item(), 4)
        out[f"top1_{dom}"] = round(top1_agreement(reference[dom], e), 4)
    out["quality_cosine"] = round(sum(out[f"cosine_{d}"] for d in texts) / len(texts), 4)
    out["quality_top1"] = round(sum(out[f"top1_{d}"] for d in texts) / len(texts), 4)
    return out


def encoder_inputs(model: nn.Module, batch: int = BATCH, seq: int = SEQ) -> Tensor:
    """Fixed random token ids ``(batch, seq)`` within the model's vocabulary (for timing)."""
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 30522))
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


class DenseBaselines:
    """The dense paths of an encoder on one input: fp32 eager, bf16 eager and (``use_compile``)
    ``torch.compile`` of the faster, timed side by side once (``ms``, ``best``, ``compile_s``).
    :meth:`speedup` times a sparse model against dense fp32 and the fastest of them."""

    def __init__(
        self,
        dense: nn.Module,
        inputs: Tensor,
        use_compile: bool = True,
        reps: int = 5,
        log: Callable[[str], None] = print,
    ):
        from .timing import best_dense, round_robin_ms

        self.inputs, self.reps = inputs, reps
        models = {"fp32": dense, "bf16": copy.deepcopy(dense).to(torch.bfloat16)}
        self.fns: Dict[str, Callable[[], object]] = {k: (lambda m=m: m(input_ids=inputs)) for k, m in models.items()}
        self.compile_s: Optional[float] = None
        with torch.no_grad():
            self.ms = round_robin_ms(self.fns, rounds=reps, min_seconds=0.0)
            if use_compile:
                faster = "fp32" if self.ms["fp32"] <= self.ms["bf16"] else "bf16"
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    compiled = torch.compile(models[faster], dynamic=False)
                    t0 = time.perf_counter()
                    compiled(input_ids=inputs)
                    self.compile_s = round(time.perf_counter() - t0, 1)
                self.fns["compiled_" + faster] = lambda c=compiled: c(input_ids=inputs)
                self.ms = round_robin_ms(self.fns, rounds=reps, min_seconds=0.0)
        self.best = best_dense(self.ms)
        log(
            "dense baselines: "
            + ", ".join(f"{k} {v:.1f} ms" for k, v in self.ms.items())
            + f" (best {self.best}"
            + (f"; compiled in {self.compile_s} s" if self.compile_s is not None else "")
            + ")"
        )

    def speedup(self, model: nn.Module, reps: Optional[int] = None) -> Dict[str, Any]:
        """``model`` timed round-robin with dense fp32 and the fastest dense path:
        :func:`sparsa.timing.speedups` (``speedup_vs_dense``, ``speedup_vs_best_dense``, ...)."""
        from .timing import round_robin_ms, speedups

        keep = {k: f for k, f in self.fns.items() if k in ("fp32", self.best)}
        with torch.no_grad():
            ms = round_robin_ms(
                dict(keep, sparse=lambda: model(input_ids=self.inputs)), rounds=reps or self.reps, min_seconds=0.0
            )
        return speedups(ms)

    def best_path(self, model: nn.Module, reps: Optional[int] = None) -> Dict[str, Any]:
        """The fastest way a user can run the sparse ``model``, each way timed by :meth:`speedup`:
        eager in float32 and in bfloat16; for the faster dtype, ``sparsa.fuse_for_inference`` (GELU
        epilogues, q/k/v products, MLP calls; when it fuses anything) and, where the dense baselines were
        compiled, ``torch.compile`` of that. Returns the fastest way's :meth:`speedup` plus ``sparse_dtype``,
        ``sparse_path`` (``eager``, ``fused`` or ``compiled``) and ``paths`` (every way's
        ``speedup_vs_best_dense``). Fair against the dense side, which gets its best of fp32, bf16 and
        compiled too. ``model`` itself is not changed."""
        from .nn.fuse_for_inference import fuse_for_inference

        def timed(m: nn.Module) -> Dict[str, Any]:
            with torch.no_grad():
                m(input_ids=self.inputs)  # warm-up: kernel builds, packs, compilation
            return self.speedup(m, reps)

        by_dtype = {"float32": model, "bfloat16": copy.deepcopy(model).to(torch.bfloat16)}
        results = {(name, "eager"): timed(m) for name, m in by_dtype.items()}
        dtype = max(by_dtype, key=lambda d: results[(d, "eager")]["speedup_vs_best_dense"])
        fastest = by_dtype[dtype]
        fused = copy.deepcopy(fastest)
        if any(fuse_for_inference(fused).values()):
            results[(dtype, "fused")] = timed(fused)
            fastest = fused
        if self.compile_s is not None:
            # one compiled graph per pruned model: a long sweep must not hit the recompile limit, past which
            # dynamo would silently run the model eagerly (and time eager code as "compiled"): raise it, and
            # make reaching it an error
            limit = max(torch._dynamo.config.recompile_limit, 64)
            patch = torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True)
            with patch, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                results[(dtype, "compiled")] = timed(torch.compile(fastest, dynamic=False))
        (d, path), best = max(results.items(), key=lambda kv: kv[1]["speedup_vs_best_dense"])
        return dict(
            best,
            sparse_dtype=d,
            sparse_path=path,
            paths={f"{k[0]}/{k[1]}": v["speedup_vs_best_dense"] for k, v in results.items()},
        )

    def best_layout(
        self, model: nn.Module, cfg: PatternConfig, names: Optional[Sequence[str]] = None
    ) -> Tuple[nn.Module, Dict[str, Any]]:
        """:meth:`best_path` of ``model`` (pruned into ``cfg.layout``) and of its copy in each other layout
        of :func:`speed_layouts` (:func:`relaid`; ``names``: its pruned Linears); returns the fastest
        model and its speed, with ``sparse_layout`` and ``layouts`` (every layout's ``paths``)."""
        by_layout: Dict[str, Tuple[nn.Module, Dict[str, Any]]] = {}
        for layout in speed_layouts(cfg):
            m = model if layout == cfg.layout else relaid(model, layout, names)
            by_layout[layout] = (m, dict(self.best_path(m), sparse_layout=layout))
        m, speed = max(by_layout.values(), key=lambda ms: ms[1]["speedup_vs_best_dense"])
        return m, dict(speed, layouts={k: v[1]["paths"] for k, v in by_layout.items()})


def relaid(model: nn.Module, layout: str, names: Optional[Sequence[str]] = None) -> nn.Module:
    """A copy of ``model`` whose sparse Linear weights (among ``names``, default every one) are stored in
    ``layout``: the same kept positions and values."""
    from .tensor import SparseTensor

    out = copy.deepcopy(model)
    for name in names if names is not None else [n for n, m in out.named_modules() if isinstance(m, nn.Linear)]:
        lin = out.get_submodule(name)
        if isinstance(lin.weight, SparseTensor):
            lin.weight = nn.Parameter(lin.weight.detach().to_layout(layout), requires_grad=lin.weight.requires_grad)
    return out


def pareto_frontier(points: Sequence[Tuple[float, float]]) -> List[int]:
    """Indices (ascending) of the points ``(speed, quality)`` that no other point dominates (at
    least as fast and as good, and better in one); higher is better in both."""
    pts = list(points)
    return [i for i, (s, q) in enumerate(pts) if not any(s2 >= s and q2 >= q and (s2 > s or q2 > q) for s2, q2 in pts)]


def highest_passing(grid: Sequence[float], passes: Callable[[float], bool]) -> Optional[float]:
    """The highest value of the ascending ``grid`` for which ``passes`` holds, by bisection, assuming
    it holds up to some point and fails above (quality falls as sparsity rises); ``None`` if it
    fails at the lowest. Calls ``passes`` about log2(len(grid)) + 1 times."""
    grid = list(grid)
    if not grid:
        return None
    if sorted(grid) != grid:
        raise ValueError(f"grid must be ascending, got {grid}")
    lo, hi = -1, len(grid)  # grid[lo] passes (or lo = -1), grid[hi] fails (or hi = len)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if passes(grid[mid]):
            lo = mid
        else:
            hi = mid
    return grid[lo] if lo >= 0 else None
