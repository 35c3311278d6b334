"""One sparse product for the sibling projections that read the same input (q/k/v, gate/up).

A transformer's self-attention multiplies one hidden state by three weights (``query``, ``key``,
``value``; ``q_proj``, ``k_proj``, ``v_proj``) and a gated MLP by two (``gate_proj``, ``up_proj``).
Each sparse product pays a fixed cost beyond its arithmetic (the input's pack into panels, a parallel
region, the op's dispatch), so at small token counts three products cost far more than one with the
rows of all three. :func:`fuse_projections` concatenates the siblings' rows into one weight of the
same layout (the same kept positions and values, checked exactly) held by a :class:`FusedProjections`,
and replaces each sibling with a :class:`ProjectionSlice` that returns its columns of the one product.
The parent module's ``forward`` is untouched: whichever slice is called first runs the product for all
of them and keeps the others' outputs for that very input tensor, until they are taken.

::

    >>> import torch, torch.nn as nn, sparsa
    >>> class Attn(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.query, self.key, self.value = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)
    ...     def forward(self, h):
    ...         return self.query(h) + self.key(h) * self.value(h)
    >>> m = sparsa.sparsify(Attn(), sparsa.methods.OneShot(0.75, pattern="row_group8"))
    >>> x = torch.randn(4, 32)
    >>> with torch.no_grad():
    ...     before = m(x)
    ...     n = sparsa.fuse_projections(m)
    ...     torch.allclose(m(x), before, atol=1e-6), n, type(m.key).__name__
    (True, 1, 'ProjectionSlice')

Fuse for inference: the model's ``state_dict`` then holds the fused weight (under the parent's
``<names joined by _>``, e.g. ``query_key_value``) instead of the siblings' own, so save and load the
model before fusing. The fused weight and bias require grad where the siblings' did, so a model fused
before training trains them (build the optimizer after fusing: the siblings' parameters leave the model).
"""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..tensor import SparseTensor
from .linears import exact_sparse

__all__ = ["SIBLINGS", "FusedProjections", "ProjectionSlice", "fuse_projections"]

#: attribute names of Linears that read one input in the modules that hold them (self-attention and gated
#: MLPs of BERT- and Llama-style models); a module is fused only if it has every name of a tuple
SIBLINGS: Tuple[Tuple[str, ...], ...] = (
    ("query", "key", "value"),
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
)


class FusedProjections(nn.Module):
    """The concatenated projections: ``linear`` (one ``nn.Linear`` with every sibling's rows, in order)
    and ``sizes`` (each sibling's ``out_features``). :meth:`output` gives sibling ``i``'s part of the
    product for ``x``, running the product once per input tensor (per thread)."""

    def __init__(self, linear: nn.Linear, sizes: Sequence[int]):
        super().__init__()
        if sum(sizes) != linear.out_features:
            raise ValueError(f"FusedProjections: sizes {list(sizes)} do not add up to {linear.out_features} rows")
        self.linear = linear
        self.sizes = tuple(int(s) for s in sizes)
        # per thread: (the input, the parts, which parts are still to be taken, the input's version); dropped
        # once every part is taken
        self._pending: Dict[int, Tuple[Tensor, Tuple[Tensor, ...], List[bool], int]] = {}

    def output(self, x: Tensor, index: int) -> Tensor:
        # the same input tensor object (and, in eager, the same version) as the product kept: its parts are
        # valid; any other input runs the product again
        compiling = torch.compiler.is_compiling()
        thread = 0 if compiling else threading.get_ident()  # Dynamo traces no thread ids; a trace is one thread
        hit = self._pending.get(thread)
        if hit is not None and hit[0] is x and hit[3] == _version(x, compiling):
            parts, waiting = hit[1], hit[2]
        else:
            parts = self.linear(x).split(self.sizes, dim=-1)  # a module call: its hooks (timers, profilers) see it
            waiting = [True] * len(self.sizes)
            hit = (x, parts, waiting, _version(x, compiling))
        waiting[index] = False
        if any(waiting):
            self._pending[thread] = hit
        else:
            self._pending.pop(thread, None)
        return parts[index]

    def __getstate__(self):  # a copy or pickle keeps no product of an earlier call
        state = self.__dict__.copy()
        state["_pending"] = {}
        return state

    def extra_repr(self) -> str:
        return f"sizes={self.sizes}"


def _version(x: Tensor, compiling: bool) -> int:
    # inference tensors have no version counter (nor can a trace read one): identity alone decides there
    return -1 if compiling or x.is_inference() else x._version


class ProjectionSlice(nn.Module):
    """Stands where a fused sibling was: ``forward(x)`` is that sibling's output, columns ``index`` of the
    :class:`FusedProjections` product. The fused module is the parent's (not this module's) child, so it
    is held here outside the module tree."""

    def __init__(self, fused: FusedProjections, index: int):
        super().__init__()
        object.__setattr__(self, "fused", fused)
        self.index = int(index)
        self.in_features = fused.linear.in_features
        self.out_features = fused.sizes[self.index]

    def forward(self, x: Tensor) -> Tensor:
        return self.fused.output(x, self.index)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, index={self.index}"


def _concat_weight(weights: Sequence[Tensor]) -> Optional[Tensor]:
    """The siblings' weights stacked by rows in their common sparse layout, or None where they are not all
    sparse in one layout, dtype and set of parameters, or the layout cannot hold the stack exactly."""
    first = weights[0]
    if not all(isinstance(w, SparseTensor) for w in weights):
        return None
    lay = first.sparse_layout
    if any(w.layout_name != first.layout_name or w.dtype != first.dtype for w in weights):
        return None
    if any(w.sparse_layout.params() != lay.params() for w in weights):
        return None
    with torch.no_grad():
        dense = torch.cat([w.sparse_layout.to_dense().detach() for w in weights])
        mask = torch.cat([w.pattern() for w in weights])
        fused = exact_sparse(dense, mask, first.layout_name, **lay.params())
        if fused is None:
            return None
        if fused.nbytes_sparse > sum(w.nbytes_sparse for w in weights) * 1.02:  # e.g. padding that grew
            return None
    return fused


def _fuse_group(mod: nn.Module, names: Tuple[str, ...]) -> bool:
    linears = [getattr(mod, n, None) for n in names]
    if not all(type(lin) is nn.Linear for lin in linears):  # a LinearGELU or a slice already: not a sibling set
        return False
    if len({lin.in_features for lin in linears}) != 1:
        return False
    if "Cross" in type(mod).__name__:  # a cross-attention's key/value read the encoder's states, not the query's
        return False
    weight = _concat_weight([lin.weight for lin in linears])
    if weight is None:
        return False
    has_bias = [lin.bias is not None for lin in linears]
    with torch.no_grad():
        if any(has_bias):
            bias = torch.cat(
                [
                    lin.bias.detach() if lin.bias is not None else torch.zeros(lin.out_features, dtype=lin.weight.dtype)
                    for lin in linears
                ]
            )
        else:
            bias = None
    sizes = [lin.out_features for lin in linears]
    fused_linear = nn.Linear(linears[0].in_features, sum(sizes), bias=bias is not None, device="meta")
    # trainable where every sibling was (an optimizer built after fusing then trains the fused weight)
    fused_linear.weight = nn.Parameter(weight, requires_grad=all(lin.weight.requires_grad for lin in linears))
    if bias is not None:
        trainable = all(lin.bias is None or lin.bias.requires_grad for lin in linears)
        fused_linear.bias = nn.Parameter(bias, requires_grad=trainable)
    fused = FusedProjections(fused_linear, sizes)
    setattr(mod, "_".join(names), fused)
    for i, n in enumerate(names):
        setattr(mod, n, ProjectionSlice(fused, i))
    return True


def fuse_projections(model: nn.Module) -> int:
    """Fuse, in place, every set of sibling projections (:data:`SIBLINGS`) of ``model`` whose Linears all
    hold sparse weights of one layout, dtype and parameter set and read inputs of one width; returns how
    many sets were fused. Modules named ``*Cross*`` (cross-attention) are skipped. Call it after
    sparsifying and converting (e.g. ``.to(torch.bfloat16)``), for inference; the siblings' own parameters
    leave the model (see the module notes on ``state_dict`` and optimizers)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fuse_projections: model must be an nn.Module, got {type(model).__name__}")
    fused = 0
    for mod in list(model.modules()):
        for names in SIBLINGS:
            if all(isinstance(getattr(mod, n, None), nn.Module) for n in names) and _fuse_group(mod, names):
                fused += 1
    return fused
