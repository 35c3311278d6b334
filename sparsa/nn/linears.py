"""One call to put every ``nn.Linear`` of a model into a layout at a sparsity.

>>> import torch.nn as nn, sparsa
>>> model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
>>> rows = sparsa.sparsify_linears(model, "row_group", sparsity=0.75, group=8)
>>> [(r["name"], r["layout"], r["sparsity"]) for r in rows if r["name"].endswith("weight")]
[('0.weight', 'row_group', 0.75), ('2.weight', 'row_group', 0.75)]

With ``only_if_faster`` a layer keeps the sparse layout only where its kernel is measured faster
than dense on this machine (the answer depends on the machine, so only the report's fields are shown):

>>> rows = sparsa.sparsify_linears(nn.Sequential(nn.Linear(64, 128)), "row_group", sparsity=0.75,
...                                group=8, only_if_faster=16)
>>> r = rows[0]
>>> r["path"] in ("sparse", "dense"), r["ratio_vs_dense"] > 0
(True, True)
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..layouts.base import check_fraction, get_layout
from ..sparsifiers import BlockMagnitude, GroupedNM, Magnitude, NM, Sparsifier
from ..tensor import SparseTensor
from .report import sparsity_report
from .rule import NamePattern, Rule
from .sparsify import sparsify

__all__ = ["sparsify_linears", "default_sparsifier", "dense_where_slower", "speedup_vs_dense",
           "DEFAULT_TOKENS", "MARGIN"]

# sparsity -> (n, m) for the N:M family
_NM = {0.5: (2, 4), 0.75: (1, 4), 0.875: (1, 8), 0.9: (1, 10), 0.25: (3, 4)}

#: token count (rows of the input) at which ``only_if_faster=True`` times a layer
DEFAULT_TOKENS = 128
#: a sparse layer is kept only if it is at least this much faster than dense (ratio >= 1 + MARGIN):
#: a kernel that merely ties dense is not worth its dispatch and its timing noise
MARGIN = 0.05


def default_sparsifier(layout: str, sparsity: float, **params: Any) -> Sparsifier:
    """The natural one-shot magnitude sparsifier for ``layout`` at ``sparsity``."""
    if layout == "row_group":
        from ..methods.pattern import RowGroupSparsifier
        return RowGroupSparsifier(sparsity, **{k: v for k, v in params.items() if k in ("group", "permute")})
    if layout in ("nm", "grouped_nm"):
        n, m = params.get("n"), params.get("m")
        if n is None or m is None:
            if sparsity not in _NM:
                raise ValueError(f"layout {layout!r} needs n and m for sparsity {sparsity}; pass n=..., m=... "
                                 f"(known defaults: {sorted(_NM)})")
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
        raise TypeError(f"{arg} must be False, True (time at {DEFAULT_TOKENS} tokens) or a positive int "
                        f"(the token count to time at), got {type(only_if_faster).__name__} {only_if_faster!r}")
    if only_if_faster <= 0:
        raise ValueError(f"{arg} must be a positive token count (or True/False), got {only_if_faster}")
    return int(only_if_faster)


def speedup_vs_dense(weight: SparseTensor, bias: Optional[torch.Tensor], tokens: int) -> float:
    """Dense time / sparse time of ``F.linear`` on a ``(tokens, in_features)`` input, without autograd.

    Both calls use this layer's own (pruned) weight and bias and run side by side in this process
    (:func:`sparsa.timing.compare`: warm-up, alternate, median of a few samples), at the current
    ``torch.get_num_threads()``. Above 1 the sparse layout is faster.
    """
    from ..timing import compare
    dense = weight.sparse_layout.to_dense().detach().clone()
    b = bias.detach() if bias is not None else None
    x = torch.randn(tokens, dense.shape[1], dtype=dense.dtype, device=dense.device)
    sync = torch.cuda.synchronize if dense.device.type == "cuda" else (lambda: None)

    def run_dense():
        F.linear(x, dense, b)
        sync()

    def run_sparse():
        F.linear(x, weight, b)
        sync()

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a layout without a linear kernel warns once; the timing says it all
        return compare(run_dense, run_sparse, reps=5, warmup=2, min_seconds=0.002).ratio


def _cost_key(w: SparseTensor, has_bias: bool, tokens: int) -> Tuple:
    lay = w.sparse_layout
    params = tuple(sorted((k, repr(v)) for k, v in lay.params().items()))
    nnz_bucket = round(lay.density * 50)  # 2% density buckets
    return (type(lay).name, params, tuple(lay.shape), nnz_bucket, has_bias, str(lay.dtype), str(lay.device),
            tokens, torch.get_num_threads())


def dense_where_slower(model: nn.Module, tokens: int = DEFAULT_TOKENS, *, names: Optional[NamePattern] = None,
                       margin: float = MARGIN,
                       timer: Optional[Callable[[SparseTensor, Optional[torch.Tensor], int], float]] = None,
                       ) -> Dict[str, Dict[str, Any]]:
    """Time every sparse ``nn.Linear`` weight of ``model`` (or of the modules ``names`` matches) against
    dense and turn it into a plain dense parameter (same values, zeros included) where the sparse
    ``F.linear`` is not at least ``1 + margin`` times faster.

    ``timer(weight, bias, tokens) -> speed-up`` defaults to :func:`speedup_vs_dense`; layers with the
    same layout parameters, shape, density (2% buckets), dtype, device, token count and thread count
    are timed once. Returns ``{parameter name: {"path": "sparse" | "dense", "ratio_vs_dense": float}}``
    (tied weights appear under each name). A dense fallback, not the ``masked`` layout: masked runs
    the same BLAS product through the dispatcher and measured about 10% slower than ``F.linear``.
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
        raise ValueError(f"tokens must be a positive int (rows of the timed input), got {tokens!r}")
    if not isinstance(margin, (int, float)) or isinstance(margin, bool) or not math.isfinite(margin) or margin < 0:
        raise ValueError(f"margin must be a finite number >= 0, got {margin!r}")
    timer = timer if timer is not None else speedup_vs_dense
    select = Rule(names=names, module_types=nn.Linear)
    cache: Dict[Tuple, float] = {}
    done: Dict[int, Tuple[nn.Parameter, Dict[str, Any]]] = {}  # id(old weight) -> (new weight, decision)
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
            cache[key] = float(timer(w, mod.bias, tokens))
        ratio = cache[key]
        decision = {"path": "sparse" if ratio >= 1.0 + margin else "dense", "ratio_vs_dense": ratio}
        new = w
        if decision["path"] == "dense":
            with torch.no_grad():
                new = nn.Parameter(w.sparse_layout.to_dense().detach().clone(), requires_grad=w.requires_grad)
            setattr(mod, "weight", new)
        done[id(w)] = (new, decision)
        out[pname] = dict(decision)
    return out


def annotate_paths(rows: List[Dict[str, Any]], chosen: Dict[str, Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Add ``path`` and ``ratio_vs_dense`` to the report rows of the parameters in ``chosen``."""
    for r in rows:
        if r["target"] == "weight" and r["name"] in chosen:
            r.update(chosen[r["name"]])
    return rows


def sparsify_linears(model: nn.Module, layout: str = "row_group", sparsity: float = 0.5, *,
                     sparsifier: Optional[Sparsifier] = None, names: Optional[Sequence[str]] = None,
                     only_if_faster: Union[bool, int] = False, **params: Any) -> List[Dict[str, Any]]:
    """Convert every ``nn.Linear`` weight of ``model`` (or those named by ``names`` globs) to ``layout``
    at ``sparsity`` with one-shot magnitude pruning (or ``sparsifier``); returns the per-layer report
    (:func:`sparsa.sparsity_report` rows). ``params``: layout knobs such as ``group``, ``n``/``m``/``g``.

    ``only_if_faster`` (default ``False``): never slower than dense. ``True`` (or an int: the token
    count, i.e. rows of the input, to time at; ``True`` means 128) times each converted layer's sparse
    ``F.linear`` against dense ``F.linear`` on the same pruned weight, side by side at the current
    thread count, and where the sparse one is not at least ``1 + MARGIN`` (5%) faster stores that
    pruned weight as a plain dense parameter instead (same values, so the model computes the same
    function either way). Identical layers are timed once (a BERT-base takes a few seconds). Such a
    dense layer no longer keeps its zeros when trained further: use it to deploy, after pruning.

    The report rows of the converted weights carry ``path`` (``"sparse"``, or ``"dense"`` for a
    fallback, whose ``layout`` is then ``"dense"``) and ``ratio_vs_dense`` (dense time / sparse time,
    None when not measured).
    """
    get_layout(layout)
    check_fraction(sparsity, "sparsity")
    tokens = _tokens(only_if_faster)
    sp = sparsifier if sparsifier is not None else default_sparsifier(layout, sparsity, **params)
    lp = {k: v for k, v in params.items() if k not in ("group", "permute", "n", "m", "g", "blocksize")}
    rule = Rule(sparsifier=sp, layout=layout, layout_params=lp, names=list(names) if names else None,
                module_types=nn.Linear)
    sparsify(model, [rule])
    if tokens:
        chosen = dense_where_slower(model, tokens, names=rule.names)
    else:
        chosen = {f"{n}.weight" if n else "weight": {"path": "sparse", "ratio_vs_dense": None}
                  for n, m in model.named_modules() if rule.matches(n, m) and isinstance(m.weight, SparseTensor)}
    return annotate_paths(sparsity_report(model), chosen)
