"""The hook objects :func:`sparsa.sparsify` installs (small picklable callables, so models with them
survive ``copy.deepcopy``)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple, Type

import torch
from torch import Tensor, nn

from ..layouts.base import Layout
from ..sparsifiers.base import Sparsifier
from ..tensor import SparseTensor, to_sparse

__all__ = ["OutputSparsifier", "GradLayout"]


class OutputSparsifier:
    """Forward hook: replaces a module's tensor output with ``to_sparse(out, layout, sparsifier=...)``
    (differentiable). Remembers the last output's shape/sparsity/bytes for :func:`sparsity_report`."""

    def __init__(self, layout: Type[Layout], sparsifier: Optional[Sparsifier], params: Dict[str, Any]):
        self.layout, self.sparsifier, self.params = layout, sparsifier, dict(params)
        self.last: Optional[Tuple[Tuple[int, ...], float, int, int]] = None  # shape, sparsity, nbytes, dense

    def __call__(self, module: nn.Module, inputs: Any, output: Any) -> Any:
        if not isinstance(output, Tensor):
            raise TypeError(
                f"sparsa output rule on {type(module).__name__}: the module returned "
                f"{type(output).__name__}, only a single tensor output can be sparsified"
            )
        sp = to_sparse(output, self.layout, sparsifier=self.sparsifier, **self.params)
        lay = sp.sparse_layout
        self.last = (tuple(lay.shape), lay.sparsity, lay.nbytes, lay.numel * output.element_size())
        return sp

    def __repr__(self) -> str:
        return f"OutputSparsifier(layout={self.layout.name!r}, sparsifier={self.sparsifier!r})"


class GradLayout:
    """Post-accumulate-grad hook: stores a sparse parameter's ``.grad`` in ``layout``, restricted to the
    parameter's pattern (optimizers then update only the stored positions)."""

    def __init__(self, layout: Type[Layout], params: Dict[str, Any]):
        self.layout, self.params = layout, dict(params)

    def __call__(self, p: Tensor) -> None:
        g = p.grad
        if g is None:
            return
        if isinstance(g, SparseTensor):
            if type(g.sparse_layout) is self.layout:
                return
            g = g.sparse_layout.to_dense()
        mask = p.pattern() if isinstance(p, SparseTensor) else None
        with torch.no_grad():
            p.grad = to_sparse(g.detach(), self.layout, mask=mask, **self.params)

    def __repr__(self) -> str:
        return f"GradLayout(layout={self.layout.name!r})"
