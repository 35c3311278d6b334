"""The COO layout: coordinate list (``indices`` (ndim, nnz), ``values`` (nnz,)), coalesced."""

from __future__ import annotations

import warnings
from typing import Any, Dict, Iterable, Optional

import torch
from torch import Tensor

from ._padding import check_int_tensor, check_mask, check_ndim, check_values
from .base import Layout, check_float, register_layout


@register_layout
class COO(Layout):
    """Coordinate format for tensors of any ``ndim >= 1``.

    ``indices`` (int64, ``(ndim, nnz)``) are sorted lexicographically (row-major) with no duplicates
    (coalesced); ``values`` has shape ``(nnz,)``.

    >>> import torch
    >>> from sparsa.layouts import COO
    >>> c = COO.from_dense(torch.tensor([[0.0, 2.0], [3.0, 0.0]]))
    >>> c.indices.tolist(), c.values.tolist()
    ([[0, 1], [1, 0]], [2.0, 3.0])
    """

    name = "coo"

    def __init__(self, indices: Tensor, values: Tensor, shape: Iterable[int], validate: bool = True):
        self.indices = indices
        self.values = values
        self.shape = torch.Size(shape)
        self.dtype = values.dtype
        self._cache: Dict[str, Any] = {}
        if validate:
            self.validate()

    # ------------------------------------------------------------------ build / export
    @classmethod
    def from_dense(cls, dense: Tensor, mask: Optional[Tensor] = None, **params: Any) -> "COO":
        if params:
            raise TypeError(f"COO takes no parameters, got {sorted(params)}")
        check_float(dense, "dense")
        check_ndim(dense, "COO")
        mask = check_mask(mask, dense, "COO")
        if mask is None:
            mask = dense != 0
        idx = mask.nonzero().t().contiguous()  # nonzero() is row-major sorted
        return cls(idx, dense[mask], dense.shape, validate=False)

    def to_dense(self) -> Tensor:
        out = torch.zeros(self.shape, dtype=self.dtype, device=self.values.device)
        out[tuple(self.indices)] = self.values
        return out

    def mask(self) -> Tensor:
        out = torch.zeros(self.shape, dtype=torch.bool, device=self.values.device)
        out[tuple(self.indices)] = True
        return out

    @property
    def nnz(self) -> int:
        return self.values.numel()

    def components(self) -> Dict[str, Tensor]:
        return {"indices": self.indices, "values": self.values}

    @classmethod
    def from_components(cls, components: Dict[str, Tensor], shape: Iterable[int], **params: Any) -> "COO":
        if params:
            raise TypeError(f"COO takes no parameters, got {sorted(params)}")
        return cls(components["indices"], components["values"], shape)

    def refill(self, dense: Tensor) -> "COO":
        out = COO(self.indices, dense.to(self.dtype)[tuple(self.indices)], self.shape, validate=False)
        return out

    # ------------------------------------------------------------------ checks
    def linear_indices(self) -> Tensor:
        """Row-major flat index of every stored entry (int64, ``(nnz,)``)."""
        strides = torch.ones(len(self.shape), dtype=torch.int64, device=self.indices.device)
        for d in range(len(self.shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * self.shape[d + 1]
        return (self.indices * strides[:, None]).sum(0)

    def validate(self) -> None:
        nd = len(self.shape)
        if nd < 1:
            raise ValueError("COO: shape must have at least one dim")
        check_int_tensor(self.indices, "indices", "COO", (torch.int64,))
        if self.indices.dim() != 2 or self.indices.shape[0] != nd:
            raise ValueError(
                f"COO: component 'indices' must have shape (ndim={nd}, nnz), got {tuple(self.indices.shape)}"
            )
        nnz = self.indices.shape[1]
        check_values(self.values, "values", "COO", (nnz,))
        if nnz == 0:
            return
        hi = torch.tensor(list(self.shape), device=self.indices.device)[:, None]
        if bool((self.indices < 0).any()) or bool((self.indices >= hi).any()):
            raise ValueError(f"COO: component 'indices' has out-of-range entries for shape {tuple(self.shape)}")
        lin = self.linear_indices()
        if bool((lin[1:] <= lin[:-1]).any()):
            raise ValueError(
                "COO: component 'indices' must be sorted lexicographically without duplicates "
                "(coalesced); build it with COO.from_dense or coalesce it first"
            )

    # ------------------------------------------------------------------ torch interop
    def torch_coo(self) -> Tensor:
        """A cached ``torch.sparse_coo_tensor`` view of this layout (for torch.sparse matmuls)."""
        t = self._cache.get("torch_coo")
        if t is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t = torch.sparse_coo_tensor(self.indices, self.values, self.shape, is_coalesced=True)
            self._cache["torch_coo"] = t
        return t
