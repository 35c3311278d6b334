"""The Bitmask layout: any 2-D sparsity pattern, stored in few bytes for memory-bound decoding.

Each row keeps one bit per input column (set = kept) and its kept values packed in column order.
At 50% density a float32 weight takes 0.53x its dense bytes (bf16: 0.56x), whatever the pattern
(unstructured, N:M, anything a sparsifier chooses). LLM decoding reads every weight once per token,
so fewer bytes read is directly a faster token.

Components:
    ``bits``    uint8 ``(R, ceil(K/8))`` -- bit ``j % 8`` of byte ``j // 8`` of row ``r`` is set when
    column ``j`` is kept; bits past column ``K`` are zero;
    ``row_ptr`` int64 ``(R + 1,)`` -- row ``r``'s values are ``values[row_ptr[r]:row_ptr[r+1]]``;
    ``values``  float ``(nnz,)`` -- kept values, row-major, in increasing column order.

Example::

    >>> import torch
    >>> from sparsa.layouts import Bitmask
    >>> w = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 3.0]])
    >>> b = Bitmask.from_dense(w)
    >>> b.bits.tolist(), b.row_ptr.tolist(), b.values.tolist()
    ([[2], [5]], [0, 1, 3], [1.0, 2.0, 3.0])
    >>> torch.equal(b.to_dense(), w)
    True
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional

import torch
from torch import Tensor

from .base import Layout, check_float, check_fraction, register_layout
from .row_group import _has_data

__all__ = ["Bitmask", "pack_bits", "unpack_bits"]


def _bit_weights(device: torch.device) -> Tensor:
    # made per call: a module-level tensor would be a real tensor inside fake-tensor tracing
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


def pack_bits(mask: Tensor) -> Tensor:
    """uint8 ``(R, ceil(K/8))`` bit rows of a bool ``(R, K)`` mask (bit ``j % 8`` of byte ``j // 8``)."""
    R, K = mask.shape
    kb = -(-K // 8)
    m = torch.nn.functional.pad(mask.to(torch.uint8), (0, 8 * kb - K))
    return (m.view(R, kb, 8) * _bit_weights(m.device)).sum(-1, dtype=torch.uint8)


def unpack_bits(bits: Tensor, K: int) -> Tensor:
    """The bool ``(R, K)`` mask of :func:`pack_bits` output."""
    R, kb = bits.shape
    m = (bits[:, :, None] & _bit_weights(bits.device)) != 0
    return m.view(R, 8 * kb)[:, :K]


def _kept_mask(dense: Tensor, mask: Optional[Tensor], sparsity: Optional[float]) -> Tensor:
    if mask is not None:
        if sparsity is not None:
            raise ValueError("pass either mask= or sparsity= to Bitmask.from_dense, not both")
        if not isinstance(mask, Tensor) or mask.shape != dense.shape:
            got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(f"mask must be a bool tensor of shape {tuple(dense.shape)}, got {got}")
        return mask.to(torch.bool)
    if sparsity is None:
        return dense != 0
    # the largest magnitudes of every row: balanced rows keep the decode kernel's threads even
    s = check_fraction(sparsity, "sparsity")
    R, K = dense.shape
    keep = int(round(K * (1.0 - s)))
    out = torch.zeros(R, K, dtype=torch.bool, device=dense.device)
    if keep:
        out.scatter_(1, dense.detach().abs().topk(keep, dim=1, sorted=False).indices, True)
    return out


@register_layout
class Bitmask(Layout):
    """Per-row bitmask plus packed values (see the module docstring).

    Build with :meth:`from_dense` (keeps the nonzeros, an explicit ``mask``, or with ``sparsity=`` the
    largest magnitudes of each row), or :func:`sparsa.to_sparse` ``(w, "bitmask", sparsity=0.5)``.
    """

    name = "bitmask"

    def __init__(self, bits: Tensor, row_ptr: Tensor, values: Tensor, shape: Iterable[int], validate: bool = True):
        self.bits = bits
        self.row_ptr = row_ptr
        self.values = values
        self.shape = torch.Size(shape)
        self.dtype = values.dtype
        if validate:
            self.validate()

    @classmethod
    def from_dense(
        cls, dense: Tensor, mask: Optional[Tensor] = None, sparsity: Optional[float] = None, **params: Any
    ) -> "Bitmask":
        if params:
            raise TypeError(f"Bitmask takes mask= or sparsity=, got unexpected {sorted(params)}")
        check_float(dense, "dense")
        if dense.dim() != 2:
            raise ValueError(
                f"Bitmask stores 2-D weights (out_features, in_features); dense has shape "
                f"{tuple(dense.shape)}; reshape it to 2-D first"
            )
        kept = _kept_mask(dense, mask, sparsity)
        row_ptr = torch.zeros(dense.shape[0] + 1, dtype=torch.int64, device=dense.device)
        torch.cumsum(kept.sum(1), 0, out=row_ptr[1:])
        values = dense.detach()[kept].contiguous()  # boolean indexing is row-major: the packing order
        return cls(pack_bits(kept), row_ptr, values, dense.shape, validate=False)

    def mask(self) -> Tensor:
        return unpack_bits(self.bits, self.shape[1])

    def to_dense(self) -> Tensor:
        out = self.values.new_zeros(self.shape)
        out[self.mask()] = self.values
        return out

    @property
    def nnz(self) -> int:
        return int(self.row_ptr[-1]) if self.row_ptr.numel() else 0

    def refill(self, dense: Tensor) -> "Bitmask":
        values = dense.to(self.dtype)[self.mask()].contiguous()
        return Bitmask(self.bits, self.row_ptr, values, self.shape, validate=False)

    # ------------------------------------------------------------------ protocol
    def components(self) -> Dict[str, Tensor]:
        return {"bits": self.bits, "row_ptr": self.row_ptr, "values": self.values}

    @classmethod
    def from_components(cls, components: Dict[str, Tensor], shape: Iterable[int], **params: Any) -> "Bitmask":
        if params:
            raise TypeError(f"Bitmask has no parameters, got {sorted(params)}")
        c = components
        return cls(c["bits"], c["row_ptr"], c["values"], shape)

    def validate(self) -> None:
        if len(self.shape) != 2:
            raise ValueError(f"Bitmask: shape must be 2-D, got {tuple(self.shape)}")
        R, K = self.shape
        b, p, v = self.bits, self.row_ptr, self.values
        kb = -(-K // 8)
        if b.dtype != torch.uint8 or tuple(b.shape) != (R, kb):
            raise ValueError(f"Bitmask: bits must be uint8 of shape ({R}, {kb}), got {b.dtype} {tuple(b.shape)}")
        if p.dtype != torch.int64 or tuple(p.shape) != (R + 1,):
            raise ValueError(f"Bitmask: row_ptr must be int64 of shape ({R + 1},), got {p.dtype} {tuple(p.shape)}")
        if not v.dtype.is_floating_point or v.dim() != 1:
            raise ValueError(f"Bitmask: values must be a 1-D float tensor, got {v.dtype} {tuple(v.shape)}")
        if not _has_data(p):
            return
        if int(p[0]) != 0 or int(p[-1]) != v.numel() or bool((p.diff() < 0).any()):
            raise ValueError(f"Bitmask: row_ptr must start at 0, not decrease, and end at len(values)={v.numel()}")
        if K % 8 and kb and bool((b[:, -1] >> (K % 8)).any()):
            raise ValueError(f"Bitmask: bits past column {K} must be zero")
        if not torch.equal(self.mask().sum(1), p.diff()):
            raise ValueError("Bitmask: the set bits of each row must equal its number of values (row_ptr diff)")
