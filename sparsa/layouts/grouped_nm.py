"""The grouped N:M layout (STen's format) for a 2-D weight ``W`` of shape ``(R, K)``.

Rows are cut into blocks of ``m`` consecutive rows (``R`` padded to ``R_pad = ceil(R/m)*m``, giving
``B = R_pad/m`` blocks). In a block every input column ``k`` keeps ``n`` of its ``m`` values; which ``n``
is one of the ``P = C(m, n)`` *patterns*, numbered in ``itertools.combinations(range(m), n)`` order.
Columns are cut into chunks of ``chunk = P*g`` (``K`` padded to ``K_pad = ceil(K/chunk)*chunk``, giving
``C`` chunks) and within a chunk every pattern is used by exactly ``g`` columns, so a kernel can
process ``g`` columns at a time with one fixed row pattern.

Components:

* ``values`` float ``(B, C, P, g, n)``: block ``b``, chunk ``c``, pattern ``p``, the ``j``-th column using
  ``p``: its ``n`` kept values in the pattern's row order;
* ``columns`` int32 ``(B, C, P, g)``: that column's index in the padded ``K`` (each column of chunk ``c``
  appears exactly once per block). Padded rows/columns hold zero values.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Dict, Iterable, Optional, Tuple

import torch
from torch import Tensor

from ._padding import ceil_to, check_int_tensor, check_mask, check_ndim, check_nm, check_values, pad_dims
from .base import Layout, check_float, register_layout

__all__ = ["GroupedNM", "grouped_nm_mask", "patterns"]


def patterns(n: int, m: int, device: Optional[torch.device] = None) -> Tensor:
    """The ``C(m, n)`` keep-patterns as an int64 ``(P, n)`` tensor, in ``itertools.combinations`` order.

    >>> patterns(1, 3).tolist()
    [[0], [1], [2]]
    """
    return torch.tensor(list(itertools.combinations(range(m), n)), dtype=torch.int64, device=device).reshape(-1, n)


def _check_g(g: Any) -> int:
    if isinstance(g, bool) or not isinstance(g, int):
        raise TypeError(f"GroupedNM: g must be an int (columns per pattern per chunk), got {g!r}")
    if g <= 0:
        raise ValueError(f"GroupedNM: g must be >= 1 (columns per pattern per chunk), got g={g}")
    return g


def _geometry(shape: Tuple[int, int], n: int, m: int, g: int) -> Tuple[int, int, int, int, int, int]:
    """(B, C, P, chunk, R_pad, K_pad)."""
    p = math.comb(m, n)
    chunk = p * g
    rp, kp = ceil_to(shape[0], m), ceil_to(shape[1], chunk)
    return rp // m, kp // chunk, p, chunk, rp, kp


def _indicator(pat: Tensor, m: int, dtype: torch.dtype) -> Tensor:
    """(P, m) 0/1 matrix: row p marks the rows kept by pattern p."""
    ind = torch.zeros(pat.shape[0], m, dtype=dtype, device=pat.device)
    ind.scatter_(1, pat, 1)
    return ind


def _blocks(t: Tensor, m: int, c: int, chunk: int) -> Tensor:
    """Padded (R_pad, K_pad) -> (B, C, chunk, m): per block and chunk, each column's m values."""
    b = t.shape[0] // m
    return t.reshape(b, m, c, chunk).permute(0, 2, 3, 1)


def _greedy_assign(score: Tensor, g: int) -> Tensor:
    """Greedy pattern assignment for ``Q`` independent problems at once.

    ``score`` is ``(Q, chunk, P)``: the kept magnitude of each (column, pattern) pair. Pairs are taken
    in decreasing score order (ties: lower column, then lower pattern); a pair is accepted when its
    column is still unassigned and its pattern has fewer than ``g`` columns. Every column ends up
    assigned (a free column always sees a non-full pattern). Returns the pattern of each column,
    int64 ``(Q, chunk)``. The scan is sequential over pairs but vectorised over problems.
    """
    q, chunk, p = score.shape
    if q == 0 or chunk == 0:
        return torch.zeros(q, chunk, dtype=torch.int64, device=score.device)
    order = torch.sort(score.reshape(q, chunk * p), dim=1, descending=True, stable=True).indices
    order_t = order.t().contiguous()  # (L, Q): the i-th best pair of every problem
    col_t = order_t // p
    pat_t = order_t % p
    qi = torch.arange(q, device=score.device)
    col_flat = col_t + (qi * chunk)[None]
    pat_flat = pat_t + (qi * p)[None]
    assign = torch.full((q * chunk,), -1, dtype=torch.int64, device=score.device)
    count = torch.zeros(q * p, dtype=torch.int64, device=score.device)
    for i in range(chunk * p):
        ci, pi = col_flat[i], pat_flat[i]
        cur = assign.index_select(0, ci)
        ok = (cur < 0) & (count.index_select(0, pi) < g)
        assign.index_copy_(0, ci, torch.where(ok, pat_t[i], cur))
        count.index_add_(0, pi, ok.to(torch.int64))
        if (i & 15) == 15 and bool((assign >= 0).all()):
            break
    return assign.reshape(q, chunk)


def _columns_from_assign(assign: Tensor, b: int, c: int, p: int, g: int) -> Tensor:
    """(B*C, chunk) pattern per local column -> padded column indices (B, C, P, g), int64."""
    chunk = p * g
    local = torch.arange(chunk, device=assign.device)
    order = torch.argsort(assign * chunk + local, dim=1)  # grouped by pattern, ascending columns
    cols = order.reshape(b, c, p, g)
    return cols + (torch.arange(c, device=assign.device) * chunk).view(1, c, 1, 1)


@register_layout
class GroupedNM(Layout):
    """Grouped N:M sparsity of a 2-D weight (see the module docstring for the exact format).

    >>> import torch
    >>> from sparsa.layouts import GroupedNM
    >>> w = GroupedNM.from_dense(torch.randn(8, 24), n=2, m=4, g=2)
    >>> w.values.shape, w.columns.shape, w.density
    (torch.Size([2, 2, 6, 2, 2]), torch.Size([2, 2, 6, 2]), 0.5)
    """

    name = "grouped_nm"

    def __init__(
        self, values: Tensor, columns: Tensor, shape: Iterable[int], n: int, m: int, g: int, validate: bool = True
    ):
        self.values = values
        self.columns = columns
        self.shape = torch.Size(shape)
        self.dtype = values.dtype
        self.n, self.m = check_nm(n, m, "GroupedNM")
        self.g = _check_g(g)
        self._cache: Dict[str, Any] = {}
        if validate:
            self.validate()

    @property
    def geometry(self) -> Tuple[int, int, int, int, int, int]:
        """``(B, C, P, chunk, R_pad, K_pad)``."""
        return _geometry((self.shape[0], self.shape[1]), self.n, self.m, self.g)

    # ------------------------------------------------------------------ building
    @classmethod
    def from_dense(
        cls, dense: Tensor, mask: Optional[Tensor] = None, n: int = 2, m: int = 4, g: int = 4, **params: Any
    ) -> "GroupedNM":
        if params:
            raise TypeError(f"GroupedNM takes only n, m and g, got {sorted(params)}")
        n, m = check_nm(n, m, "GroupedNM")
        g = _check_g(g)
        check_float(dense, "dense")
        check_ndim(dense, "GroupedNM", exact=2)
        mask = check_mask(mask, dense, "GroupedNM")
        b, c, p, chunk, rp, kp = _geometry((dense.shape[0], dense.shape[1]), n, m, g)
        pat = patterns(n, m, dense.device)
        wp = pad_dims(dense, (rp, kp))
        if mask is None:
            mag = torch.nan_to_num(_blocks(wp.detach().abs(), m, c, chunk), nan=float("inf"))
            score = mag @ _indicator(pat, m, mag.dtype).t()  # (B, C, chunk, P)
            assign = _greedy_assign(score.reshape(b * c, chunk, p), g)
            keep = None
        else:
            keep = pad_dims(mask, (rp, kp), False)
            assign = _assign_from_mask(keep, dense.shape[0], n, m, g, pat)
        cols = _columns_from_assign(assign, b, c, p, g)
        rows = (torch.arange(b, device=dense.device) * m).view(b, 1, 1, 1, 1) + pat.view(1, 1, p, 1, n)
        vals = wp[rows, cols.unsqueeze(-1)]
        if keep is not None:
            vals = torch.where(
                keep[rows, cols.unsqueeze(-1)], vals, torch.zeros((), dtype=vals.dtype, device=vals.device)
            )
        return cls(vals.contiguous(), cols.to(torch.int32), dense.shape, n, m, g, validate=False)

    # ------------------------------------------------------------------ index helpers
    def _flat_index(self) -> Tensor:
        """Flat index into the padded ``(R_pad, K_pad)`` matrix of every stored value (cached)."""
        f = self._cache.get("flat")
        if f is None:
            b, c, p, chunk, rp, kp = self.geometry
            pat = patterns(self.n, self.m, self.columns.device)
            rows = (torch.arange(b, device=pat.device) * self.m).view(b, 1, 1, 1, 1) + pat.view(1, 1, p, 1, self.n)
            f = rows * kp + self.columns.long().unsqueeze(-1)
            f = self._cache["flat"] = f.reshape(-1)
        return f

    def _scatter(self, src: Tensor) -> Tensor:
        _, _, _, _, rp, kp = self.geometry
        out = torch.zeros(rp * kp, dtype=src.dtype, device=src.device)
        out[self._flat_index()] = src.reshape(-1)
        return out.reshape(rp, kp)[: self.shape[0], : self.shape[1]].contiguous()

    def to_dense(self) -> Tensor:
        return self._scatter(self.values)

    def mask(self) -> Tensor:
        return self._scatter(torch.ones_like(self.values, dtype=torch.bool))

    @property
    def nnz(self) -> int:
        _, _, _, _, rp, kp = self.geometry
        f = self._flat_index()
        return int(((f // kp < self.shape[0]) & (f % kp < self.shape[1])).sum())

    def params(self) -> Dict[str, Any]:
        return {"n": self.n, "m": self.m, "g": self.g}

    #: the forward kernels' tensors derived from the components (their plans), supplied by the module that
    #: runs those kernels (:mod:`sparsa.ops.native_grouped_nm` sets it on import): a layout cannot import its
    #: kernels, which import the layouts. An object with ``derive(layout)`` and ``adopt(layout, derived)``.
    derivation: Optional[Any] = None

    def derived_components(self) -> Dict[str, Tensor]:
        d = GroupedNM.derivation
        return {} if d is None else d.derive(self)

    def adopt_derived(self, derived: Dict[str, Tensor]) -> None:
        d = GroupedNM.derivation
        if d is None:
            super().adopt_derived(derived)
        else:
            d.adopt(self, derived)

    def components(self) -> Dict[str, Tensor]:
        return {"values": self.values, "columns": self.columns}

    @classmethod
    def from_components(
        cls, components: Dict[str, Tensor], shape: Iterable[int], n: int = 2, m: int = 4, g: int = 4, **params: Any
    ) -> "GroupedNM":
        if params:
            raise TypeError(f"GroupedNM takes only n, m and g, got {sorted(params)}")
        return cls(components["values"], components["columns"], shape, n, m, g)

    def refill(self, dense: Tensor) -> "GroupedNM":
        _, _, _, _, rp, kp = self.geometry
        wp = pad_dims(dense.to(self.dtype), (rp, kp))
        vals = wp.reshape(-1)[self._flat_index()].reshape(self.values.shape)
        out = GroupedNM(vals, self.columns, self.shape, self.n, self.m, self.g, validate=False)
        out._cache = {k: v for k, v in self._cache.items() if k == "flat"}
        return out

    def validate(self) -> None:
        if len(self.shape) != 2:
            raise ValueError(f"GroupedNM: shape must be 2-D, got {tuple(self.shape)}")
        b, c, p, chunk, rp, kp = self.geometry
        check_values(self.values, "values", "GroupedNM", (b, c, p, self.g, self.n))
        check_int_tensor(self.columns, "columns", "GroupedNM", (torch.int32,))
        if tuple(self.columns.shape) != (b, c, p, self.g):
            raise ValueError(
                f"GroupedNM: component 'columns' has shape {tuple(self.columns.shape)}, expected {(b, c, p, self.g)}"
            )
        if self.columns.numel() == 0:
            return
        got = self.columns.long().reshape(b, c, chunk).sort(-1).values
        want = torch.arange(c * chunk, device=got.device).reshape(1, c, chunk)
        if not bool((got == want).all()):
            bad = (got != want).any(-1).nonzero()[0].tolist()
            raise ValueError(
                f"GroupedNM: component 'columns' must list every column of a chunk exactly once "
                f"per block (block {bad[0]}, chunk {bad[1]} covers columns "
                f"{bad[1] * chunk}..{bad[1] * chunk + chunk - 1}); it does not"
            )
        if rp > self.shape[0] or kp > self.shape[1]:
            f = self._flat_index()
            outside = (f // kp >= self.shape[0]) | (f % kp >= self.shape[1])
            if bool((self.values.reshape(-1)[outside] != 0).any()):
                raise ValueError(
                    f"GroupedNM: component 'values' is nonzero in the padding beyond the shape "
                    f"{tuple(self.shape)}; padded rows/columns must hold zeros"
                )


def _assign_from_mask(keep: Tensor, r: int, n: int, m: int, g: int, pat: Tensor) -> Tensor:
    """Pattern per (block*chunk, column) that covers a given padded mask, or ValueError."""
    rp, kp = keep.shape
    p = pat.shape[0]
    chunk = p * g
    b, c = rp // m, kp // chunk
    kb = _blocks(keep, m, c, chunk)  # (B, C, chunk, m)
    counts = kb.sum(-1)
    if bool((counts > n).any()):
        bb, cc, kk = (counts > n).nonzero()[0].tolist()
        raise ValueError(
            f"GroupedNM: mask keeps {int(counts[bb, cc, kk])} values of column {cc * chunk + kk} in "
            f"row block {bb} (rows {bb * m}..{bb * m + m - 1}), more than n={n} of m={m}; use "
            f"sparsa.sparsifiers.GroupedNM(n={n}, m={m}, g={g}) or grouped_nm_mask()"
        )
    ind = _indicator(pat, m, torch.float32)
    inside = kb.to(torch.float32) @ ind.t()  # kept rows covered by each pattern
    compatible = inside == counts.unsqueeze(-1).to(torch.float32)
    n_compat = compatible.sum(-1, keepdim=True)
    assign, settled = _forced_assign(kb.reshape(b * c, chunk, m), counts.reshape(b * c, chunk), n, g, pat)
    if not bool(settled.all()):
        padrow = (torch.arange(rp, device=keep.device) >= r).reshape(b, m).to(torch.float32)
        pad_in = (padrow @ ind.t()).view(b, 1, 1, p)
        # most constrained columns first; among a column's patterns prefer extra rows in the padding
        score = torch.where(
            compatible,
            (p + 1 - n_compat).to(torch.float32) * (m + 1) + pad_in,
            torch.full((), -1.0, device=keep.device),
        ).reshape(b * c, chunk, p)
        rest = (~settled).nonzero().squeeze(1)
        assign[rest] = _greedy_assign(score[rest], g)
    compat = compatible.reshape(b * c, chunk, p)
    ok = compat.gather(-1, assign.unsqueeze(-1)).squeeze(-1)
    for qq in (~ok).any(1).nonzero().squeeze(1).tolist():  # the greedy pass can miss: search exactly
        exact = _match_columns(compat[qq], g)
        if exact is not None:
            assign[qq] = exact
            ok[qq] = True
    if not bool(ok.all()):
        qq, kk = (~ok).nonzero()[0].tolist()
        bb, cc = divmod(qq, c)
        forced = (compatible & (n_compat == 1)).reshape(b * c, chunk, p).sum(1)[qq]
        over = [i for i, v in enumerate(forced.tolist()) if v > g]
        why = (
            f"{int(forced[over[0]])} columns need pattern {tuple(pat[over[0]].tolist())} but only g={g} may use it"
            if over
            else "the kept rows cannot be spread over the patterns with g columns each"
        )
        raise ValueError(
            f"GroupedNM: mask does not have the grouped n:m structure in row block {bb}, column chunk "
            f"{cc} (columns {cc * chunk}..{cc * chunk + chunk - 1}): {why}; use "
            f"sparsa.sparsifiers.GroupedNM(n={n}, m={m}, g={g}) or grouped_nm_mask()"
        )
    return assign


def _match_columns(compat: Tensor, g: int) -> Optional[Tensor]:
    """An assignment of every column to a compatible pattern with each pattern used at most ``g`` times
    (augmenting paths, i.e. bipartite matching onto ``g`` slots per pattern), or None if none exists.
    ``compat``: bool ``(chunk, p)``. Run only where the greedy pass failed, so it may be plain Python."""
    options = [row.nonzero().squeeze(1).tolist() for row in compat.cpu()]
    slot_owner: Dict[Tuple[int, int], int] = {}  # (pattern, slot) -> column

    def place(col: int, seen: set) -> bool:
        for pt in options[col]:
            for sl in range(g):
                key = (pt, sl)
                if key in seen:
                    continue
                seen.add(key)
                if key not in slot_owner or place(slot_owner[key], seen):
                    slot_owner[key] = col
                    return True
        return False

    for col in range(len(options)):
        if not place(col, set()):
            return None
    out = torch.empty(len(options), dtype=torch.int64)
    for (pt, _), col in slot_owner.items():
        out[col] = pt
    return out.to(compat.device)


def _forced_assign(kb: Tensor, counts: Tensor, n: int, g: int, pat: Tensor) -> Tuple[Tensor, Tensor]:
    """The assignment a mask forces, without a search: a column keeping exactly ``n`` rows of its
    block fits exactly one pattern. ``kb``: bool ``(Q, chunk, m)``, ``counts``: its sum over ``m``.
    Returns ``(assign, settled)``: int64 ``(Q, chunk)`` and bool ``(Q,)``, true for the problems whose
    every column is forced and whose patterns are each used exactly ``g`` times; there ``assign`` is
    the only valid assignment (what the greedy search finds too), elsewhere it is to be searched."""
    q, chunk, m = kb.shape
    p = pat.shape[0]
    assign = torch.zeros(q, chunk, dtype=torch.int64, device=kb.device)
    if q == 0 or chunk == 0 or m > 62:  # m > 62: the kept rows do not fit a 64-bit code
        return assign, torch.zeros(q, dtype=torch.bool, device=kb.device)
    bit = torch.ones((), dtype=torch.int64, device=kb.device) << torch.arange(m, device=kb.device)
    code = (kb.to(torch.int64) * bit).sum(-1)  # the kept rows of each column, as bits
    pcode, pidx = (bit[pat]).sum(-1).sort()  # each pattern's rows, as bits (sorted)
    at = torch.searchsorted(pcode, code).clamp_max(p - 1)
    forced = (counts == n) & (pcode[at] == code)
    assign = pidx[at]
    used = torch.zeros(q, p, dtype=torch.int64, device=kb.device).scatter_add_(1, assign, forced.to(torch.int64))
    return assign, forced.all(1) & (used == g).all(1)


def grouped_nm_mask(dense: Tensor, n: int, m: int, g: int) -> Tensor:
    """Boolean mask of the positions :class:`GroupedNM` keeps for ``dense`` (greedy assignment).

    >>> import torch
    >>> mk = grouped_nm_mask(torch.randn(8, 12), 2, 4, 2)
    >>> mk.sum().item()
    48
    """
    n, m = check_nm(n, m, "GroupedNM")
    g = _check_g(g)
    check_float(dense, "dense")
    check_ndim(dense, "GroupedNM", exact=2)
    b, c, p, chunk, rp, kp = _geometry((dense.shape[0], dense.shape[1]), n, m, g)
    pat = patterns(n, m, dense.device)
    ind = _indicator(pat, m, torch.float32)
    mag = torch.nan_to_num(_blocks(pad_dims(dense.detach(), (rp, kp)).abs(), m, c, chunk), nan=float("inf"))
    assign = _greedy_assign((mag @ ind.to(mag.dtype).t()).reshape(b * c, chunk, p), g)
    keep = ind.to(torch.bool)[assign].reshape(b, c, chunk, m)  # what GroupedNM.from_dense(...).mask() holds
    return keep.permute(0, 3, 1, 2).reshape(rp, kp)[: dense.shape[0], : dense.shape[1]].contiguous()
