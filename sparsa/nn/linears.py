"""One call to put every ``nn.Linear`` of a model into a layout at a sparsity.

>>> import torch.nn as nn, sparsa
>>> model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
>>> rows = sparsa.sparsify_linears(model, "row_group", sparsity=0.75, group=8)
>>> [(r["name"], r["layout"], r["sparsity"]) for r in rows if r["name"].endswith("weight")]
[('0.weight', 'row_group', 0.75), ('2.weight', 'row_group', 0.75)]
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from torch import nn

from ..layouts.base import check_fraction, get_layout
from ..sparsifiers import BlockMagnitude, GroupedNM, Magnitude, NM, Sparsifier
from .report import sparsity_report
from .rule import Rule
from .sparsify import sparsify

__all__ = ["sparsify_linears", "default_sparsifier"]

# sparsity -> (n, m) for the N:M family
_NM = {0.5: (2, 4), 0.75: (1, 4), 0.875: (1, 8), 0.9: (1, 10), 0.25: (3, 4)}


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


def sparsify_linears(model: nn.Module, layout: str = "row_group", sparsity: float = 0.5, *,
                     sparsifier: Optional[Sparsifier] = None, names: Optional[Sequence[str]] = None,
                     **params: Any) -> List[Dict[str, Any]]:
    """Convert every ``nn.Linear`` weight of ``model`` (or those named by ``names`` globs) to ``layout``
    at ``sparsity`` with one-shot magnitude pruning (or ``sparsifier``); returns the per-layer report
    (:func:`sparsa.sparsity_report` rows). ``params``: layout knobs such as ``group``, ``n``/``m``/``g``.
    """
    get_layout(layout)
    check_fraction(sparsity, "sparsity")
    sp = sparsifier if sparsifier is not None else default_sparsifier(layout, sparsity, **params)
    lp = {k: v for k, v in params.items() if k not in ("group", "permute", "n", "m", "g", "blocksize")}
    sparsify(model, [Rule(sparsifier=sp, layout=layout, layout_params=lp, names=list(names) if names else None,
                          module_types=nn.Linear)])
    return sparsity_report(model)
