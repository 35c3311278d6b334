"""The CSR layout: compressed sparse rows for 2-D tensors."""

from __future__ import annotations

import warnings
from typing import Any, Dict, Iterable, Optional

import torch
from torch import Tensor

from ._padding import (
    check_crow,
    check_int_tensor,
    check_mask,
    check_ndim,
    check_sorted_cols,
    check_values,
    row_ids_from_crow,
)
from .base import Layout, check_float, register_layout


@register_layout
class CSR(Layout):
    """Compressed sparse rows: ``crow_indices`` (int64, rows+1), ``col_indices`` (int64, nnz; sorted
    within each row) and ``values`` (nnz,).

    >>> import torch
    >>> from sparsa.layouts import CSR
    >>> c = CSR.from_dense(torch.tensor([[0.0, 2.0], [3.0, 4.0]]))
    >>> c.crow_indices.tolist(), c.col_indices.tolist()
    ([0, 1, 3], [1, 0, 1])
    """

    name = "csr"

    def __init__(
        self, crow_indices: Tensor, col_indices: Tensor, values: Tensor, shape: Iterable[int], validate: bool = True
    ):
        self.crow_indices = crow_indices
        self.col_indices = col_indices
        self.values = values
        self.shape = torch.Size(shape)
        self.dtype = values.dtype
        self._cache: Dict[str, Any] = {}
        if validate:
            self.validate()

    @classmethod
    def from_dense(cls, dense: Tensor, mask: Optional[Tensor] = None, **params: Any) -> "CSR":
        if params:
            raise TypeError(f"CSR takes no parameters, got {sorted(params)}")
        check_float(dense, "dense")
        check_ndim(dense, "CSR", exact=2)
        mask = check_mask(mask, dense, "CSR")
        if mask is None:
            mask = dense != 0
        counts = mask.sum(1)
        crow = torch.zeros(dense.shape[0] + 1, dtype=torch.int64, device=dense.device)
        torch.cumsum(counts, 0, out=crow[1:])
        col = mask.nonzero()[:, 1].contiguous()
        return cls(crow, col, dense[mask], dense.shape, validate=False)

    def row_indices(self) -> Tensor:
        """Row index of every stored entry (int64, ``(nnz,)``); cached."""
        r = self._cache.get("rows")
        if r is None:
            r = self._cache["rows"] = row_ids_from_crow(self.crow_indices, self.col_indices.numel())
        return r

    def derived_components(self) -> Dict[str, Tensor]:
        # torch.compile takes the row ids as a graph input instead of expanding crow_indices on every call
        return {"row_indices": self.row_indices()}

    def adopt_derived(self, derived: Dict[str, Tensor]) -> None:
        if set(derived) != {"row_indices"}:
            raise TypeError(f"CSR derives row_indices, got {sorted(derived)}")
        self._cache["rows"] = derived["row_indices"]

    def to_dense(self) -> Tensor:
        out = torch.zeros(self.shape, dtype=self.dtype, device=self.values.device)
        out[self.row_indices(), self.col_indices] = self.values
        return out

    def mask(self) -> Tensor:
        out = torch.zeros(self.shape, dtype=torch.bool, device=self.values.device)
        out[self.row_indices(), self.col_indices] = True
        return out

    @property
    def nnz(self) -> int:
        return self.values.numel()

    def components(self) -> Dict[str, Tensor]:
        return {"crow_indices": self.crow_indices, "col_indices": self.col_indices, "values": self.values}

    @classmethod
    def from_components(cls, components: Dict[str, Tensor], shape: Iterable[int], **params: Any) -> "CSR":
        if params:
            raise TypeError(f"CSR takes no parameters, got {sorted(params)}")
        return cls(components["crow_indices"], components["col_indices"], components["values"], shape)

    def refill(self, dense: Tensor) -> "CSR":
        out = CSR(
            self.crow_indices,
            self.col_indices,
            dense.to(self.dtype)[self.row_indices(), self.col_indices],
            self.shape,
            validate=False,
        )
        out._cache["rows"] = self.row_indices()
        return out

    def validate(self) -> None:
        if len(self.shape) != 2:
            raise ValueError(f"CSR: shape must be 2-D, got {tuple(self.shape)}")
        rows, cols = self.shape
        check_int_tensor(self.col_indices, "col_indices", "CSR", (torch.int64,))
        if self.col_indices.dim() != 1:
            raise ValueError(f"CSR: component 'col_indices' must be 1-D, got shape {tuple(self.col_indices.shape)}")
        nnz = self.col_indices.numel()
        check_values(self.values, "values", "CSR", (nnz,))
        check_crow(self.crow_indices, rows, nnz, "CSR")
        check_sorted_cols(self.col_indices, self.row_indices(), cols, "CSR")

    # ------------------------------------------------------------------ torch interop
    def torch_csr(self) -> Tensor:
        """A cached ``torch.sparse_csr_tensor`` with this layout's data (for torch.sparse matmuls)."""
        t = self._cache.get("torch_csr")
        if t is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t = torch.sparse_csr_tensor(self.crow_indices, self.col_indices, self.values, self.shape)
            self._cache["torch_csr"] = t
        return t

    def torch_csr_t(self) -> Tensor:
        """A cached CSR ``torch`` tensor of the transpose (for ``W^T @ D``)."""
        t = self._cache.get("torch_csr_t")
        if t is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t = self.torch_csr().t().to_sparse_csr()
            self._cache["torch_csr_t"] = t
        return t
