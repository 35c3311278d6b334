"""Every ``nn.Linear`` of a model in a layout at a sparsity, kept sparse only where that is faster:
the machinery behind :class:`sparsa.methods.OneShot` (:mod:`sparsa.nn.one_shot`).

>>> import torch.nn as nn, sparsa
>>> from sparsa.methods import OneShot
>>> model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
>>> model = sparsa.sparsify(model, OneShot(0.75, pattern="row_group8"))
>>> [(r["name"], r["layout"], r["sparsity"]) for r in sparsa.sparsity_report(model) if r["name"].endswith("weight")]
[('0.weight', 'row_group', 0.75), ('2.weight', 'row_group', 0.75)]

With ``only_if_faster`` a layer keeps the sparse layout only where its kernel is measured faster
than dense on this machine; the report also gives the speed against the *best* dense path (float32
or bfloat16, whichever this CPU runs faster). The answer depends on the machine, so only the
report's fields are shown:

>>> model = sparsa.sparsify(nn.Sequential(nn.Linear(64, 128)), OneShot(0.75, pattern="row_group8", only_if_faster=16))
>>> r = sparsa.sparsity_report(model)[0]
>>> r["path"] in ("sparse", "dense"), r["ratio_vs_dense"] > 0, r["best_dense"] in DENSE_OPTIONS
(True, True, True)
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..cost_model import CostModel, default_cost_model
from ..sparsifiers import BlockMagnitude, GroupedNM, Magnitude, NM, RowGroupSparsifier, Sparsifier
from ..tensor import SparseTensor, to_sparse
from .cast_linear import CastLinear
from .report import PATH_ATTR
from .rule import NamePattern, Rule

__all__ = [
    "default_sparsifier",
    "dense_where_slower",
    "speedup_vs_dense",
    "linear_costs",
    "DEFAULT_TOKENS",
    "MARGIN",
    "DENSE_OPTIONS",
    "SAME_PATTERN_LAYOUTS",
]

#: the dense paths every sparse layer is measured against, by option name
DENSE_OPTIONS = {"dense_float32": torch.float32, "dense_bfloat16": torch.bfloat16}

# sparsity -> (n, m) for the N:M family
_NM = {0.5: (2, 4), 0.75: (1, 4), 0.875: (1, 8), 0.9: (1, 10), 0.25: (3, 4)}

#: token count (rows of the input) at which ``only_if_faster=True`` times a layer
DEFAULT_TOKENS = 128
#: token count at which ``only_if_faster=True`` times the layers of a generative model (its
#: ``can_generate()`` is true, e.g. a ``...ForCausalLM``): generation spends its time in steps of one new
#: token per sequence, where a sparse layer pays by the bytes it reads, not at a prompt's width
DECODE_TOKENS = 1
#: layouts that store any mask exactly and compute sparsely: the alternatives ``sparsa prune --only-if-faster``
#: times beside a weight's own layout (sliced_ell for many tokens, bitmask for decode and bf16 prefill)
SAME_PATTERN_LAYOUTS = ("sliced_ell", "bitmask")
#: a sparse layer is kept only if it is at least this much faster than dense (ratio >= 1 + MARGIN):
#: a kernel that merely ties dense is not worth its dispatch and its timing noise
MARGIN = 0.05


def default_sparsifier(layout: str, sparsity: float, **params: Any) -> Sparsifier:
    """The natural one-shot magnitude sparsifier for ``layout`` at ``sparsity``."""
    if layout == "row_group":
        return RowGroupSparsifier(sparsity, **{k: v for k, v in params.items() if k in ("group", "permute")})
    if layout in ("nm", "grouped_nm"):
        n, m = params.get("n"), params.get("m")
        if n is None or m is None:
            if sparsity not in _NM:
                raise ValueError(
                    f"layout {layout!r} needs n and m for sparsity {sparsity}; pass n=..., m=... "
                    f"(known defaults: {sorted(_NM)})"
                )
            n, m = _NM[sparsity]
        return NM(n, m) if layout == "nm" else GroupedNM(n, m, params.get("g", 4))
    if layout == "bsr":
        return BlockMagnitude(sparsity, tuple(params.get("blocksize", (4, 4))))
    return Magnitude(sparsity, per="row")


def _tokens(only_if_faster: Union[bool, int], arg: str = "only_if_faster") -> int:
    """The token count ``only_if_faster`` asks for; 0 when off. Raises naming ``arg`` on a bad value."""
    if only_if_faster is False:
        return 0
    if only_if_faster is True:
        return DEFAULT_TOKENS
    if not isinstance(only_if_faster, int):
        raise TypeError(
            f"{arg} must be False, True (time at {DEFAULT_TOKENS} tokens) or a positive int "
            f"(the token count to time at), got {type(only_if_faster).__name__} {only_if_faster!r}"
        )
    if only_if_faster <= 0:
        raise ValueError(f"{arg} must be a positive token count (or True/False), got {only_if_faster}")
    return int(only_if_faster)


def timing_tokens(
    only_if_faster: Union[bool, int], model: Optional[nn.Module] = None, arg: str = "only_if_faster"
) -> int:
    """The token count ``only_if_faster`` times ``model``'s layers at (0 when off): an explicit count, or for
    ``True`` :data:`DECODE_TOKENS` on a generative model and :data:`DEFAULT_TOKENS` otherwise."""
    tokens = _tokens(only_if_faster, arg)
    can_generate = getattr(model, "can_generate", None)
    if only_if_faster is True and callable(can_generate) and can_generate():
        return DECODE_TOKENS
    return tokens


def _dense_option(dtype: torch.dtype) -> str:
    return f"dense_{str(dtype).replace('torch.', '')}"


def _cost_key(w: SparseTensor, has_bias: bool, tokens: int) -> str:
    from .. import cpu
    from ..kernels.loader import kernels_digest

    lay = w.sparse_layout
    params = ",".join(f"{k}={v!r}" for k, v in sorted(lay.params().items()))
    nnz_bucket = round(lay.density * 50)  # 2% density buckets
    return (
        f"linear|{type(lay).name}|{params}|{tuple(lay.shape)}|d{nnz_bucket}|bias{int(has_bias)}|"
        f"{str(lay.dtype).replace('torch.', '')}|{lay.device}|T{tokens}|threads{torch.get_num_threads()}|"
        f"{cpu.isa()}|k{kernels_digest()}"
    )


def linear_costs(weight: SparseTensor, bias: Optional[torch.Tensor], tokens: int) -> Dict[str, float]:
    """Median ms per ``F.linear`` call on a ``(tokens, in_features)`` input, without autograd: ``"sparse"``
    (this weight's layout and dtype) and each of :data:`DENSE_OPTIONS` (the same pruned weight, dense).

    All options are timed side by side (round robin) at the current thread count, once per CPU model,
    layout, shape, density, dtype and token count: later calls read :func:`sparsa.cost_model.default_cost_model`.
    """
    key = _cost_key(weight, bias is not None, tokens)
    cm = default_cost_model()
    cached = cm.lookup(key)
    if cached is not None and "sparse" in cached and all(o in cached for o in DENSE_OPTIONS):
        return cached
    dense = weight.sparse_layout.to_dense().detach().clone()
    b = bias.detach() if bias is not None else None
    x = torch.randn(tokens, dense.shape[1], dtype=dense.dtype, device=dense.device)
    sync = torch.cuda.synchronize if dense.device.type == "cuda" else (lambda: None)

    def dense_fn(dtype: torch.dtype) -> Callable[[], None]:
        wd, xd, bd = dense.to(dtype), x.to(dtype), None if b is None else b.to(dtype)

        def run():
            F.linear(xd, wd, bd)
            sync()

        return run

    def run_sparse():
        F.linear(x, weight, b)
        sync()

    options: Dict[str, Callable[[], None]] = {"sparse": run_sparse}
    options.update({name: dense_fn(dt) for name, dt in DENSE_OPTIONS.items()})
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a layout without a linear kernel warns once; the timing says it all
        return cm.measure(key, options)


def speedup_vs_dense(weight: SparseTensor, bias: Optional[torch.Tensor], tokens: int) -> float:
    """Dense time / sparse time of ``F.linear`` in the weight's own dtype (from :func:`linear_costs`).
    Above 1 the sparse layout is faster."""
    c = linear_costs(weight, bias, tokens)
    return c[_dense_option(weight.dtype)] / c["sparse"]


def _as_costs(result: Any, dtype: torch.dtype) -> Dict[str, float]:
    """A timer's answer as costs: a float is a speed-up over dense in ``dtype`` (sparse costs 1)."""
    if isinstance(result, dict):
        return {k: float(v) for k, v in result.items()}
    return {"sparse": 1.0, _dense_option(dtype): float(result)}


def same_pattern_weights(w: SparseTensor, layouts: Sequence[str]) -> Dict[str, SparseTensor]:
    """``w`` stored in each of ``layouts`` (besides its own) that keeps exactly its pattern and values:
    ``{layout name: SparseTensor}``. A layout that cannot store it (or only approximately) is left out."""
    from ..layouts.base import get_layout

    dense, mask = w.sparse_layout.to_dense().detach(), w.pattern()
    out: Dict[str, SparseTensor] = {}
    for name in layouts:
        get_layout(name)  # an unknown name is an error, not a silent skip
        if name == w.layout_name:
            continue
        sp = exact_sparse(dense, mask, name)
        if sp is not None:
            out[name] = sp
    return out


def exact_sparse(dense: torch.Tensor, mask: torch.Tensor, layout: str, **params: Any) -> Optional[SparseTensor]:
    """``dense`` stored in ``layout`` keeping exactly ``mask`` and the values, or None where the layout cannot
    hold them (it raises, or holds another pattern or other values)."""
    try:
        sp = to_sparse(dense, layout, mask=mask, **params)
    except (ValueError, TypeError, NotImplementedError):
        return None
    return sp if sp.pattern().equal(mask) and sp.sparse_layout.to_dense().equal(dense) else None


def _fastest_layout(
    w: SparseTensor, bias: Optional[torch.Tensor], tokens: int, timer: Callable[..., Any], layouts: Sequence[str]
) -> Tuple[SparseTensor, Dict[str, float]]:
    """The weight among ``w`` and its :func:`same_pattern_weights` whose sparse ``F.linear`` is the fastest
    against dense in its dtype (ratios from side-by-side timings, so runs at different moments compare)."""
    own = _dense_option(w.dtype)
    best, best_costs = w, _as_costs(timer(w, bias, tokens), w.dtype)
    for cand in same_pattern_weights(w, layouts).values():
        costs = _as_costs(timer(cand, bias, tokens), w.dtype)
        if costs[own] / costs["sparse"] > best_costs[own] / best_costs["sparse"]:
            best, best_costs = cand, costs
    return best, best_costs


def dense_where_slower(
    model: nn.Module,
    tokens: int = DEFAULT_TOKENS,
    *,
    names: Optional[NamePattern] = None,
    margin: float = MARGIN,
    timer: Optional[Callable[..., Any]] = None,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    layouts: Sequence[str] = (),
) -> Dict[str, Dict[str, Any]]:
    """Time every sparse ``nn.Linear`` weight of ``model`` (or of the modules ``names`` matches) against
    the dense paths and replace it by the fastest dense one where the sparse ``F.linear`` is not at
    least ``1 + margin`` times faster than it.

    ``dtypes``: the dense dtypes a layer may be switched to (default: only the weight's own dtype, so
    the model computes the same function). With ``(torch.float32, torch.bfloat16)`` a float32 layer
    may become a :class:`~sparsa.nn.cast_linear.CastLinear` computing in bfloat16, where that is the
    fastest option on this CPU (untied weights only).

    ``layouts``: other layouts to time on the same pattern (e.g. :data:`SAME_PATTERN_LAYOUTS`); each that
    stores a weight's pattern and values exactly is timed beside its own layout, and the fastest sparse
    one (against dense in the weight's dtype) is what is compared with dense and kept. The decision's
    ``sparse_layout`` names it.

    ``timer(weight, bias, tokens)`` defaults to :func:`linear_costs` (a dict of ms per option); a timer
    that returns a float gives the speed-up over dense in the weight's dtype. Layers with the same
    layout parameters, shape, density (2% buckets), dtype, device, token count and thread count are
    timed once. Returns ``{parameter name: decision}`` with ``path`` (``"sparse"``, ``"dense"``, or
    ``"dense_bfloat16"`` / ``"dense_float32"`` for a dtype switch), ``ratio_vs_dense`` (dense in the
    weight's dtype / sparse), ``ratio_vs_best_dense`` and ``best_dense`` (the fastest dense option
    measured, None when the timer measured only one). Tied weights appear under each name.
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
        raise ValueError(f"tokens must be a positive int (rows of the timed input), got {tokens!r}")
    if not isinstance(margin, (int, float)) or isinstance(margin, bool) or not math.isfinite(margin) or margin < 0:
        raise ValueError(f"margin must be a finite number >= 0, got {margin!r}")
    if dtypes is not None:
        bad = [d for d in dtypes if d not in DENSE_OPTIONS.values()]
        if bad or not dtypes:
            raise ValueError(f"dtypes must be a non-empty subset of {list(DENSE_OPTIONS.values())}, got {dtypes!r}")
    timer = timer if timer is not None else linear_costs
    select = Rule(names=names, module_types=nn.Linear)
    if isinstance(layouts, str):
        raise TypeError(f"layouts must be a sequence of layout names such as ('sliced_ell',), got {layouts!r}")
    cache: Dict[str, Tuple[str, Dict[str, float]]] = {}
    done: Dict[int, Tuple[nn.Parameter, Dict[str, Any]]] = {}  # id(old weight) -> (new weight, decision)
    users: Dict[int, int] = {}
    for _, mod in model.named_modules():
        w = mod._parameters.get("weight")
        if w is not None:
            users[id(w)] = users.get(id(w), 0) + 1
    out: Dict[str, Dict[str, Any]] = {}
    for mname, mod in list(model.named_modules()):
        w = mod._parameters.get("weight")
        if not isinstance(w, SparseTensor) or not select.matches(mname, mod) or w.dim() != 2:
            continue
        pname = f"{mname}.weight" if mname else "weight"
        if id(w) in done:  # tied weight: decided once, stays tied
            new, decision = done[id(w)]
            if new is not w:
                setattr(mod, "weight", new)
            out[pname] = dict(decision)
            continue
        key = _cost_key(w, mod.bias is not None, tokens)
        if key not in cache:
            fast, costs = _fastest_layout(w, mod.bias, tokens, timer, layouts)
            cache[key] = (fast.layout_name, costs)
        layout, costs = cache[key]
        can_cast = users.get(id(w), 0) == 1 and mname != ""  # a dtype switch replaces this one module
        decision = dict(_decide(costs, w.dtype, dtypes, margin, can_cast), sparse_layout=layout)
        new = w
        if decision["path"] == "sparse" and layout != w.layout_name:
            sp = same_pattern_weights(w, [layout])[layout]
            new = nn.Parameter(sp, requires_grad=w.requires_grad)
            setattr(mod, "weight", new)
        elif decision["path"] != "sparse":
            with torch.no_grad():
                new = nn.Parameter(w.sparse_layout.to_dense().detach().clone(), requires_grad=w.requires_grad)
            if decision["path"] == "dense":
                setattr(mod, "weight", new)
            else:
                _replace_module(model, mname, CastLinear.from_linear(mod, DENSE_OPTIONS[decision["path"]], new))
        done[id(w)] = (new, decision)
        out[pname] = dict(decision)
    return out


def _decide(
    costs: Dict[str, float], dtype: torch.dtype, dtypes: Optional[Sequence[torch.dtype]], margin: float, can_cast: bool
) -> Dict[str, Any]:
    own = _dense_option(dtype)
    allowed = [_dense_option(d) for d in dtypes] if dtypes is not None and can_cast else [own]
    dense_measured = [o for o in costs if o != "sparse"]
    best = CostModel.fastest(costs, dense_measured)
    choice = CostModel.fastest(costs, allowed) if any(o in costs for o in allowed) else own
    sparse_ms = costs["sparse"]
    keep_sparse = choice not in costs or costs[choice] / sparse_ms >= 1.0 + margin
    path = "sparse" if keep_sparse else ("dense" if choice == own else choice)
    return {
        "path": path,
        "ratio_vs_dense": costs[own] / sparse_ms if own in costs else None,
        "ratio_vs_best_dense": costs[best] / sparse_ms,
        "best_dense": best if len(dense_measured) > 1 else None,
    }


def _replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def record_paths(model: nn.Module, chosen: Dict[str, Dict[str, Any]]) -> None:
    """Keep each decision of ``chosen`` (``{parameter name: decision}``, from :func:`dense_where_slower`)
    on the module holding that weight, so :func:`sparsa.sparsity_report` rows carry it."""
    for pname, decision in chosen.items():
        mname = pname[: -len(".weight")] if pname.endswith(".weight") else ""
        mod = model.get_submodule(mname)
        w = mod._parameters.get("weight")
        layout = w.layout_name if isinstance(w, SparseTensor) else "dense"
        # the layout it was decided for: a later re-sparsify to another layout drops the decision
        setattr(mod, PATH_ATTR, (layout, dict(decision)))


def annotate_paths(rows: List[Dict[str, Any]], chosen: Dict[str, Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Add ``path`` and ``ratio_vs_dense`` to the report rows of the parameters in ``chosen``."""
    for r in rows:
        if r["target"] == "weight" and r["name"] in chosen:
            r.update(chosen[r["name"]])
    return rows
