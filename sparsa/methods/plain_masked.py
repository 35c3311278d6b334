"""Train ``masked`` sparse weights as plain dense Parameters, the pattern kept by explicit masking.

A ``masked`` :class:`~sparsa.SparseTensor` parameter trains exactly, but every optimizer update on it
runs through the tensor subclass, one tensor at a time and with a ``where`` per in-place op, and its
forward runs through sparsa's dispatch. For a training loop that owns its step (such as
:func:`~sparsa.methods.recover`), :class:`PlainMaskedWeights` swaps each such weight for a plain
``nn.Parameter`` on the *same storage* as the layout's values, so the model's forward, autocast and a
fused optimizer take PyTorch's own paths, and keeps the pattern itself:

- :meth:`mask_grads` after ``backward()`` zeroes the gradient outside the pattern (elementwise
  optimizers then keep their state and the weights there at zero, as on the subclass);
- :meth:`mask_weights` after ``optimizer.step()`` zeroes the weights outside the pattern (for
  optimizers that are not elementwise, or decay towards a nonzero point);
- :meth:`pattern_changed` after a pruner stored a new pattern in the sparse parameter: copies its
  values into the plain one, re-links the storage and zeroes the optimizer's state at the pruned
  positions;
- :meth:`restore` puts the sparse parameters back (their values are the trained ones).

>>> import torch, torch.nn as nn, sparsa
>>> lin = nn.Linear(8, 4)
>>> lin.weight = nn.Parameter(sparsa.to_sparse(lin.weight.detach(), "masked", mask=torch.rand(4, 8) > 0.5))
>>> plain = PlainMaskedWeights(lin, [""])
>>> type(lin.weight) is nn.Parameter
True
>>> opt = torch.optim.AdamW(lin.parameters(), lr=0.1)
>>> lin(torch.randn(3, 8)).sum().backward(); plain.mask_grads(); opt.step()
>>> plain.restore()
>>> bool((lin.weight.to_dense()[~lin.weight.sparse_layout.mask()] == 0).all())
True
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import nn

from ..layouts.masked import Masked
from ..tensor import SparseTensor
from .pattern import reset_optimizer_state

__all__ = ["PlainMaskedWeights"]


class _Entry:
    __slots__ = ("modules", "sparse", "plain", "keep")

    def __init__(self, module: nn.Module, sparse: SparseTensor, plain: nn.Parameter, mask: torch.Tensor):
        self.modules, self.sparse, self.plain = [module], sparse, plain
        # the bool mask's bytes as 0/1: a multiply by it is several times faster than masked_fill_
        self.keep = mask.contiguous().view(torch.uint8)


class PlainMaskedWeights:
    """The ``weight`` of each module of ``model`` named in ``names`` (a ``masked`` SparseTensor
    parameter) replaced by a plain Parameter sharing its values (one per weight: a tied weight stays
    tied); see the module docstring. ``entries`` are in the order of ``names``' first occurrences."""

    def __init__(self, model: nn.Module, names: Sequence[str]):
        self.entries: List[_Entry] = []
        seen = {}
        for n in names:
            m = model.get_submodule(n)
            w = m.weight
            if id(w) in seen:  # a weight tied between modules stays tied
                seen[id(w)].modules.append(m)
                m.weight = seen[id(w)].plain
                continue
            if not isinstance(w, SparseTensor) or not isinstance(w.sparse_layout, Masked):
                got = w.layout_name if isinstance(w, SparseTensor) else type(w).__name__
                raise ValueError(f"{n or 'the model'}.weight must be a 'masked' SparseTensor parameter, got {got}")
            lay = w.sparse_layout
            plain = nn.Parameter(lay.values.detach(), requires_grad=w.requires_grad)
            # the layout reads the trained values without a copy (the pruners rank them)
            w._layout = Masked(plain.data, lay.mask(), validate=False)
            seen[id(w)] = _Entry(m, w, plain, lay.mask())
            self.entries.append(seen[id(w)])
            m.weight = plain
        self._by_id = seen

    @property
    def sparse_params(self) -> List[SparseTensor]:
        return [e.sparse for e in self.entries]

    @torch.no_grad()
    def mask_grads(self) -> None:
        for e in self.entries:
            if e.plain.grad is not None:
                e.plain.grad.mul_(e.keep)

    @torch.no_grad()
    def mask_weights(self) -> None:
        for e in self.entries:
            e.plain.mul_(e.keep)

    @torch.no_grad()
    def pattern_changed(self, sparse: SparseTensor, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """``sparse`` (one of :attr:`sparse_params`) holds a new pattern: take its values and mask."""
        e = self._by_id.get(id(sparse))
        if e is None:
            raise ValueError("sparse is not one of this PlainMaskedWeights' sparse_params")
        lay = e.sparse.sparse_layout
        e.plain.data.copy_(lay.to_dense())
        e.sparse._layout = Masked(e.plain.data, lay.mask(), validate=False)
        e.keep = lay.mask().contiguous().view(torch.uint8)
        reset_optimizer_state(optimizer, e.plain, ~lay.mask())

    def restore(self) -> None:
        """Put the sparse parameters back in their modules (idempotent)."""
        for e in self.entries:
            for m in e.modules:
                m.weight = e.sparse
