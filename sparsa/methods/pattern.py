"""Shared pieces of the methods: changing a sparse parameter's pattern in place, resetting optimizer
state, the row-group sparsifier and named sparsity patterns.

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

from ..layouts.base import check_fraction
from ..sparsifiers import NM, Magnitude
from ..sparsifiers.base import Sparsifier
from ..tensor import SparseTensor

__all__ = ["set_pattern", "reset_optimizer_state", "RowGroupSparsifier", "named_pattern", "prunable_parameters"]


def _check_sparse(param: Tensor, arg: str = "param") -> SparseTensor:
    if not isinstance(param, SparseTensor):
        raise TypeError(f"{arg} must be a sparse parameter (sparsa.SparseTensor), got {type(param).__name__}; "
                        "make it sparse first, e.g. sparsa.sparsify(model, Rule(sparsifier=KeepAll()))")
    return param


def set_pattern(param: SparseTensor, mask: Tensor, values: Optional[Tensor] = None) -> SparseTensor:
    """Store ``param`` with a new pattern ``mask`` (bool, same shape), in place and in the same layout.

    The values are ``values`` if given, else the current ones (positions new to the pattern hold
    whatever the dense tensor has there: zero for layouts that store nothing outside the pattern).
    Returns ``param`` (same object: optimizers and DDP keep referencing it).
    """
    _check_sparse(param)
    if not isinstance(mask, Tensor) or mask.shape != param.shape:
        raise ValueError(f"mask must be a bool tensor of shape {tuple(param.shape)}, got "
                         f"{tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__}")
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


def prunable_parameters(model: nn.Module,
                        types: Tuple[type, ...] = (nn.Linear, nn.Conv2d)) -> List[Tuple[str, nn.Module]]:
    """``(name, module)`` of every ``types`` module with a ``weight`` (what the methods prune by default)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, types) and getattr(m, "weight", None) is not None]


class RowGroupSparsifier(Sparsifier):
    """The fast CPU pattern: every ``group`` rows keep the same input columns (those with the
    largest L2 norm over the group); stored by the ``"row_group"`` layout.

    ``permute=True`` lets rows of similar column importance form the groups instead of consecutive
    rows (more of the weight kept at the same kernel speed). ``scores``: importance used instead of
    ``|W|``, shape ``(K,)`` per input feature (multiplies ``|W|``, e.g. Wanda's input norms) or the
    weight's shape.

    >>> import torch
    >>> RowGroupSparsifier(0.5, group=4).mask(torch.randn(8, 10)).sum(1).tolist()
    [5, 5, 5, 5, 5, 5, 5, 5]
    >>> RowGroupSparsifier(0.5, group=4, permute=True).mask(torch.randn(8, 10)).sum(1).tolist()
    [5, 5, 5, 5, 5, 5, 5, 5]
    """

    name = "row_group"

    def __init__(self, sparsity: float, group: int = 16, permute: bool = False, scores: Optional[Tensor] = None):
        if not isinstance(permute, bool):
            raise TypeError(f"permute must be True or False, got {permute!r}")
        if scores is not None and not isinstance(scores, Tensor):
            raise TypeError(f"scores must be a tensor (per input feature or per weight) or None, got "
                            f"{type(scores).__name__}")
        self.sparsity = check_fraction(sparsity, "sparsity")
        self.group = group
        self.permute = permute
        self.scores = scores

    def _mask(self, dense: Tensor) -> Tensor:
        from ..layouts.row_group import row_group_mask
        return row_group_mask(dense, self.sparsity, self.group, permute=self.permute, scores=self.scores)

    def layout_params(self):
        return {"group": self.group}

    def _repr_args(self):
        out = {"sparsity": self.sparsity, "group": self.group}
        if self.permute:
            out["permute"] = True
        if self.scores is not None:
            out["scores"] = f"<tensor {tuple(self.scores.shape)}>"
        return out


def named_pattern(name: str, sparsity: float = 0.5) -> Tuple[Sparsifier, str]:
    """``(sparsifier, layout name)`` for a pattern name: ``"unstructured"`` (per output row),
    ``"N:M"`` such as ``"2:4"``, or ``"row_group<G>"`` such as ``"row_group16"``.

    >>> named_pattern("2:4")
    (NM(n=2, m=4), 'nm')
    """
    if name == "unstructured":
        return Magnitude(sparsity, per="row"), "masked"
    if ":" in name:
        n, m = (int(v) for v in name.split(":"))
        return NM(n, m), "nm"
    if name.startswith("row_group"):
        return RowGroupSparsifier(sparsity, group=int(name[len("row_group"):] or 16)), "row_group"
    raise ValueError(f"pattern must be 'unstructured', 'N:M' (e.g. '2:4') or 'row_group<G>' (e.g. 'row_group16'), "
                     f"got {name!r}")


def _iter_sparse(params: Iterable[Tensor], arg: str = "params") -> List[SparseTensor]:
    out = [_check_sparse(p, arg) for p in params]
    if not out:
        raise ValueError(f"{arg} is empty: pass the sparse parameters to manage (e.g. "
                         "[p for _, p in sparsa.nn.sparse_parameters(model)])")
    return out
