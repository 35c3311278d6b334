"""A method config's ``(sparsifier, layout)``: its own sparsifier, or a pattern name at a sparsity.

Shared by every config that accepts ``pattern=`` or ``sparsifier=`` (:class:`sparsa.methods.OneShot`,
``Wanda``, ``SparseGPT``, ``Gradual``), so it sits below both :mod:`sparsa.nn` and :mod:`sparsa.methods`.

>>> resolve_pattern(0.5, "2:4", None, None)
(NM(n=2, m=4), 'nm')
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from .base import check_sparsifier
from .pattern_names import parse_pattern

__all__ = ["resolve_pattern"]


def resolve_pattern(
    sparsity: float,
    pattern: Optional[str],
    layout: Optional[str],
    sparsifier: Any,
    default_pattern: str = "unstructured",
) -> Tuple[Any, str]:
    """``(sparsifier, layout)`` of a method config: its ``sparsifier`` (stored in ``layout``, default
    ``"masked"``) or else its ``pattern`` (default ``default_pattern``) at ``sparsity`` (stored in
    ``layout``, default the pattern's natural layout). Both given is a ``ValueError``."""
    if sparsifier is not None:
        check_sparsifier(sparsifier, "sparsifier")
        if pattern is not None:
            raise ValueError(
                f"pass pattern= or sparsifier=, not both (got pattern={pattern!r}, sparsifier={sparsifier!r})"
            )
        return sparsifier, layout or "masked"
    p = parse_pattern(default_pattern if pattern is None else pattern, sparsity, layout)
    return p.sparsifier, layout or p.layout
