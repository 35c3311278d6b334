"""Density crossovers of the sparse backward kernels: data measured on this CPU, not constants in code.

Below its crossover density a sparse backward kernel computes a product faster than BLAS on the
densified weight; above it, the dense product wins. Each crossover has a default, used until
``sparsa cost --refit`` (or :func:`refit`) times both sides on this CPU and stores the measured
crossover in the cost table (:mod:`sparsa.cost_model`, a fitted model under ``crossover|<name>``;
the measurement is in :mod:`sparsa.ops.crossover_refit`). ``sparsa cost --clear`` forgets it again.

Example::

    >>> from sparsa.ops import crossovers
    >>> 0 < crossovers.crossover("row_group.backward") <= 1
    True
    >>> sorted(crossovers.CROSSOVERS)
    ['grouped_nm.grad_weight', 'row_group.backward', 'sliced_ell.grad_input']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from ..cost_model import CostModel, default_cost_model

__all__ = ["Crossover", "CROSSOVERS", "crossover", "PREFIX"]

PREFIX = "crossover|"


@dataclass(frozen=True)
class Crossover:
    """A named crossover: its default density and what it decides."""

    default: float
    decides: str


CROSSOVERS: Dict[str, Crossover] = {
    "row_group.backward": Crossover(
        0.15, "row_group grad_input and grad_weight: gather + batched matmul kernels against BLAS on the dense weight"
    ),
    "sliced_ell.grad_input": Crossover(
        0.10, "sliced_ell grad_input: the forward kernel on the transposed pattern against grad_y @ dense weight"
    ),
    "grouped_nm.grad_weight": Crossover(
        0.15, "grouped_nm grad_weight: the sddmm kernel against dense grad_y.T @ x then masking"
    ),
}


def _check_name(name: str) -> Crossover:
    c = CROSSOVERS.get(name)
    if c is None:
        raise ValueError(f"crossover: unknown name {name!r}; known: {sorted(CROSSOVERS)}")
    return c


def crossover(name: str, cost_model: Optional[CostModel] = None) -> float:
    """The density at or below which the sparse side of ``name`` runs: measured if refitted, else the default."""
    c = _check_name(name)
    fit = (cost_model if cost_model is not None else default_cost_model()).fit(PREFIX + name)
    return float(fit["max_density"]) if fit is not None else c.default
