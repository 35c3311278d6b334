"""One-shot magnitude pruning as a :func:`sparsa.sparsify` config: every selected ``nn.Linear`` weight
pruned once to a pattern (or by a sparsifier) and stored in a layout, optionally only where the sparse
kernel is measured faster than dense. :class:`sparsa.methods.OneShot` is this class; it lives in
:mod:`sparsa.nn` because the deprecated :func:`sparsify_linears` (exported by ``sparsa.nn``) is built on it.

>>> import torch.nn as nn, sparsa
>>> from sparsa.methods import OneShot
>>> model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
>>> model = sparsa.sparsify(model, OneShot(0.75, layout="row_group", layout_params={"group": 8}))
>>> [(r["name"], r["layout"], r["sparsity"]) for r in sparsa.sparsity_report(model) if r["name"].endswith("weight")]
[('0.weight', 'row_group', 0.75), ('2.weight', 'row_group', 0.75)]
"""

from __future__ import annotations

import re
import warnings
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
from torch import nn

from ..layouts.base import check_fraction, get_layout
from ..sparsifiers.base import Sparsifier
from ..sparsifiers.resolve import resolve_pattern
from ..tensor import SparseTensor
from .config import FilterFn, SparsifyConfig
from .linears import _tokens, default_sparsifier, dense_where_slower, record_paths, timing_tokens
from .report import sparsity_report
from .rule import Rule
from .sparsify import sparsify

__all__ = ["OneShot", "SPARSIFIER_KNOBS", "sparsify_linears"]

#: ``layout_params`` keys that choose the default sparsifier's pattern rather than the layout's storage
SPARSIFIER_KNOBS = ("group", "permute", "n", "m", "g", "blocksize")


@dataclass
class OneShot(SparsifyConfig):
    """Prune every ``nn.Linear`` weight (or those ``filter_fn`` accepts) once, by magnitude.

    Args:
        sparsity: target fraction of zeros (N:M patterns have their own fixed one).
        pattern: a pattern name (:func:`sparsa.sparsifiers.parse_pattern`: ``"unstructured"``,
            ``"2:4"``, ``"grouped_2:4"``, ``"row_group16"``...); its natural layout unless ``layout``.
        layout: the storage layout; without ``pattern`` or ``sparsifier`` its natural magnitude
            sparsifier is used (``"masked"``: per-row magnitude, ``"nm"``: N:M...).
        sparsifier: any sparsifier instead of a pattern (stored in ``layout``, default ``"masked"``).
        layout_params: layout knobs such as ``group``, ``n``/``m``/``g`` or ``blocksize`` (these pick the
            default sparsifier's pattern) and any other layout parameter.
        only_if_faster: ``True`` (or a token count to time at) keeps a layer sparse only where its kernel
            is measured faster than dense here (:func:`sparsa.nn.dense_where_slower`); the decisions
            appear in :func:`sparsa.sparsity_report` rows (``path``, ``ratio_vs_dense``...).
        dtypes: with ``only_if_faster``, the dense dtypes a slower layer may switch to.

    >>> import torch.nn as nn, sparsa
    >>> m = sparsa.sparsify(nn.Linear(16, 8), OneShot(pattern="2:4"))
    >>> m.weight.layout_name, m.weight.sparsity
    ('nm', 0.5)
    """

    sparsity: float = 0.5
    _: KW_ONLY
    pattern: Optional[str] = None
    layout: Optional[str] = None
    sparsifier: Any = None
    layout_params: Dict[str, Any] = field(default_factory=dict)
    only_if_faster: Union[bool, int] = False
    dtypes: Optional[Sequence[torch.dtype]] = None

    def __post_init__(self) -> None:
        check_fraction(self.sparsity, "sparsity")
        if self.layout is not None:
            get_layout(self.layout)
        if not isinstance(self.layout_params, dict):
            raise TypeError(f"layout_params must be a dict such as {{'group': 8}}, got {self.layout_params!r}")
        _tokens(self.only_if_faster)

    def resolved(self) -> tuple:
        """``(sparsifier, layout name, layout parameters)`` this config stores."""
        lp = {k: v for k, v in self.layout_params.items() if k not in SPARSIFIER_KNOBS}
        if self.sparsifier is None and self.pattern is None:
            layout = self.layout or "masked"
            return default_sparsifier(layout, self.sparsity, **self.layout_params), layout, lp
        sp, layout = resolve_pattern(self.sparsity, self.pattern, self.layout, self.sparsifier)
        return sp, layout, lp

    def apply(self, model: nn.Module, filter_fn: Optional[FilterFn] = None) -> None:
        sp, layout, lp = self.resolved()
        rule = Rule(sparsifier=sp, layout=layout, layout_params=lp, module_types=nn.Linear)
        sparsify(model, rule, filter_fn)
        done = [
            n
            for n, m in model.named_modules()
            if rule.matches(n, m) and (filter_fn is None or filter_fn(m, n)) and isinstance(m.weight, SparseTensor)
        ]
        tokens = timing_tokens(self.only_if_faster, model)
        if tokens:
            chosen = dense_where_slower(
                model, tokens, names=[re.compile(re.escape(n)) for n in done], dtypes=self.dtypes
            )
        else:
            chosen = {
                f"{n}.weight" if n else "weight": {
                    "path": "sparse",
                    "ratio_vs_dense": None,
                    "ratio_vs_best_dense": None,
                    "best_dense": None,
                }
                for n in done
            }
        record_paths(model, chosen)


def sparsify_linears(
    model: nn.Module,
    layout: str = "row_group",
    sparsity: float = 0.5,
    *,
    sparsifier: Optional[Sparsifier] = None,
    names: Optional[Sequence[str]] = None,
    only_if_faster: Union[bool, int] = False,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    **params: Any,
) -> List[Dict[str, Any]]:
    """Deprecated: use ``sparsa.sparsify(model, sparsa.methods.OneShot(sparsity, layout=layout,
    layout_params=params, only_if_faster=...), filter_fn)`` and then :func:`sparsa.sparsity_report`.

    Converts every ``nn.Linear`` weight of ``model`` (or those named by ``names`` globs) to ``layout``
    at ``sparsity`` with one-shot magnitude pruning (or ``sparsifier``); returns the per-layer report
    (:func:`sparsa.sparsity_report` rows, with ``path``, ``ratio_vs_dense``, ``ratio_vs_best_dense`` and
    ``best_dense`` on the converted weights). See :class:`sparsa.methods.OneShot` for the knobs.

    >>> import warnings, torch.nn as nn, sparsa
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", DeprecationWarning)
    ...     rows = sparsa.sparsify_linears(nn.Linear(16, 8), "nm", 0.5)
    >>> rows[0]["layout"], rows[0]["path"]
    ('nm', 'sparse')
    """
    warnings.warn(
        "sparsa.sparsify_linears is deprecated: use model = sparsa.sparsify(model, "
        "sparsa.methods.OneShot(sparsity, layout=..., layout_params={...}, only_if_faster=...), filter_fn) "
        "and rows = sparsa.sparsity_report(model)",
        DeprecationWarning,
        stacklevel=2,
    )
    get_layout(layout)
    check_fraction(sparsity, "sparsity")
    select = Rule(names=list(names), module_types=nn.Linear) if names else None
    config = OneShot(
        sparsity,
        layout=layout,
        sparsifier=sparsifier,
        layout_params=params,
        only_if_faster=only_if_faster,
        dtypes=dtypes,
    )
    sparsify(model, config, None if select is None else (lambda m, n: select.matches(n, m)))
    return sparsity_report(model)
