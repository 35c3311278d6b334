"""The :class:`Sparsifier` base class and helpers shared by the sparsifier families.

A sparsifier decides *which* values survive; it never stores anything (that is a layout's job).

Example::

    >>> import torch
    >>> from sparsa.sparsifiers import Magnitude
    >>> s = Magnitude(0.5)
    >>> s.mask(torch.tensor([0.1, -3.0, 0.2, 4.0])).tolist()
    [False, True, False, True]
    >>> s(torch.tensor([0.1, -3.0, 0.2, 4.0])).tolist()
    [0.0, -3.0, 0.0, 4.0]
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from typing import Any, Dict, Optional

import torch
from torch import Tensor

from ..layouts.base import check_float, check_fraction

__all__ = ["Sparsifier", "is_sparsifier", "check_sparsifier", "n_removed", "top_mask"]


class Sparsifier(ABC):
    """Base class: subclasses implement :meth:`_mask` (on a detached float tensor) and may override
    :meth:`layout_params` and :meth:`_repr_args`.

    * ``mask(dense)`` -> bool tensor of kept positions (the input is never modified);
    * ``sparsifier(dense)`` -> ``dense`` with the removed positions set to zero;
    * ``layout_params()`` -> the parameters a layout needs to store this pattern (e.g. ``n``/``m``).
    """

    #: short registry-style name, e.g. ``"magnitude"``
    name: str = ""

    def mask(self, dense: Tensor) -> Tensor:
        """Boolean tensor (same shape as ``dense``) of the positions this sparsifier keeps."""
        check_float(dense, "dense")
        out = self._mask(dense.detach())
        if out.shape != dense.shape or out.dtype != torch.bool:  # pragma: no cover - subclass bug guard
            raise RuntimeError(
                f"{type(self).__name__}._mask returned {out.dtype} {tuple(out.shape)}, "
                f"expected a bool mask of shape {tuple(dense.shape)}"
            )
        return out

    @abstractmethod
    def _mask(self, dense: Tensor) -> Tensor:
        """Kept positions for a detached floating-point tensor."""

    def __call__(self, dense: Tensor) -> Tensor:
        """``dense`` with the removed positions zeroed (differentiable w.r.t. ``dense``)."""
        m = self.mask(dense)
        return torch.where(m, dense, torch.zeros((), dtype=dense.dtype, device=dense.device))

    def layout_params(self) -> Dict[str, Any]:
        """Parameters a layout needs to store this pattern (``{}`` for unstructured sparsifiers)."""
        return {}

    def with_sparsity(self, sparsity: float) -> "Sparsifier":
        """A copy with a different target ``sparsity`` (for schedules); only for fraction-based ones."""
        if not hasattr(self, "sparsity"):
            raise TypeError(f"{type(self).__name__} has no `sparsity` parameter to change")
        out = copy.copy(self)
        out.sparsity = check_fraction(sparsity, "sparsity")
        return out

    def _repr_args(self) -> Dict[str, Any]:
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._repr_args().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self._repr_args() == other._repr_args()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, repr(self)))


# ----------------------------------------------------------------------------- what counts as a sparsifier
def is_sparsifier(obj: Any) -> bool:
    """Whether ``obj`` is a sparsifier: a :class:`Sparsifier`, or any object with a callable
    ``mask(dense) -> bool tensor`` (``layout_params()`` is then optional). Every sparsa entry point that
    takes a sparsifier (:class:`sparsa.Rule`, :func:`sparsa.sparsify`, :func:`sparsa.to_sparse`) uses it.

    >>> import torch
    >>> class Top1:
    ...     def mask(self, dense): return dense == dense.max()
    >>> is_sparsifier(Top1()), is_sparsifier(0.5)
    (True, False)
    """
    return isinstance(obj, Sparsifier) or callable(getattr(obj, "mask", None))


def check_sparsifier(obj: Any, arg: str = "sparsifier", allow_none: bool = True) -> Optional[Any]:
    """``obj`` if it is a sparsifier (:func:`is_sparsifier`) or, with ``allow_none``, None; otherwise
    ``TypeError`` naming ``arg``, the value and the fix (one message for every entry point).

    >>> try:
    ...     check_sparsifier(0.5)
    ... except TypeError as e:
    ...     print(str(e).split(":")[0], "...", str(e)[-9:])
    sparsifier must be a sparsifier ... float 0.5
    """
    if (obj is None and allow_none) or is_sparsifier(obj):
        return obj
    raise TypeError(
        f"{arg} must be a sparsifier: a sparsa.sparsifiers.Sparsifier (e.g. Magnitude(0.5)) or any "
        f"object with a mask(dense) -> bool tensor method; got {type(obj).__name__} {obj!r}"
    )


def layout_params_of(sparsifier: Any) -> Dict[str, Any]:
    """``sparsifier.layout_params()``, or ``{}`` for a duck-typed sparsifier without that method.

    >>> from sparsa.sparsifiers import NM
    >>> layout_params_of(NM(2, 4)), layout_params_of(object())
    ({'n': 2, 'm': 4}, {})
    """
    get = getattr(sparsifier, "layout_params", None)
    return dict(get()) if callable(get) else {}


# ----------------------------------------------------------------------------- shared helpers
def n_removed(sparsity: float, n: int) -> int:
    """How many of ``n`` values a target ``sparsity`` removes: ``round(sparsity * n)`` (half-even)."""
    return int(round(sparsity * n))


def check_no_nan(dense: Tensor, who: str) -> None:
    """Magnitude-based selection is undefined with NaNs: raise instead of silently keeping garbage."""
    if dense.numel() and bool(torch.isnan(dense).any()):
        raise ValueError(
            f"{who}: the tensor contains {int(torch.isnan(dense).sum())} NaN value(s); "
            "magnitude ranking is undefined. Clean the weights first (e.g. torch.nan_to_num)"
        )


def top_mask(scores: Tensor, keep: int) -> Tensor:
    """Bool mask over the LAST dim of ``scores`` keeping the ``keep`` largest per row.

    Ties are broken deterministically: the lower index wins (stable descending sort).
    """
    cols = scores.shape[-1]
    keep = max(0, min(int(keep), cols))
    out = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    if keep == 0 or cols == 0:
        return out
    if keep == cols:
        return out.fill_(True)
    # a linear-time threshold instead of a sort (pruning an LLM ranks billions of values): the keep-th
    # largest value per row, everything above it, then the lowest-index ties up to ``keep``
    thresh = scores.kthvalue(cols - keep + 1, dim=-1, keepdim=True).values
    above = scores > thresh
    ties = scores == thresh
    room = keep - above.sum(-1, keepdim=True)
    return above | (ties & (ties.cumsum(-1) <= room))


def check_positive_int(value: Any, arg: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{arg} must be a positive int, got {value!r}")
    return value


def check_nm(n: Any, m: Any) -> tuple:
    m = check_positive_int(m, "m")
    n = check_positive_int(n, "n")
    if n >= m:
        raise ValueError(f"n must be smaller than m (keep n of every m values), got n={n}, m={m}")
    return n, m
