"""The data half of :class:`~sparsa.SparseTensor`: a wrapper tensor that holds a sparsa layout.

The dispatcher (:mod:`sparsa.ops`) needs to recognise and read sparse tensors, and
:class:`~sparsa.SparseTensor` needs the dispatcher for its ``__torch_function__`` and
``__torch_dispatch__``. This module is the piece both share, below both: :mod:`sparsa.tensor` defines
the subclass with the hooks and imports the dispatcher; the dispatcher imports only this module and
builds its outputs with the class it was called through.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ContextManager, Optional

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_map

from .layouts.base import Layout

__all__ = ["SparseTensorBase", "inner_properties", "normal_layout", "outside_inference_mode", "unwrap_dense"]


def outside_inference_mode() -> ContextManager:
    """Where ``torch.inference_mode`` is on, a context that turns it off, else a no-op. Sparse weights built
    there stay normal tensors: an inference tensor has no version counter, so the kernels' caches keyed on
    one (an AMX tile pack, a float32 bias) would be rebuilt on every call."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else nullcontext()


def normal_layout(layout: Layout) -> Layout:
    """``layout`` with any inference-tensor component (e.g. a view of an inference tensor) replaced by a
    normal copy, for the reason :func:`outside_inference_mode` gives; the layout itself when it has none."""
    if not any(t.is_inference() for t in layout.components().values()):
        return layout
    with torch.inference_mode(False):
        return layout.map_tensors(lambda t: t.clone() if t.is_inference() else t)


class SparseTensorBase(Tensor):
    """The data half of :class:`sparsa.SparseTensor`: a wrapper tensor holding a sparsa
    :class:`~sparsa.layouts.base.Layout`. Never built directly: only :class:`sparsa.SparseTensor`, which adds
    the dispatch hooks, is instantiated.

    Attributes:
        inline_sparsifier: optional sparsifier re-applied after every in-place update
            (e.g. an optimizer step); by default the stored pattern is kept exactly.
    """

    _layout: Layout
    inline_sparsifier: Any

    @staticmethod
    def __new__(cls, layout: Layout, requires_grad: bool = False):
        if not isinstance(layout, Layout):
            raise TypeError(
                f"SparseTensor expects a sparsa Layout instance, got {type(layout).__name__}; "
                "use sparsa.to_sparse(tensor, layout_cls) to build one from a dense tensor"
            )
        if (cls, type(layout)) not in _INNER_DEFINED:
            inner_properties(cls, [f"_c_{n}" for n in layout.components()])
            _INNER_DEFINED.add((cls, type(layout)))
        t = Tensor._make_wrapper_subclass(
            cls, layout.shape, dtype=layout.dtype, device=layout.device, requires_grad=requires_grad
        )
        t._layout = layout
        t.inline_sparsifier = None
        return t

    def __init__(self, layout: Layout, requires_grad: bool = False):  # noqa: D401 - see __new__
        pass

    # ---------------------------------------------------------------- inspection
    @property
    def sparse_layout(self) -> Layout:
        """The layout instance holding the data."""
        return self._layout

    @property
    def layout_name(self) -> str:
        return type(self._layout).name

    @property
    def nnz(self) -> int:
        return self._layout.nnz

    @property
    def density(self) -> float:
        return self._layout.density

    @property
    def sparsity(self) -> float:
        return self._layout.sparsity

    @property
    def nbytes_sparse(self) -> int:
        """Bytes of the stored components (``Tensor.nbytes`` stays the dense size)."""
        return self._layout.nbytes

    def pattern(self) -> Tensor:
        """Boolean mask of the stored positions."""
        return self._layout.mask()

    def to_dense(self, dtype: Optional[torch.dtype] = None, *, masked_grad: Optional[bool] = None) -> Tensor:
        """Differentiable conversion to a plain tensor."""
        out = _ToDense.apply(self)
        return out if dtype is None else out.to(dtype)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        lay = self._layout
        grad = ", requires_grad=True" if self.requires_grad else ""
        params = "".join(f", {k}={v}" for k, v in lay.params().items())
        # under torch.compile the components are fake: counting stored values would guard on their data
        fake = any(is_fake(t) for t in lay.components().values())
        counts = "" if fake else f", nnz={lay.nnz}, density={lay.density:.4f}"
        return (
            f"SparseTensor(layout={type(lay).name}, shape={tuple(lay.shape)}, dtype={lay.dtype}, "
            f"device={lay.device}{counts}{params}{grad})"
        )


class _ToDense(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sp: SparseTensorBase) -> Tensor:  # type: ignore[override]
        return sp._layout.to_dense()

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        return g


def unwrap_dense(x: Any) -> Any:
    """Tree-map helper: SparseTensor -> its dense tensor (not differentiable; for aten level)."""
    return tree_map(lambda a: a._layout.to_dense() if isinstance(a, SparseTensorBase) else a, x)


#: (tensor class, layout class) pairs whose component properties exist
_INNER_DEFINED: set = set()


def inner_properties(cls: type, names) -> None:
    """Define ``cls.<name>`` for each inner tensor name of ``__tensor_flatten__`` (``_c_<component>`` or
    ``_d_<derived>``) it lacks. Class properties, not a ``__getattr__`` fallback: ``torch.compile``'s guards
    ask ``hasattr`` of every graph input for attributes it has not got, and a Python ``__getattr__`` that
    raises made each such check cost a sparse weight about 0.8 us, five times a call."""
    for name in names:
        if isinstance(cls.__dict__.get(name), property):
            continue
        key = name[3:]
        if name.startswith("_c_"):
            prop = property(lambda self, key=key: self._layout.components()[key])
        else:
            prop = property(lambda self, key=key: self._layout.derived_components()[key])
        setattr(cls, name, prop)
