"""The SlicedELL layout: unstructured sparsity for sparse (75-99%) weights.

Each row keeps its own sorted list of input columns. Rows are stored in slices of two (rows ``2s``
and ``2s+1``), padded to the longer row's length, with the two rows' entries interleaved; this is
what the native kernel needs to process two rows at once over a vector of tokens.

Components:
    ``slice_ptr`` int64 ``(ceil(R/2) + 1,)`` -- slice ``s`` occupies entries ``[slice_ptr[s], slice_ptr[s+1])``;
    ``columns``   int32 ``(P,)``, ``values`` float ``(P,)`` -- slot ``j`` of row ``2s + i`` is entry
    ``slice_ptr[s] + 2*j + i``; padding entries hold column 0 and value 0;
    ``row_nnz``   int32 ``(R,)`` -- kept entries per row (the rest of the slice is padding).

Example::

    >>> import torch
    >>> from sparsa.layouts import SlicedELL
    >>> w = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 3.0], [0.0, 0.0, 4.0]])
    >>> e = SlicedELL.from_dense(w)
    >>> e.nnz, e.row_nnz.tolist(), e.slice_ptr.tolist()
    (4, [1, 2, 1], [0, 4, 6])
    >>> torch.equal(e.to_dense(), w)
    True
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple

import torch
from torch import Tensor

from .base import Layout, check_float, check_fraction, register_layout
from .row_group import _has_data

__all__ = ["SlicedELL"]

#: rows per slice (fixed: the kernel processes two rows at a time)
SLICE = 2


def _kept_mask(dense: Tensor, mask: Optional[Tensor], sparsity: Optional[float]) -> Tensor:
    if mask is not None:
        if sparsity is not None:
            raise ValueError("pass either mask= or sparsity= to SlicedELL.from_dense, not both")
        if not isinstance(mask, Tensor) or mask.shape != dense.shape:
            got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(f"mask must be a bool tensor of shape {tuple(dense.shape)}, got {got}")
        return mask.to(torch.bool)
    if sparsity is None:
        return dense != 0
    s = check_fraction(sparsity, "sparsity")
    keep = int(round(dense.numel() * (1.0 - s)))
    out = torch.zeros(dense.numel(), dtype=torch.bool, device=dense.device)
    if keep:
        out[dense.detach().abs().flatten().topk(keep, sorted=False).indices] = True
    return out.view(dense.shape)


@register_layout
class SlicedELL(Layout):
    """Per-row kept columns in two-row slices (see the module docstring).

    Build with :meth:`from_dense` (keeps the nonzeros, an explicit ``mask``, or the largest
    magnitudes with ``sparsity=``), or :func:`sparsa.to_sparse` ``(w, "sliced_ell", sparsity=0.95)``.
    """

    name = "sliced_ell"

    def __init__(
        self,
        slice_ptr: Tensor,
        columns: Tensor,
        values: Tensor,
        row_nnz: Tensor,
        shape: Iterable[int],
        validate: bool = True,
    ):
        self.slice_ptr = slice_ptr
        self.columns = columns
        self.values = values
        self.row_nnz = row_nnz
        self.shape = torch.Size(shape)
        self.dtype = values.dtype
        if validate:
            self.validate()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dense(
        cls, dense: Tensor, mask: Optional[Tensor] = None, sparsity: Optional[float] = None, **params: Any
    ) -> "SlicedELL":
        if params:
            raise TypeError(f"SlicedELL takes sparsity=, got unexpected {sorted(params)}")
        check_float(dense, "dense")
        if dense.dim() != 2:
            raise ValueError(
                f"SlicedELL stores 2-D weights (out_features, in_features); dense has shape "
                f"{tuple(dense.shape)}; reshape it to 2-D first"
            )
        kept = _kept_mask(dense, mask, sparsity)
        R, K = dense.shape
        row_nnz = kept.sum(1)
        padded = torch.cat([row_nnz, row_nnz.new_zeros(R % SLICE)]) if R % SLICE else row_nnz
        length = padded.view(-1, SLICE).amax(1)
        slice_ptr = torch.zeros(length.numel() + 1, dtype=torch.int64, device=dense.device)
        torch.cumsum(length * SLICE, 0, out=slice_ptr[1:])
        P = int(slice_ptr[-1])
        rows, cols = kept.nonzero(as_tuple=True)
        offsets = _entry_offsets(slice_ptr, row_nnz, rows)
        columns = torch.zeros(P, dtype=torch.int32, device=dense.device)
        values = torch.zeros(P, dtype=dense.dtype, device=dense.device)
        columns[offsets] = cols.to(torch.int32)
        values[offsets] = dense[rows, cols]
        return cls(slice_ptr, columns, values, row_nnz.to(torch.int32), dense.shape, validate=False)

    def _entries(self) -> Tuple[Tensor, Tensor, Tensor]:
        """(row, column, offset) of every kept entry, row-major."""
        nnz = self.row_nnz.long()
        ends = torch.cumsum(nnz, 0)
        total = int(ends[-1]) if nnz.numel() else 0
        rows = torch.searchsorted(ends, torch.arange(total, device=nnz.device), right=True)
        offsets = _entry_offsets(self.slice_ptr, nnz, rows)
        return rows, self.columns[offsets].long(), offsets

    def to_dense(self) -> Tensor:
        rows, cols, offsets = self._entries()
        out = self.values.new_zeros(self.shape)
        out[rows, cols] = self.values[offsets]
        return out

    def mask(self) -> Tensor:
        rows, cols, _ = self._entries()
        out = torch.zeros(self.shape, dtype=torch.bool, device=self.values.device)
        out[rows, cols] = True
        return out

    @property
    def nnz(self) -> int:
        return int(self.row_nnz.sum())

    def refill(self, dense: Tensor) -> "SlicedELL":
        rows, cols, offsets = self._entries()
        values = torch.zeros_like(self.values)
        values[offsets] = dense.to(self.dtype)[rows, cols]
        return SlicedELL(self.slice_ptr, self.columns, values, self.row_nnz, self.shape, validate=False)

    # ------------------------------------------------------------------ protocol
    def components(self) -> Dict[str, Tensor]:
        return {"slice_ptr": self.slice_ptr, "columns": self.columns, "values": self.values, "row_nnz": self.row_nnz}

    @classmethod
    def from_components(cls, components: Dict[str, Tensor], shape: Iterable[int], **params: Any) -> "SlicedELL":
        if params:
            raise TypeError(f"SlicedELL has no parameters, got {sorted(params)}")
        c = components
        return cls(c["slice_ptr"], c["columns"], c["values"], c["row_nnz"], shape)

    def validate(self) -> None:
        if len(self.shape) != 2:
            raise ValueError(f"SlicedELL: shape must be 2-D, got {tuple(self.shape)}")
        R, K = self.shape
        sp, c, v, n = self.slice_ptr, self.columns, self.values, self.row_nnz
        ns = -(-R // SLICE)
        if sp.dtype != torch.int64 or tuple(sp.shape) != (ns + 1,):
            raise ValueError(
                f"SlicedELL: slice_ptr must be int64 of shape ({ns + 1},), got {sp.dtype} {tuple(sp.shape)}"
            )
        if c.dtype != torch.int32 or c.dim() != 1:
            raise ValueError(f"SlicedELL: columns must be 1-D int32, got {c.dtype} {tuple(c.shape)}")
        if not v.dtype.is_floating_point or v.shape != c.shape:
            raise ValueError(
                f"SlicedELL: values must be float with the shape of columns {tuple(c.shape)}, got "
                f"{v.dtype} {tuple(v.shape)}"
            )
        if n.dtype != torch.int32 or tuple(n.shape) != (R,):
            raise ValueError(f"SlicedELL: row_nnz must be int32 of shape ({R},), got {n.dtype} {tuple(n.shape)}")
        if not _has_data(sp):
            return
        d = sp.diff()
        if int(sp[0]) != 0 or int(sp[-1]) != c.numel() or bool((d < 0).any()) or bool((d % SLICE != 0).any()):
            raise ValueError(
                f"SlicedELL: slice_ptr must start at 0, end at len(columns)={c.numel()} and grow by "
                f"multiples of {SLICE}"
            )
        padded = torch.cat([n, n.new_zeros(R % SLICE)]) if R % SLICE else n
        if bool((padded < 0).any()) or bool((padded.view(-1, SLICE).amax(1).long() * SLICE > d).any()):
            raise ValueError("SlicedELL: row_nnz exceeds the length of its slice")
        if c.numel() and (int(c.min()) < 0 or int(c.max()) >= K):
            raise ValueError(f"SlicedELL: columns must lie in [0, {K}), got range [{int(c.min())}, {int(c.max())}]")
        rows, cols, _ = self._entries()
        same = rows[1:] == rows[:-1]
        if bool((same & (cols[1:] <= cols[:-1])).any()):
            raise ValueError("SlicedELL: kept columns must be strictly increasing within each row")


def _entry_offsets(slice_ptr: Tensor, row_nnz: Tensor, rows: Tensor) -> Tensor:
    """Storage offset of each kept entry, given its row (entries sorted row-major)."""
    nnz = row_nnz.long()
    starts = torch.cumsum(nnz, 0) - nnz  # first entry index of each row
    pos = torch.arange(rows.numel(), device=rows.device) - starts[rows]
    return slice_ptr[rows // SLICE] + SLICE * pos + rows % SLICE
