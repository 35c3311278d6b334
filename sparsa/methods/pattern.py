"""Shared pieces of the methods: changing a sparse parameter's pattern in place, resetting optimizer
state, and a method config's pattern (:func:`resolve_pattern`).

A method never keeps masks of its own: the pattern lives in the parameter's layout. To change it
(gradual pruning, RigL, SET, movement pruning) :func:`set_pattern` rebuilds the layout from the
current values and a new mask and assigns it to the *same* parameter object, so the optimizer,
DDP and any hooks keep pointing at it.

>>> import torch, sparsa
>>> p = torch.nn.Parameter(sparsa.to_sparse(torch.randn(4, 8), "masked", mask=torch.ones(4, 8, dtype=torch.bool)))
>>> set_pattern(p, torch.rand(4, 8) > 0.5).layout_name
'masked'
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ..sparsifiers.base import Sparsifier
from ..sparsifiers.pattern_names import parse_pattern
from ..sparsifiers.resolve import resolve_pattern  # noqa: F401  (shared with sparsa.nn.one_shot)
from ..sparsifiers.row_group import RowGroupSparsifier  # noqa: F401  (its home before sparsa.sparsifiers)
from ..tensor import SparseTensor

__all__ = [
    "set_pattern",
    "reset_optimizer_state",
    "RowGroupSparsifier",
    "named_pattern",
    "resolve_pattern",
    "prunable_parameters",
]


def _check_sparse(param: Tensor, arg: str = "param") -> SparseTensor:
    if not isinstance(param, SparseTensor):
        raise TypeError(
            f"{arg} must be a sparse parameter (sparsa.SparseTensor), got {type(param).__name__}; "
            "make it sparse first, e.g. sparsa.sparsify(model, Rule(sparsifier=KeepAll()))"
        )
    return param


def set_pattern(param: SparseTensor, mask: Tensor, values: Optional[Tensor] = None) -> SparseTensor:
    """Store ``param`` with a new pattern ``mask`` (bool, same shape), in place and in the same layout.

    The values are ``values`` if given, else the current ones (positions new to the pattern hold
    whatever the dense tensor has there: zero for layouts that store nothing outside the pattern).
    Returns ``param`` (same object: optimizers and DDP keep referencing it).
    """
    _check_sparse(param)
    if not isinstance(mask, Tensor) or mask.shape != param.shape:
        raise ValueError(
            f"mask must be a bool tensor of shape {tuple(param.shape)}, got "
            f"{tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__}"
        )
    lay = param.sparse_layout
    with torch.no_grad():
        dense = lay.to_dense() if values is None else values.detach().to(lay.dtype)
        param._layout = type(lay).from_dense(dense, mask=mask.to(torch.bool), **lay.params())
    return param


def reset_optimizer_state(optimizer: Optional[torch.optim.Optimizer], param: Tensor, positions: Tensor) -> None:
    """Zero every per-element optimizer state of ``param`` (Adam's ``exp_avg``/``exp_avg_sq``, SGD's
    momentum...) at ``positions`` (bool), so regrown weights start fresh. The step counter is kept."""
    if optimizer is None:
        return
    for v in optimizer.state.get(param, {}).values():
        if isinstance(v, Tensor) and v.shape == positions.shape and v.is_floating_point():
            with torch.no_grad():
                if isinstance(v, SparseTensor):
                    v._layout = v._layout.refill(torch.where(positions, 0.0, v._layout.to_dense()))
                else:
                    v.masked_fill_(positions, 0.0)


def prunable_parameters(
    model: nn.Module, types: Tuple[type, ...] = (nn.Linear, nn.Conv2d)
) -> List[Tuple[str, nn.Module]]:
    """``(name, module)`` of every ``types`` module with a ``weight`` (what the methods prune by default)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, types) and getattr(m, "weight", None) is not None]


def named_pattern(name: str, sparsity: float = 0.5) -> Tuple[Sparsifier, str]:
    """``(sparsifier, layout name)`` of a pattern name: ``parse_pattern(name, sparsity)`` as a pair
    (:func:`sparsa.sparsifiers.parse_pattern` lists every spelling).

    >>> named_pattern("2:4")
    (NM(n=2, m=4), 'nm')
    """
    p = parse_pattern(name, sparsity)
    return p.sparsifier, p.layout


def _iter_sparse(params: Iterable[Tensor], arg: str = "params") -> List[SparseTensor]:
    out = [_check_sparse(p, arg) for p in params]
    if not out:
        raise ValueError(
            f"{arg} is empty: pass the sparse parameters to manage (e.g. "
            "[p for _, p in sparsa.nn.sparse_parameters(model)])"
        )
    return out
