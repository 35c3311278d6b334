"""Strict mode: a dense fallback on a :class:`~sparsa.SparseTensor` raises instead of warning.

Outside strict mode an op with no sparse implementation for its argument layouts runs densely,
warns once and is counted (:func:`sparsa.fallback_counts`). In strict mode the same call raises
:class:`SparseFallbackError` before anything runs, so the counters are left as they were.
Registered implementations, conversions to a registered layout, structural ops (detach, clone,
``to``) and the in-place refill rule (optimizer steps) are not fallbacks and run as usual.

Strict mode is on where the innermost :func:`strict` says so; where no :func:`strict` is in effect,
the environment variable ``SPARSA_STRICT=1`` turns it on (read at each fallback, not at import).
The state is per thread (a :mod:`contextvars` variable): a new thread starts without it.

Example::

    >>> import torch, sparsa
    >>> w = sparsa.to_sparse(torch.randn(4, 8), sparsa.layouts.NM, n=2, m=4)
    >>> with sparsa.strict():
    ...     y = torch.nn.functional.linear(torch.randn(3, 8), w)   # registered: runs
    ...     try:
    ...         torch.sin(w)                                       # no sparse sin: raises
    ...     except sparsa.SparseFallbackError as e:
    ...         print("raised")
    raised
    >>> sparsa.strict(True)       # as a flag, for the rest of this thread
    strict(True)
    >>> sparsa.is_strict()
    True
    >>> sparsa.strict(False)
    strict(False)
"""

from __future__ import annotations

import os
from contextvars import ContextVar
from typing import Optional, Tuple

__all__ = ["strict", "is_strict", "SparseFallbackError", "ENV_VAR"]

#: environment variable that turns strict mode on where no :func:`strict` is in effect
ENV_VAR = "SPARSA_STRICT"
_TRUE = frozenset({"1", "true", "yes", "on"})

# None: no strict() in effect, the environment decides
_STRICT: ContextVar[Optional[bool]] = ContextVar("sparsa_strict", default=None)


class SparseFallbackError(RuntimeError):
    """In strict mode, an op on a sparse tensor had no sparse implementation and would run densely."""


def is_strict() -> bool:
    """Whether a dense fallback raises here: the innermost :func:`strict`, else ``SPARSA_STRICT``."""
    v = _STRICT.get()
    if v is not None:
        return v
    return os.environ.get(ENV_VAR, "").strip().lower() in _TRUE


class strict:
    """Turn strict mode on (default) or off, now; as a context manager, restore the previous state on exit.

    ``with sparsa.strict(): ...`` makes every dense fallback in the block raise
    :class:`SparseFallbackError`; ``sparsa.strict(True)`` / ``sparsa.strict(False)`` set it for the rest
    of the current thread (or until an enclosing ``with`` block ends). ``with sparsa.strict(False):``
    allows fallbacks in a block even under ``SPARSA_STRICT=1``.
    """

    __slots__ = ("enabled", "_prev")

    def __init__(self, enabled: bool = True) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"strict(enabled=...) takes True or False, got {enabled!r}")
        self.enabled = enabled
        self._prev = _STRICT.get()
        _STRICT.set(enabled)

    def __enter__(self) -> "strict":
        return self

    def __exit__(self, *exc: object) -> None:
        _STRICT.set(self._prev)

    def __repr__(self) -> str:
        return f"strict({self.enabled})"


def fallback_error(
    op: str, layout_names: Tuple[str, ...], registrable: bool, torch_fn: Optional[str] = None
) -> SparseFallbackError:
    """The error strict mode raises for a dense fallback of ``op`` on arguments of ``layout_names``;
    ``torch_fn`` names the torch function (``"torch.sin"``) an implementation can be registered for."""
    sparse = [n for n in layout_names if n != "dense"]
    if registrable or torch_fn:
        target = repr(op) if registrable else torch_fn
        how = (
            f"register an implementation with @sparsa.implements({target}, <one layout class per tensor "
            f"argument, matching {layout_names}>), or convert the sparse argument first with "
            "sparsa.to_dense(x)"
        )
    else:
        how = (
            f"{op!r} has no torch function sparsa.implements could register, so convert the sparse "
            "argument first with sparsa.to_dense(x)"
        )
    return SparseFallbackError(
        f"sparsa strict mode: no sparse implementation of {op!r} for argument layouts {layout_names} "
        f"(sparse: {', '.join(sparse) or 'none'}); it would run densely. To fix: {how}; or allow dense "
        "fallbacks here with `with sparsa.strict(False):`."
    )
