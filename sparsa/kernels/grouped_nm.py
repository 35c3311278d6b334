"""Native kernels for the grouped N:M layout: ``sparsa::grouped_nm_spmm`` and ``sparsa::grouped_nm_sddmm``.

Both work on a *plan*: the layout's components reordered for the kernel (:func:`forward_plan`,
:func:`input_grad_plan`). A plan is a list of groups; group ``g`` has ``L`` entries (an input index and
``n`` values) feeding ``n`` output rows::

    spmm:   y[t, out_rows[g, i]] += vals[g, e, i] * x[t, idx[g, e]]
    sddmm:  gv[g, e, i] = sum_t gy[t, out_rows[g, i]] * x[t, idx[g, e]]

The forward plan groups a row block's columns by keep-pattern (``g = (block, pattern)``; for ``1:m`` with the
AVX-512 kernel, :func:`pair_plan` groups two blocks' columns by their pair of patterns), so
``y = x @ W.T`` is an spmm and grad_W on the pattern an sddmm; the input-grad plan groups W's entries
by column (``g = column``, ``n = 1``), so ``grad_x = grad_y @ W`` is an spmm too. The C++ kernel
(``csrc/grouped_nm_linear.cpp``, AVX2/FMA + OpenMP, token-vectorised panels; AVX-512 for the
interleaved ``n = 1`` plans when the CPU has it, ``SPARSA_NO_AVX512=1`` to keep AVX2) runs for float32 CPU
tensors, and spmm also for bfloat16 ``x`` and plan values (bias bfloat16, float32 or None): products accumulate
in float32 and the bfloat16 output is rounded once (nearest even); bf16 runs the AVX2 pieces on every CPU and
gets no block-pair plans (``F.linear`` on a bf16 1:m weight widens its input to run the fp32 ones where
:func:`pairs_when_widened`). Otherwise, or with ``SPARSA_NO_NATIVE=1``, the pure-PyTorch reference with the same
semantics runs (gather + einsum + index_add, in chunks of groups; bfloat16/float16 computed in float32 and
rounded once).

Both ops have autograd formulas, so they are differentiable when called directly, eagerly or under
``torch.compile`` (:class:`~sparsa.ops.native_grouped_nm.GroupedNMLinear` keeps its own backward, with plans
cached on the layout): spmm's ``grad_vals`` is the sddmm op on the plan (de-interleaved for interleaved plans,
one group per entry for block-pair plans), its ``grad_x`` a matmul with the plan's dense matrix; sddmm,
bilinear in ``(x, gy)``, differentiates to the same two products, so spmm is twice differentiable.

Example::

    >>> import torch
    >>> from sparsa.layouts import GroupedNM
    >>> from sparsa.kernels.grouped_nm import forward_plan, spmm
    >>> w = GroupedNM.from_dense(torch.randn(10, 30), n=1, m=4, g=2)
    >>> plan = forward_plan(w.values, w.columns, w.n, w.m)
    >>> x = torch.randn(5, 30)
    >>> torch.allclose(spmm(x, plan, None, 10), x @ w.to_dense().T, atol=1e-5)
    True
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import loader
from .operands import REDUCED_DTYPES, compute_dtype, native_kind as spmm_native_kind
from .opdef import kernel_op

__all__ = [
    "Plan",
    "forward_plan",
    "pattern_plan",
    "pair_plan",
    "input_grad_plan",
    "spmm",
    "sddmm",
    "grouped_nm_spmm",
    "grouped_nm_sddmm",
    "grouped_nm_spmm_kernel",
    "grouped_nm_sddmm_kernel",
    "spmm_reference",
    "sddmm_reference",
    "native_library",
    "spmm_native_kind",
    "pairs_when_widened",
]

_SOURCES = ["grouped_nm_linear.cpp"]
#: bytes of the transposed input panel a tile of units may touch (0: the kernel's default); for tuning
TILE_BYTES = 0
#: token vectors (of 8) per panel in spmm (0: the kernel's default); for tuning
VMAX = 0
#: elements of the gathered (tokens, groups, entries) tensor per chunk in the reference
_REF_CHUNK = 1 << 23


def native_library() -> Optional[ctypes.CDLL]:
    """The native kernel library, or None when the fallback must run."""
    return loader.load("grouped_nm_linear", _SOURCES)  # typed by abi.SIGNATURES["grouped_nm_linear"]


@dataclass(frozen=True)
class Plan:
    """Kernel-ordered components. Entries of a group are cut into ``units`` of ``unit_entries``
    entries reading input indices in ``[u*unit_span, (u+1)*unit_span)``; every ``gpb`` consecutive
    groups (a block) write the ``rpb`` output rows ``[blk*rpb, (blk+1)*rpb)`` and no others. An
    *interleaved* plan has one value per entry, entry ``e`` of group ``g`` feeding ``out_rows[g, e % Q]``
    (``Q = out_rows.shape[1]``). A *block-pair* plan (:func:`pair_plan`) has ``offsets`` (int64
    ``(G, units+1)``): group ``g``'s entries in unit ``u`` are the flat entries ``offsets[g, u]`` to
    ``offsets[g, u+1]`` of ``idx`` and ``vals`` (shapes ``(1, E)`` and ``(1, E, 2)``), counts varying."""

    idx: Tensor  # int32 (G, L)
    vals: Tensor  # (G, L, n)
    out_rows: Tensor  # int32 (G, n)
    units: int
    unit_entries: int
    unit_span: int
    gpb: int
    rpb: int
    interleaved: bool = False  # vals (G, L, 1): entry e feeds only out_rows[g, e % Q]
    offsets: Optional[Tensor] = None  # block-pair plans: int64 (G, units+1) into the flat entries

    @property
    def in_pad(self) -> int:
        return self.units * self.unit_span

    @property
    def groups(self) -> int:
        return self.out_rows.shape[0]

    @property
    def out_pad(self) -> int:
        return (self.groups // self.gpb) * self.rpb


def _pattern_rows(n: int, m: int, nblocks: int, device) -> Tensor:
    """int64 (B, P, n): the rows of every (block, pattern)."""
    from ..layouts.grouped_nm import patterns

    pat = patterns(n, m, device)
    return (torch.arange(nblocks, device=device) * m).view(-1, 1, 1) + pat.unsqueeze(0)


def _interleave(P: int) -> int:
    """Patterns per interleaved group: 2 when it divides ``P`` (best measured: 6 token vectors per row),
    else 3 or 4, else 1."""
    for q in (2, 3, 4):
        if P % q == 0:
            return q
    return 1


def forward_plan(values: Tensor, columns: Tensor, n: int, m: int) -> Plan:
    """Plan for ``y = x @ W.T``. With ``n == 1``: :func:`pair_plan` when the AVX-512 kernel runs and ``K`` is
    large enough (:data:`PAIR_MIN_RUN`), else one group per (row block, ``Q`` patterns), entries
    interleaved over the ``Q`` rows; otherwise :func:`pattern_plan`."""
    B, C, P, g, nn = values.shape
    if n != 1:
        return pattern_plan(values, columns, n, m)
    if _use_pairs(values, n, m):
        return pair_plan(values, columns, n, m)
    q = _interleave(P)
    s = P // q
    vals = values.reshape(B, C, s, q, g).permute(0, 2, 1, 4, 3).reshape(B * s, C * g * q, 1).contiguous()
    idx = columns.reshape(B, C, s, q, g).permute(0, 2, 1, 4, 3).reshape(B * s, C * g * q).to(torch.int32).contiguous()
    rows = _pattern_rows(n, m, B, values.device).reshape(B * s, q).to(torch.int32).contiguous()
    return Plan(idx, vals, rows, *_interleaved_fields(C, P, g, m))


# The integer fields of each kind of plan (units, unit_entries, unit_span, gpb, rpb, interleaved) depend on
# the values' shape only: forward_plan_fields gives them for a plan whose tensors were built elsewhere (a
# compiled graph takes a weight's plan tensors as inputs, see sparsa.ops.native_grouped_nm).


def _interleaved_fields(C: int, P: int, g: int, m: int) -> tuple:
    q = _interleave(P)
    return (C, g * q, P * g, P // q, m, True)


def _pattern_fields(C: int, P: int, g: int, m: int) -> tuple:
    return (C, g, P * g, P, m, False)


def _pair_units(C: int, P: int, g: int, unit_cols: int = 0) -> Tuple[int, int]:
    """``(U, ucols)`` of a block-pair plan: its number of units and columns per unit."""
    chunk = P * g
    kp = C * chunk
    ucols = unit_cols if unit_cols > 0 else max(PAIR_UNIT_COLS, 32 * P * P)
    ucols = max(chunk, ucols // chunk * chunk)
    U = max(1, -(-kp // ucols))
    ucols = -(-(kp // chunk) // U) * chunk  # balance the units
    return -(-kp // ucols), ucols


def forward_plan_fields(values_shape: Sequence[int], n: int, m: int, pairs: bool) -> tuple:
    """The integer fields of :func:`forward_plan` for values of shape ``values_shape`` (``B, C, P, g, n``);
    ``pairs``: whether it builds a block-pair plan (``_use_pairs`` of those values)."""
    _, C, P, g, _ = values_shape
    if n != 1:
        return _pattern_fields(C, P, g, m)
    if pairs:
        U, ucols = _pair_units(C, P, g)
        return (U, 0, ucols, P * P, 2 * m, False)
    return _interleaved_fields(C, P, g, m)


#: 1:m forward plans pair row blocks (with the AVX-512 kernel) when every (pattern, pattern) group keeps at
#: least this many columns on average (K/m^2): one x load then feeds two rows; with AVX2 only (16 registers)
#: the pair piece loses to the interleaved plan, which then stays (figures in docs/benchmarks.md)
PAIR_MIN_RUN = 6
#: columns per unit of a block-pair plan (the panel rows a unit reads stay in L2); at least 32*m*m so that the
#: groups' runs of entries stay long
PAIR_UNIT_COLS = 1024


def pair_plan(values: Tensor, columns: Tensor, n: int, m: int, unit_cols: int = 0) -> Plan:
    """Block-pair plan for ``y = x @ W.T`` with ``n == 1``: row blocks ``2j`` and ``2j+1`` (an odd last block is
    paired with zero weights feeding padding rows) form ``m*m`` groups, one per (pattern in block 2j, pattern
    in block 2j+1); a group's entries are the columns with that pair of patterns, each with its two values,
    so the kernel loads every x vector once for two output rows. Columns are cut into units of
    ``unit_cols`` (default :data:`PAIR_UNIT_COLS`, rounded to chunks); within a unit, by column."""
    B, C, P, g, nn = values.shape
    if n != 1 or nn != 1:
        raise ValueError(f"pair_plan: needs n == 1, got n={n}")
    dev = values.device
    kp = C * P * g
    U, ucols = _pair_units(C, P, g, unit_cols)
    Bp = B + (B % 2)
    # pattern and value of every (block, padded column)
    pat = torch.zeros(Bp, kp, dtype=torch.int64, device=dev)
    val = torch.zeros(Bp, kp, dtype=values.dtype, device=dev)
    cols = columns.long().reshape(B, -1)
    pid = torch.arange(P, device=dev).view(1, 1, P, 1).expand(B, C, P, g).reshape(B, -1)
    pat[:B].scatter_(1, cols, pid)
    val[:B].scatter_(1, cols, values.reshape(B, -1))
    npair = Bp // 2
    pa, pb = pat.view(npair, 2, kp).unbind(1)
    combo = pa * P + pb  # (npair, kp)
    k = torch.arange(kp, device=dev)
    unit = (k // ucols).view(1, kp)
    key = (combo * U + unit) * kp + k.view(1, kp)  # group-major, then unit, then column
    order = torch.argsort(key, dim=1)
    idx = order.to(torch.int32)  # column of each entry
    va, vb = val.view(npair, 2, kp).unbind(1)
    vals = torch.stack([va.gather(1, order), vb.gather(1, order)], -1)  # (npair, kp, 2)
    gu = combo * U + unit  # (npair, kp): group-in-pair x unit
    counts = torch.zeros(npair, P * P * U, dtype=torch.int64, device=dev)
    counts.scatter_add_(1, gu, torch.ones_like(gu))
    starts = torch.cumsum(counts, 1) - counts + (torch.arange(npair, device=dev) * kp).view(-1, 1)
    starts = starts.view(npair * P * P, U)
    offs = torch.cat([starts, starts[:, -1:] + counts.view(npair * P * P, U)[:, -1:]], 1).contiguous()
    pp = torch.arange(P, device=dev)
    j = torch.arange(npair, device=dev).view(-1, 1, 1)
    ra = (2 * j * m + pp.view(1, P, 1)).expand(npair, P, P)
    rb = ((2 * j + 1) * m + pp.view(1, 1, P)).expand(npair, P, P)
    rows = torch.stack([ra, rb], -1).reshape(npair * P * P, 2).to(torch.int32).contiguous()
    return Plan(
        idx.reshape(1, -1).contiguous(),
        vals.reshape(1, -1, 2).contiguous(),
        rows,
        U,
        0,
        ucols,
        P * P,
        2 * m,
        False,
        offs,
    )


def _use_pairs(values: Tensor, n: int, m: int, widened: bool = False) -> bool:
    B, C, P, g, _ = values.shape
    if n != 1 or B < 2 or C * P * g < PAIR_MIN_RUN * P * P or values.device.type != "cpu":
        return False
    if values.dtype != torch.float32 and not widened:  # the AVX-512 pair pieces are fp32-only
        return False
    lib = native_library()
    return lib is not None and bool(lib.sparsa_grouped_nm_has_avx512())


def pairs_when_widened(values: Tensor, n: int, m: int) -> bool:
    """Whether bf16 ``values`` of a 1:m weight would get a block-pair plan in float32. The pair pieces are
    fp32-only, and on such CPUs widening the bf16 input to run them beats the bf16 (AVX2) pieces; the
    output is still rounded to bf16 once, from the same fp32 sums."""
    return values.dtype == torch.bfloat16 and _use_pairs(values, n, m, widened=True)


def pattern_plan(values: Tensor, columns: Tensor, n: int, m: int) -> Plan:
    """Plan with one group per (row block, pattern), for ``y = x @ W.T`` and grad_W (:func:`sddmm`)."""
    B, C, P, g, nn = values.shape
    vals = values.permute(0, 2, 1, 3, 4).reshape(B * P, C * g, nn).contiguous()
    idx = columns.permute(0, 2, 1, 3).reshape(B * P, C * g).to(torch.int32).contiguous()
    rows = _pattern_rows(n, m, B, values.device).reshape(B * P, n).to(torch.int32).contiguous()
    return Plan(idx, vals, rows, *_pattern_fields(C, P, g, m))


def _input_grad_q(values_shape: Sequence[int], q: int) -> int:
    _, C, P, g, _ = values_shape
    return q if (C * P * g) % q == 0 else 1


def input_grad_plan_fields(values_shape: Sequence[int], n: int, m: int, q: int = 2) -> tuple:
    """The integer fields of :func:`input_grad_plan` for values of shape ``values_shape``."""
    q = _input_grad_q(values_shape, q)
    return (values_shape[0], n * q, m, 1, q, True)


def pattern_plan_fields(values_shape: Sequence[int], m: int) -> tuple:
    """The integer fields of :func:`pattern_plan` for values of shape ``values_shape``."""
    _, C, P, g, _ = values_shape
    return _pattern_fields(C, P, g, m)


def input_grad_plan(values: Tensor, columns: Tensor, n: int, m: int, q: int = 2) -> Plan:
    """Plan for ``grad_x = grad_y @ W``: one group per ``q`` (padded) input columns, each column's
    ``B*n`` entries ordered by row, interleaved over the group's columns."""
    B, C, P, g, nn = values.shape
    kp = C * P * g
    q = _input_grad_q(values.shape, q)
    rows = _pattern_rows(n, m, B, values.device).view(B, 1, P, 1, n).expand(B, C, P, g, n)
    cols = columns.long().unsqueeze(-1).expand(B, C, P, g, n)
    order = torch.argsort((cols * (B * m) + rows).reshape(-1))  # (column, row)
    # (kp/q, q, B, n) -> (kp/q, B, n, q): entry (block, i, column-in-group)
    order = order.view(kp // q, q, B, n).permute(0, 2, 3, 1).reshape(-1)
    idx = rows.reshape(-1)[order].view(kp // q, B * n * q).to(torch.int32).contiguous()
    vals = values.reshape(-1)[order].view(kp // q, B * n * q, 1).contiguous()
    out_rows = torch.arange(kp, dtype=torch.int32, device=values.device).view(kp // q, q)
    return Plan(idx, vals, out_rows, *input_grad_plan_fields(values.shape, n, m, q))


# ------------------------------------------------------------------------------------------ reference


def _chunks(T: int, G: int, L: int):
    step = max(1, _REF_CHUNK // max(1, T * L))
    return range(0, G, step), step


def spmm_reference(x: Tensor, plan: Plan, bias: Optional[Tensor], out_features: int) -> Tensor:
    """Pure-PyTorch semantics of :func:`spmm` (``x[..., K] -> y[..., out_features]``, ``x``'s dtype; for
    bfloat16/float16 ``x`` computed in float32 and rounded once)."""
    if x.dtype in REDUCED_DTYPES:
        b = None if bias is None else bias.to(torch.float32)
        return spmm_reference(x.to(torch.float32), plan, b, out_features).to(x.dtype)
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = torch.nn.functional.pad(x.reshape(-1, K), (0, plan.in_pad - K))
    T = x2.shape[0]
    if plan.offsets is not None:
        return _pair_reference(x2, plan, bias, out_features).reshape(*lead, out_features)
    G, L, n = plan.vals.shape
    out = x2.new_zeros(T, plan.out_pad)
    starts, step = _chunks(T, G, L)
    for g0 in starts:
        g1 = min(G, g0 + step)
        xg = x2[:, plan.idx[g0:g1].reshape(-1).long()].view(T, g1 - g0, L)
        rows = plan.out_rows[g0:g1].long()
        if plan.interleaved:
            z = xg * plan.vals[g0:g1, :, 0].to(x2.dtype)
            rows = rows[:, torch.arange(L, device=rows.device) % rows.shape[1]]
        else:
            z = torch.einsum("tgl,gln->tgn", xg, plan.vals[g0:g1].to(x2.dtype))
        out.index_add_(1, rows.reshape(-1), z.reshape(T, -1))
    y = out[:, :out_features]
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, out_features)


def _pair_reference(x2: Tensor, plan: Plan, bias: Optional[Tensor], out_features: int) -> Tensor:
    """Block-pair plan semantics on padded 2-D ``x2``: every flat entry feeds its group's two rows."""
    T = x2.shape[0]
    idx = plan.idx.reshape(-1).long()
    vals = plan.vals.reshape(-1, 2).to(x2.dtype)
    off = plan.offsets
    cnt = off[:, -1] - off[:, 0]
    grp = torch.repeat_interleave(torch.arange(off.shape[0], device=idx.device), cnt)
    first = off[:, 0]
    pos = torch.repeat_interleave(first, cnt) + (
        torch.arange(grp.shape[0], device=idx.device) - torch.repeat_interleave(torch.cumsum(cnt, 0) - cnt, cnt)
    )
    rows = plan.out_rows.long()[grp]  # (E', 2)
    out = x2.new_zeros(T, plan.out_pad)
    step = max(1, _REF_CHUNK // max(1, T))
    for e0 in range(0, pos.shape[0], step):
        p = pos[e0 : e0 + step]
        xg = x2[:, idx[p]]
        for i in range(2):
            out.index_add_(1, rows[e0 : e0 + step, i], xg * vals[p, i])
    y = out[:, :out_features]
    if bias is not None:
        y = y + bias
    return y


def sddmm_reference(x: Tensor, gy: Tensor, plan: Plan) -> Tensor:
    """Pure-PyTorch semantics of :func:`sddmm`: ``(G, L, n)`` in the plan's order (not interleaved)."""
    K, R = x.shape[-1], gy.shape[-1]
    x2 = torch.nn.functional.pad(x.reshape(-1, K), (0, plan.in_pad - K))
    g2 = torch.nn.functional.pad(gy.reshape(-1, R).to(x2.dtype), (0, plan.out_pad - R))
    T = x2.shape[0]
    G, L = plan.idx.shape
    n = plan.out_rows.shape[1]
    out = x2.new_empty(G, L, n)
    starts, step = _chunks(T, G, L)
    for g0 in starts:
        g1 = min(G, g0 + step)
        xg = x2[:, plan.idx[g0:g1].reshape(-1).long()].view(T, g1 - g0, L)
        gg = g2[:, plan.out_rows[g0:g1].reshape(-1).long()].view(T, g1 - g0, n)
        out[g0:g1] = torch.einsum("tgl,tgn->gln", xg, gg)
    return out


# ---------------------------------------------------------------------------------------------- native
def _lib_for(*tensors: Optional[Tensor]) -> Optional[ctypes.CDLL]:
    for t in tensors:
        if t is not None and (t.device.type != "cpu" or t.dtype != torch.float32):
            return None
    return native_library()


def _rows(x: Tensor) -> Tensor:
    """2-D view with unit column stride (copy only when needed)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 and (x2.shape[0] <= 1 or x2.stride(0) >= x2.shape[1]) else x2.contiguous()


def _spmm_impl(
    x: Tensor,
    idx: Tensor,
    vals: Tensor,
    out_rows: Tensor,
    bias: Optional[Tensor],
    out_features: int,
    units: int,
    unit_entries: int,
    unit_span: int,
    gpb: int,
    rpb: int,
    interleaved: bool,
    offsets: Optional[Tensor] = None,
) -> Tensor:
    plan = Plan(idx, vals, out_rows, units, unit_entries, unit_span, gpb, rpb, interleaved, offsets)
    kind = spmm_native_kind(x, vals, bias)
    lib = None if kind is None else native_library()
    if lib is None:
        return spmm_reference(x, plan, bias, out_features).contiguous()
    K = x.shape[-1]
    x2 = _rows(x)
    T = x2.shape[0]
    y = torch.empty(T, out_features, dtype=x.dtype)
    G, L = out_rows.shape[0], idx.shape[1]
    n = out_rows.shape[1]
    b = None if bias is None else bias.contiguous()
    bp = None if b is None else b.data_ptr()
    off = None if offsets is None else offsets.contiguous()
    v, idx, out_rows = vals.contiguous(), idx.contiguous(), out_rows.contiguous()
    head = (
        x2.data_ptr(),
        T,
        K,
        x2.stride(0) if T > 1 else K,
        idx.data_ptr(),
        v.data_ptr(),
        out_rows.data_ptr(),
        G,
        n,
        units,
        unit_entries,
        unit_span,
        gpb,
        rpb,
        plan.in_pad,
        plan.out_pad,
    )
    tail = (
        y.data_ptr(),
        out_features,
        torch.get_num_threads(),
        TILE_BYTES,
        VMAX,
        int(interleaved),
        None if off is None else off.data_ptr(),
        idx.numel(),
    )
    if kind == "bf16":
        rc = lib.sparsa_gnm_spmm_bf16(*head, bp, int(b is not None and b.dtype == torch.bfloat16), *tail)
    else:
        rc = lib.sparsa_gnm_spmm_f32(*head, bp, *tail)
    if rc != 0:
        raise ValueError(
            f"grouped_nm_spmm: inconsistent plan (groups={G}, entries={L}, n={n}, units={units}, "
            f"unit_entries={unit_entries}, unit_span={unit_span}, in_features={K}, "
            f"out_features={out_features}); build it with forward_plan/input_grad_plan"
        )
    return y.reshape(*x.shape[:-1], out_features)


@torch.library.custom_op("sparsa::grouped_nm_spmm", mutates_args=())
def grouped_nm_spmm(
    x: Tensor,
    idx: Tensor,
    vals: Tensor,
    out_rows: Tensor,
    bias: Optional[Tensor],
    out_features: int,
    units: int,
    unit_entries: int,
    unit_span: int,
    gpb: int,
    rpb: int,
    interleaved: bool,
    offsets: Optional[Tensor] = None,
) -> Tensor:
    """``y[..., out_features]`` of the plan (see the module docstring); the fields of :class:`Plan` unpacked."""
    return _spmm_impl(
        x, idx, vals, out_rows, bias, out_features, units, unit_entries, unit_span, gpb, rpb, interleaved, offsets
    )


@grouped_nm_spmm.register_fake
def _spmm_fake(
    x, idx, vals, out_rows, bias, out_features, units, unit_entries, unit_span, gpb, rpb, interleaved, offsets=None
):
    return x.new_empty(*x.shape[:-1], out_features)


# forward-only, low per-call cost (see kernels/opdef.py): spmm()/sddmm() run inside the autograd.Function of
# sparsa/ops/native_grouped_nm.py, which owns the backward
grouped_nm_spmm_kernel = kernel_op(
    "grouped_nm_spmm_kernel(Tensor x, Tensor idx, Tensor vals, Tensor out_rows, Tensor? bias, int out_features, "
    "int units, int unit_entries, int unit_span, int gpb, int rpb, bool interleaved, Tensor? offsets=None) -> Tensor",
    _spmm_impl,
    _spmm_fake,
)


def _sddmm_impl(
    x: Tensor, gy: Tensor, idx: Tensor, out_rows: Tensor, units: int, unit_entries: int, unit_span: int, out_pad: int
) -> Tensor:
    G, L = idx.shape
    n = out_rows.shape[1]
    plan = Plan(
        idx, idx.new_empty(G, L, n, dtype=x.dtype), out_rows, units, unit_entries, unit_span, max(G, 1), out_pad
    )
    lib = _lib_for(x, gy)
    if lib is None:
        return sddmm_reference(x, gy, plan)
    K, R = x.shape[-1], gy.shape[-1]
    x2, g2 = _rows(x), _rows(gy)
    idx, out_rows = idx.contiguous(), out_rows.contiguous()
    T = x2.shape[0]
    gv = torch.empty(G, L, n, dtype=torch.float32)
    rc = lib.sparsa_gnm_sddmm_f32(
        x2.data_ptr(),
        x2.stride(0) if T > 1 else K,
        g2.data_ptr(),
        g2.stride(0) if T > 1 else R,
        T,
        K,
        R,
        idx.data_ptr(),
        out_rows.data_ptr(),
        G,
        n,
        units,
        unit_entries,
        unit_span,
        plan.in_pad,
        out_pad,
        gv.data_ptr(),
        torch.get_num_threads(),
        TILE_BYTES,
    )
    if rc != 0:
        raise ValueError(
            f"grouped_nm_sddmm: inconsistent plan (groups={G}, entries={L}, n={n}, units={units}, "
            f"in_features={K}, out_features={R}); build it with forward_plan"
        )
    return gv


@torch.library.custom_op("sparsa::grouped_nm_sddmm", mutates_args=())
def grouped_nm_sddmm(
    x: Tensor, gy: Tensor, idx: Tensor, out_rows: Tensor, units: int, unit_entries: int, unit_span: int, out_pad: int
) -> Tensor:
    """``gv[g, e, i] = sum_t gy[t, out_rows[g, i]] * x[t, idx[g, e]]`` (float, ``(G, L, n)``)."""
    return _sddmm_impl(x, gy, idx, out_rows, units, unit_entries, unit_span, out_pad)


@grouped_nm_sddmm.register_fake
def _sddmm_fake(x, gy, idx, out_rows, units, unit_entries, unit_span, out_pad):
    return x.new_empty(idx.shape[0], idx.shape[1], out_rows.shape[1])


grouped_nm_sddmm_kernel = kernel_op(
    "grouped_nm_sddmm_kernel(Tensor x, Tensor gy, Tensor idx, Tensor out_rows, int units, int unit_entries, "
    "int unit_span, int out_pad) -> Tensor",
    _sddmm_impl,
    _sddmm_fake,
)


# -------------------------------------------------------------------------------------------- autograd
# Both ops are bilinear: spmm in (x, vals) (plus the bias), sddmm in (x, gy). Every formula is written
# with the per-entry output rows of the plan (:func:`_entry_rows`), so it holds for all three kinds of
# plan, and traces under torch.compile (no data-dependent shapes). float32 and float64 compute in their
# own dtype; bfloat16/float16 compute in float32 and the gradients are rounded to the inputs' dtypes.
def _entry_rows(
    idx: Tensor, out_rows: Tensor, interleaved: bool, offsets: Optional[Tensor]
) -> Tuple[Tensor, Optional[Tensor]]:
    """int64 output row of every value of the plan, in the values' shape (``(G, L, n)``; ``(G, L, 1)``
    interleaved; ``(1, E, 2)`` block-pair), and for block-pair plans a bool ``(1, E, 1)`` mask of the flat
    entries that some group reads (None otherwise: every entry counts)."""
    G, L = idx.shape
    rows = out_rows.long()
    if offsets is not None:
        # flat entry p belongs to the group whose run [offsets[g, 0], offsets[g, -1]) holds it
        p = torch.arange(L, device=idx.device)
        if offsets.shape[0] == 0:
            return p.new_zeros(1, L, 2), torch.zeros(1, L, 1, dtype=torch.bool, device=idx.device)
        start, end = offsets[:, 0], offsets[:, -1]
        order = torch.argsort(start * (L + 1) + end)  # by start, then end: of equal starts the non-empty run last
        k = (torch.searchsorted(start[order], p, right=True) - 1).clamp_min(0)
        grp = order[k]
        live = (p >= start[grp]) & (p < end[grp])
        return rows[grp].unsqueeze(0), live.view(1, L, 1)
    if interleaved:
        return rows[:, torch.arange(L, device=idx.device) % rows.shape[1]].unsqueeze(-1), None
    return rows.unsqueeze(1).expand(G, L, rows.shape[1]), None


def _plan_weight(
    idx: Tensor, vals: Tensor, rows: Tensor, live: Optional[Tensor], out_pad: int, in_pad: int, dtype: torch.dtype
) -> Tensor:
    """The plan as a dense ``(out_pad, in_pad)`` matrix ``W`` (``y_pad = x_pad @ W.T``), duplicates summed."""
    v = vals.to(dtype)
    if live is not None:
        v = v * live
    cols = idx.long().unsqueeze(-1).expand(rows.shape)
    w = torch.zeros(out_pad, in_pad, dtype=dtype, device=vals.device)
    return w.index_put_((rows.reshape(-1), cols.reshape(-1)), v.reshape(-1), accumulate=True)


def _pad_cols(t: Tensor, width: int, dtype: torch.dtype) -> Tensor:
    t2 = t.reshape(-1, t.shape[-1]).to(dtype)
    return t2 if t2.shape[1] == width else torch.nn.functional.pad(t2, (0, width - t2.shape[1]))


def _spmm_grad_vals(
    x2: Tensor,
    g2: Tensor,
    idx: Tensor,
    out_rows: Tensor,
    units: int,
    unit_entries: int,
    unit_span: int,
    out_pad: int,
    interleaved: bool,
    offsets: Optional[Tensor],
) -> Tensor:
    """``d loss / d vals`` in the values' shape: the sddmm op (native for float32) on the plan, on its
    de-interleaved form (group ``(g, i)``: the entries ``i, i+Q, ...`` of group ``g``), or with one group per
    entry (block-pair plans, irregular interleaved ones)."""
    G, L = idx.shape
    if offsets is None and not interleaved:
        return grouped_nm_sddmm(x2, g2, idx, out_rows, units, unit_entries, unit_span, out_pad)
    Q = out_rows.shape[1]
    if offsets is None and Q > 0 and unit_entries % Q == 0 and L == units * unit_entries:
        di = idx.view(G, L // Q, Q).transpose(1, 2).reshape(G * Q, L // Q)
        gv = grouped_nm_sddmm(x2, g2, di, out_rows.reshape(G * Q, 1), units, unit_entries // Q, unit_span, out_pad)
        return gv.view(G, Q, L // Q).transpose(1, 2).reshape(G, L, 1)
    rows, live = _entry_rows(idx, out_rows, interleaved, offsets)
    n = rows.shape[-1]
    in_pad = max(units * unit_span, x2.shape[1])
    gv = grouped_nm_sddmm(x2, g2, idx.reshape(-1, 1), rows.reshape(-1, n).to(torch.int32), 1, 1, in_pad, out_pad)
    gv = gv.view(rows.shape)
    return gv if live is None else gv * live


def _spmm_setup_context(ctx, inputs, output):
    x, idx, vals, out_rows, bias, out_features, units, unit_entries, unit_span, gpb, rpb, interleaved, offsets = inputs
    ctx.save_for_backward(x, idx, vals, out_rows, offsets)
    ctx.plan = (units, unit_entries, unit_span, (out_rows.shape[0] // gpb) * rpb, interleaved)
    ctx.out_features = out_features
    ctx.bias_dtype = None if bias is None else bias.dtype


def _spmm_backward(ctx, gy):
    x, idx, vals, out_rows, offsets = ctx.saved_tensors
    units, unit_entries, unit_span, out_pad, interleaved = ctx.plan
    K = x.shape[-1]
    in_pad = max(units * unit_span, K)
    ct = compute_dtype(gy.dtype, x.dtype, vals.dtype)
    g2 = gy.reshape(-1, ctx.out_features).to(ct)
    gx = gv = gb = None
    if ctx.needs_input_grad[0]:
        rows, live = _entry_rows(idx, out_rows, interleaved, offsets)
        w = _plan_weight(idx, vals, rows, live, out_pad, in_pad, ct)
        gx = (_pad_cols(g2, out_pad, ct) @ w)[:, :K].reshape(x.shape).to(x.dtype)
    if ctx.needs_input_grad[2]:
        gv = _spmm_grad_vals(
            x.reshape(-1, K).to(ct), g2, idx, out_rows, units, unit_entries, unit_span, out_pad, interleaved, offsets
        ).to(vals.dtype)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[4]:
        gb = g2.sum(0).to(ctx.bias_dtype)
    return gx, None, gv, None, gb, None, None, None, None, None, None, None, None


grouped_nm_spmm.register_autograd(_spmm_backward, setup_context=_spmm_setup_context)


def _sddmm_setup_context(ctx, inputs, output):
    x, gy, idx, out_rows, units, unit_entries, unit_span, out_pad = inputs
    ctx.save_for_backward(x, gy, idx, out_rows)
    ctx.in_pad, ctx.out_pad = max(units * unit_span, x.shape[-1]), out_pad


def _sddmm_backward(ctx, ggv):
    # gv is the plan's sampled gy.T @ x: d/dx = gy_pad @ W(ggv), d/dgy = x_pad @ W(ggv).T, W(ggv) the plan's
    # dense matrix with ggv as its values (d/dgy is the spmm of x with values ggv)
    x, gy, idx, out_rows = ctx.saved_tensors
    K, R = x.shape[-1], gy.shape[-1]
    ct = compute_dtype(ggv.dtype, x.dtype, gy.dtype)
    rows, _ = _entry_rows(idx, out_rows, False, None)
    w = _plan_weight(idx, ggv, rows, None, ctx.out_pad, ctx.in_pad, ct)
    gx = ggy = None
    if ctx.needs_input_grad[0]:
        gx = (_pad_cols(gy, ctx.out_pad, ct) @ w)[:, :K].reshape(x.shape).to(x.dtype)
    if ctx.needs_input_grad[1]:
        ggy = (_pad_cols(x, ctx.in_pad, ct) @ w.t())[:, :R].reshape(gy.shape).to(gy.dtype)
    return gx, ggy, None, None, None, None, None, None


grouped_nm_sddmm.register_autograd(_sddmm_backward, setup_context=_sddmm_setup_context)


def spmm(x: Tensor, plan: Plan, bias: Optional[Tensor], out_features: int) -> Tensor:
    """Run the plan on ``x[..., K]`` (native when possible): ``y[..., out_features]``."""
    args = (
        x,
        plan.idx,
        plan.vals,
        plan.out_rows,
        bias,
        out_features,
        plan.units,
        plan.unit_entries,
        plan.unit_span,
        plan.gpb,
        plan.rpb,
        plan.interleaved,
        plan.offsets,
    )
    return grouped_nm_spmm_kernel(*args)


def sddmm(x: Tensor, gy: Tensor, plan: Plan) -> Tensor:
    """Sampled ``gy.T @ x`` on the plan's entries: ``(G, L, n)`` in the plan's order (a
    :func:`pattern_plan`)."""
    if plan.interleaved or plan.offsets is not None:
        raise ValueError("sddmm: needs a pattern_plan (one group per row block and pattern), got an interleaved plan")
    args = (x, gy, plan.idx, plan.out_rows, plan.units, plan.unit_entries, plan.unit_span, plan.out_pad)
    return grouped_nm_sddmm_kernel(*args)
