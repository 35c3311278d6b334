"""Direct, cheap conversions between layouts, registered in the conversion graph.

``sparsa.layouts.convert`` finds the cheapest path through these edges (e.g. COO -> CSR -> BSR) and
otherwise goes through dense. Costs are relative: index-only rewrites are cheaper than building a
dense tensor.

>>> import torch
>>> from sparsa.layouts import COO, BSR, convert
>>> x = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
>>> torch.equal(convert(COO.from_dense(x), BSR).to_dense(), x)
True
"""

from __future__ import annotations

import torch

from ._padding import ceil_to
from .base import Layout, register_conversion
from .bsr import BSR
from .coo import COO
from .csr import CSR
from .grouped_nm import GroupedNM
from .masked import Masked
from .nm import NM


def coo_to_csr(x: COO) -> CSR:
    """COO (2-D) -> CSR; the coalesced COO order is already CSR order."""
    if len(x.shape) != 2:
        raise ValueError(f"COO -> CSR needs a 2-D tensor, got shape {tuple(x.shape)}")
    rows = x.shape[0]
    crow = torch.zeros(rows + 1, dtype=torch.int64, device=x.values.device)
    torch.cumsum(torch.bincount(x.indices[0], minlength=rows), 0, out=crow[1:])
    return CSR(crow, x.indices[1].clone(), x.values, x.shape, validate=False)


def csr_to_coo(x: CSR) -> COO:
    """CSR -> COO (2-D)."""
    return COO(torch.stack([x.row_indices(), x.col_indices]), x.values, x.shape, validate=False)


def csr_to_bsr(x: CSR, blocksize=(4, 4)) -> BSR:
    """CSR -> BSR with the default ``blocksize`` (index arithmetic only, no dense intermediate)."""
    bh, bw = blocksize
    dev = x.values.device
    br, bc = ceil_to(x.shape[0], bh) // bh, ceil_to(x.shape[1], bw) // bw
    rows, cols = x.row_indices(), x.col_indices
    block_id = (rows // bh) * bc + cols // bw
    kept, inverse = torch.unique(block_id, sorted=True, return_inverse=True)
    nb = kept.numel()
    vals = torch.zeros(nb, bh, bw, dtype=x.dtype, device=dev)
    bmask = torch.zeros(nb, bh, bw, dtype=torch.bool, device=dev)
    vals[inverse, rows % bh, cols % bw] = x.values
    bmask[inverse, rows % bh, cols % bw] = True
    crow = torch.zeros(br + 1, dtype=torch.int64, device=dev)
    torch.cumsum(torch.bincount(kept // bc, minlength=br), 0, out=crow[1:])
    return BSR(crow, (kept % bc).contiguous(), vals, bmask, x.shape, (bh, bw), validate=False)


def to_masked(x: Layout) -> Masked:
    """Any layout -> Masked (keeps the exact stored pattern, explicit zeros included)."""
    return Masked(x.to_dense(), x.mask(), validate=False)


register_conversion(COO, CSR, coo_to_csr, cost=0.5)
register_conversion(CSR, COO, csr_to_coo, cost=0.5)
register_conversion(CSR, BSR, csr_to_bsr, cost=1.0)
for _cls in (COO, CSR, BSR, NM, GroupedNM):
    register_conversion(_cls, Masked, to_masked, cost=1.0)
