"""The N:M layout: ``n`` of every ``m`` consecutive values along the last dim are stored.

For a Linear weight ``(out, in)`` the last dim is the reduction dim, which is what N:M kernels need.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple

import torch
from torch import Tensor

from ._padding import ceil_to, check_int_tensor, check_mask, check_ndim, check_nm, check_values, pad_dims
from .base import Layout, check_float, register_layout

__all__ = ["NM", "nm_mask"]


def _index_dtype(m: int) -> torch.dtype:
    return torch.uint8 if m <= 256 else torch.int16


def _groups(t: Tensor, m: int, fill: float) -> Tensor:
    """(*lead, K) -> (*lead, G, m), padding K up to G*m with ``fill``."""
    k = t.shape[-1]
    kp = ceil_to(k, m)
    return pad_dims(t, (kp,), fill).reshape(tuple(t.shape[:-1]) + (kp // m, m))


def _top_n_positions(score: Tensor, n: int) -> Tensor:
    """Positions (int64, ascending) of the ``n`` largest scores per group; ties -> lower position."""
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :n]
    return order.sort(dim=-1).values


def _select(dense: Tensor, n: int, m: int) -> Tensor:
    """Chosen positions per group for the magnitude rule; padding is chosen only if it must be."""
    score = _groups(dense.detach().abs(), m, -1.0)
    score = torch.nan_to_num(score, nan=float("inf"))
    return _top_n_positions(score, n)


def nm_mask(dense: Tensor, n: int, m: int) -> Tensor:
    """Boolean mask keeping the ``n`` largest-magnitude values of every ``m`` consecutive ones along
    the last dim (a last group shorter than ``m`` keeps at most ``n``).

    >>> import torch
    >>> nm_mask(torch.tensor([[1.0, -4.0, 3.0, 2.0, 5.0]]), 2, 4).tolist()
    [[False, True, True, False, True]]
    """
    check_nm(n, m, "nm_mask")
    check_float(dense, "dense")
    check_ndim(dense, "nm_mask")
    pos = _select(dense, n, m)
    k = dense.shape[-1]
    g = torch.zeros(pos.shape[:-1] + (m,), dtype=torch.bool, device=dense.device)
    g.scatter_(-1, pos, True)
    return g.reshape(tuple(dense.shape[:-1]) + (g.shape[-2] * m,))[..., :k]


@register_layout
class NM(Layout):
    """N:M structured sparsity along the last dim, any ``ndim >= 1``.

    Components: ``values`` (``*lead, G, n``) and ``indices`` (uint8, or int16 when ``m > 256``;
    ``*lead, G, n``), the ascending positions inside each group of ``m``, with ``G = ceil(K / m)``.
    A last dim that is not a multiple of ``m`` is padded internally.

    Without ``mask`` the ``n`` largest magnitudes per group are kept. A ``mask`` with more than ``n``
    kept in a group is rejected; one with fewer is filled up with other positions that store zero, and
    :meth:`mask` then reports all ``n`` stored positions per group (a superset of the given mask; the
    extra positions hold zeros, so :meth:`to_dense` still equals ``dense * mask``).

    >>> import torch
    >>> from sparsa.layouts import NM
    >>> w = NM.from_dense(torch.tensor([[1.0, -4.0, 3.0, 2.0]]), n=2, m=4)
    >>> w.indices.tolist(), w.values.tolist()
    ([[[1, 2]]], [[[-4.0, 3.0]]])
    """

    name = "nm"

    def __init__(self, values: Tensor, indices: Tensor, shape: Iterable[int], n: int, m: int, validate: bool = True):
        self.values = values
        self.indices = indices
        self.shape = torch.Size(shape)
        self.dtype = values.dtype
        self.n, self.m = check_nm(n, m, "NM")
        self._cache: Dict[str, Any] = {}
        if validate:
            self.validate()

    @property
    def num_groups(self) -> int:
        return ceil_to(self.shape[-1], self.m) // self.m

    @classmethod
    def from_dense(cls, dense: Tensor, mask: Optional[Tensor] = None, n: int = 2, m: int = 4, **params: Any) -> "NM":
        if params:
            raise TypeError(f"NM takes only n and m, got {sorted(params)}")
        n, m = check_nm(n, m, "NM")
        check_float(dense, "dense")
        check_ndim(dense, "NM")
        mask = check_mask(mask, dense, "NM")
        if mask is None:
            pos = _select(dense, n, m)
            vals = _groups(dense, m, 0.0).gather(-1, pos)
        else:
            gm = _groups(mask, m, False)
            counts = gm.sum(-1)
            if bool((counts > n).any()):
                bad = tuple((counts > n).nonzero()[0].tolist())
                raise ValueError(
                    f"NM: mask keeps {int(counts[bad])} values in group {bad} (index over (*lead, group); the "
                    f"group covers last-dim positions {bad[-1] * m}..{bad[-1] * m + m - 1}), more than n={n} of "
                    f"every m={m}; use sparsa.sparsifiers.NM(n={n}, m={m}) or nm_mask() to make a "
                    "valid mask"
                )
            # kept positions first, then real (non-padding) positions, then lower positions
            real = _groups(torch.ones_like(mask), m, False)
            pos = _top_n_positions(gm.to(torch.int8) * 2 + real.to(torch.int8), n)
            keep = gm.gather(-1, pos)
            vals = _groups(dense, m, 0.0).gather(-1, pos)
            vals = torch.where(keep, vals, torch.zeros((), dtype=vals.dtype, device=vals.device))
        return cls(vals.contiguous(), pos.to(_index_dtype(m)), dense.shape, n, m, validate=False)

    def _positions(self) -> Tensor:
        """Absolute (padded) last-dim position of every stored value, int64 ``(*lead, G, n)``."""
        p = self._cache.get("pos")
        if p is None:
            base = torch.arange(self.num_groups, device=self.indices.device)[:, None] * self.m
            p = self._cache["pos"] = self.indices.long() + base
        return p

    def bitmask_rows(self) -> Tuple[Tensor, Tensor]:
        """``(bits, row_ptr)`` of a 2-D weight in the Bitmask layout's terms: one bit per column of each
        row (``ceil(K / 8)`` bytes a row, :func:`~sparsa.layouts.bitmask.pack_bits`) and every row's
        offset into the row-major stored values, padding positions past ``K`` excluded. They depend on
        ``indices`` only, so they are built once and cached."""
        from .bitmask import pack_bits

        if len(self.shape) != 2:
            raise ValueError(f"linear: an N:M weight must be 2-D (out, in), got shape {tuple(self.shape)}")
        cached = self._cache.get("bitmask_rows")
        if cached is None:
            R, K = self.shape
            pos = self._positions().reshape(R, -1)
            mask = torch.zeros(R, K + self.m, dtype=torch.bool, device=pos.device)
            mask.scatter_(1, pos, True)  # padding positions land past K and are cut off below
            per_row = pos.shape[1] if K % self.m == 0 else int((pos[0] < K).sum()) if R else 0
            row_ptr = torch.arange(R + 1, dtype=torch.int64, device=pos.device) * per_row
            cached = self._cache["bitmask_rows"] = (pack_bits(mask[:, :K].contiguous()), row_ptr)
        return cached

    def derived_components(self) -> Dict[str, Tensor]:
        if len(self.shape) != 2:
            return {}
        bits, row_ptr = self.bitmask_rows()
        return {"bitmask_bits": bits, "bitmask_row_ptr": row_ptr}

    def adopt_derived(self, derived: Dict[str, Tensor]) -> None:
        if not derived and len(self.shape) != 2:
            return
        if set(derived) != {"bitmask_bits", "bitmask_row_ptr"}:
            raise TypeError(f"NM derives bitmask_bits and bitmask_row_ptr, got {sorted(derived)}")
        self._cache["bitmask_rows"] = (derived["bitmask_bits"], derived["bitmask_row_ptr"])

    def _scatter(self, src: Tensor) -> Tensor:
        lead = tuple(self.shape[:-1])
        g = self.num_groups
        out = torch.zeros(lead + (g, self.m), dtype=src.dtype, device=src.device)
        out.scatter_(-1, self.indices.long(), src)
        return out.reshape(lead + (g * self.m,))[..., : self.shape[-1]]

    def to_dense(self) -> Tensor:
        return self._scatter(self.values).contiguous()

    def mask(self) -> Tensor:
        return self._scatter(torch.ones_like(self.values, dtype=torch.bool)).contiguous()

    @property
    def nnz(self) -> int:
        return int((self._positions() < self.shape[-1]).sum())

    def params(self) -> Dict[str, Any]:
        return {"n": self.n, "m": self.m}

    def components(self) -> Dict[str, Tensor]:
        return {"values": self.values, "indices": self.indices}

    @classmethod
    def from_components(
        cls, components: Dict[str, Tensor], shape: Iterable[int], n: int = 2, m: int = 4, **params: Any
    ) -> "NM":
        if params:
            raise TypeError(f"NM takes only n and m, got {sorted(params)}")
        return cls(components["values"], components["indices"], shape, n, m)

    def refill(self, dense: Tensor) -> "NM":
        vals = _groups(dense.to(self.dtype), self.m, 0.0).gather(-1, self.indices.long())
        out = NM(vals, self.indices, self.shape, self.n, self.m, validate=False)
        out._cache = {k: v for k, v in self._cache.items() if k in ("pos", "bitmask_rows")}  # pattern-only
        return out

    def validate(self) -> None:
        if len(self.shape) < 1:
            raise ValueError("NM: shape must have at least one dim")
        expect: Tuple[int, ...] = tuple(self.shape[:-1]) + (self.num_groups, self.n)
        check_values(self.values, "values", "NM", expect)
        check_int_tensor(self.indices, "indices", "NM", (torch.uint8, torch.int16))
        if tuple(self.indices.shape) != expect:
            raise ValueError(f"NM: component 'indices' has shape {tuple(self.indices.shape)}, expected {expect}")
        if self.indices.numel() == 0:
            return
        idx = self.indices.long()
        if bool((idx < 0).any()) or bool((idx >= self.m).any()):
            raise ValueError(
                f"NM: component 'indices' must be positions in [0, m={self.m}), got min "
                f"{int(idx.min())}, max {int(idx.max())}"
            )
        if self.n > 1 and bool((idx[..., 1:] <= idx[..., :-1]).any()):
            raise ValueError("NM: component 'indices' must be strictly increasing within each group")
        k = self.shape[-1]
        if k % self.m:
            outside = self._positions() >= k
            if bool((self.values[outside] != 0).any()):
                raise ValueError(f"NM: component 'values' is nonzero in the padding beyond the last dim ({k})")
