"""Pattern names: the one parser of the strings ``sparsa prune --pattern``, :func:`sparsa.recover`,
the method configs and the frontier take (``"2:4"``, ``"grouped_2:4"``, ``"row_group16"``...).

>>> from sparsa.sparsifiers import parse_pattern
>>> p = parse_pattern("2:4")
>>> p.sparsifier, p.layout, p.sparsity
(NM(n=2, m=4), 'nm', 0.5)
>>> parse_pattern("grouped_nm", 0.8).canonical
'grouped_1:5'
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional, Tuple

from ..layouts.base import check_fraction
from .base import Sparsifier
from .grouped_nm import GroupedNM
from .magnitude import Magnitude
from .nm import NM
from .row_group import RowGroupSparsifier

__all__ = [
    "parse_pattern",
    "NamedPattern",
    "PATTERN_SPELLINGS",
    "grouped_nm_for",
    "GROUPED_NM_COLUMNS",
    "DEFAULT_ROW_GROUP",
]

#: every accepted spelling, as the error for an unknown one lists them
PATTERN_SPELLINGS = (
    "'unstructured'",
    "'N:M' (e.g. '2:4'; with layout 'grouped_nm' stored as grouped N:M)",
    "'grouped_N:M' (e.g. 'grouped_2:4')",
    "'grouped_nm' (the grouped N:M nearest the sparsity)",
    "'row_group<G>' (e.g. 'row_group16'; 'row_group' alone means 'row_group16')",
)
#: columns that share one grouped N:M pattern
GROUPED_NM_COLUMNS = 4
#: the group size of a bare ``"row_group"``
DEFAULT_ROW_GROUP = 16

_NM_RE = re.compile(r"(\d+):(\d+)")
_GROUPED_RE = re.compile(r"grouped_(\d+):(\d+)")
_ROW_GROUP_RE = re.compile(r"row_group(\d*)")


@dataclass(frozen=True)
class NamedPattern:
    """A parsed pattern name: the ``spelling`` given, its ``canonical`` name (``"grouped_nm"`` at 0.8
    is ``"grouped_1:5"``, ``"row_group"`` is ``"row_group16"``), the ``sparsifier`` that selects it,
    its natural ``layout`` and the ``sparsity`` it stores (fixed by the structure for N:M)."""

    spelling: str
    canonical: str
    layout: str
    sparsity: float
    sparsifier: Sparsifier = field(compare=False)


def grouped_nm_for(sparsity: float, max_m: int = 10) -> Tuple[int, int]:
    """The grouped N:M (``n`` of ``m``, n in 1..2, 4 <= m <= ``max_m``) whose sparsity ``1 - n/m`` is
    nearest ``sparsity`` (smaller m on ties; n > 2 makes the grouped mask search very slow).

    >>> [grouped_nm_for(s) for s in (0.5, 0.6, 0.75, 0.8, 0.9)]
    [(2, 4), (2, 5), (1, 4), (1, 5), (1, 10)]
    """
    return min(
        ((n, m) for m in range(4, max_m + 1) for n in (1, 2)),
        key=lambda nm: (round(abs(1 - nm[0] / nm[1] - sparsity), 9), nm[1]),
    )


def parse_pattern(
    pattern: str, sparsity: float = 0.5, layout: Optional[str] = None, *, arg: str = "pattern"
) -> NamedPattern:
    """Parse ``pattern`` at ``sparsity``; ``layout`` only changes the answer for an ``'N:M'`` pattern
    stored as ``"grouped_nm"`` (a plain N:M mask is not grouped N:M, so the grouped sparsifier picks it).

    Accepted spellings (:data:`PATTERN_SPELLINGS`): ``"unstructured"`` (magnitude per output row,
    layout ``"masked"``), ``"N:M"`` (layout ``"nm"``), ``"grouped_N:M"`` and ``"grouped_nm"`` (layout
    ``"grouped_nm"``, the pattern shared by 4 columns) and ``"row_group<G>"`` (layout ``"row_group"``).
    An unknown spelling raises ``ValueError`` listing them all; a known one with bad numbers (``"5:4"``)
    raises ``ValueError`` naming ``arg``, the pattern and the fix.

    >>> parse_pattern("2:4", layout="grouped_nm").sparsifier
    GroupedNM(n=2, m=4, g=4)
    >>> parse_pattern("row_group8", 0.75).sparsifier
    RowGroupSparsifier(sparsity=0.75, group=8)
    """
    if not isinstance(pattern, str):
        raise TypeError(
            f"{arg} must be a string: one of {', '.join(PATTERN_SPELLINGS)}; got {type(pattern).__name__} {pattern!r}"
        )
    try:
        return _parse(pattern, sparsity, layout)
    except _Unknown:
        raise ValueError(f"{arg} must be one of {', '.join(PATTERN_SPELLINGS)}; got {pattern!r}") from None
    except (ValueError, TypeError) as e:
        raise ValueError(f"{arg} {pattern!r}: {e}") from None


class _Unknown(Exception):
    pass


def _parse(pattern: str, sparsity: float, layout: Optional[str]) -> NamedPattern:
    if pattern == "unstructured":
        sparsity = check_fraction(sparsity, "sparsity")
        return NamedPattern(pattern, pattern, "masked", float(sparsity), Magnitude(sparsity, per="row"))
    if pattern == "grouped_nm":
        n, m = grouped_nm_for(check_fraction(sparsity, "sparsity"))
        return _grouped(pattern, n, m)
    grouped = _GROUPED_RE.fullmatch(pattern)
    if grouped:
        return _grouped(pattern, int(grouped[1]), int(grouped[2]))
    nm = _NM_RE.fullmatch(pattern)
    if nm:
        n, m = int(nm[1]), int(nm[2])
        if layout == "grouped_nm":
            return _grouped(pattern, n, m)
        return NamedPattern(pattern, pattern, "nm", round(1 - n / max(m, 1), 4), NM(n, m))
    rg = _ROW_GROUP_RE.fullmatch(pattern)
    if rg:
        group = int(rg[1]) if rg[1] else DEFAULT_ROW_GROUP
        if group <= 0:
            raise ValueError("the group size must be a positive int, e.g. 'row_group16'")
        return NamedPattern(
            pattern,
            f"row_group{group}",
            "row_group",
            float(check_fraction(sparsity, "sparsity")),
            RowGroupSparsifier(sparsity, group=group),
        )
    raise _Unknown


def _grouped(pattern: str, n: int, m: int) -> NamedPattern:
    sp = GroupedNM(n, m, GROUPED_NM_COLUMNS)
    return NamedPattern(pattern, f"grouped_{n}:{m}", "grouped_nm", round(1 - n / m, 4), sp)
