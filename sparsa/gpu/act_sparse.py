"""Activation-sparse training GEMMs in Triton (Spartan on the GPU): ``y = a @ W^T`` where ``a`` is a
ReLU output, for Linear and (through ``unfold``) Conv2d, forward and both gradients.

**Compaction.** One Triton pass turns the activation's nonzero pattern into two index lists:

* per *row panel* (``BM`` consecutive rows) the columns where any row of the panel is nonzero,
* per *column panel* (``BK`` consecutive columns) the rows where any entry of the panel is nonzero.

**The three GEMMs** then only touch listed entries (work ~ active columns x panels):

* forward ``y[panel] = a[panel, cols] @ W[:, cols]^T`` (gather along the reduction dim),
* input gradient ``da[panel, cols] = (dy[panel] @ W[:, cols]) * (a != 0)`` -- computed only where the
  ReLU was active, which is exact for the composite ``linear(relu(z))`` since ReLU's backward zeroes the
  rest anyway,
* weight gradient ``dW[:, panel_k] = dy[rows]^T @ a[rows, panel_k]`` (gather along the token dim),
  reusing the same compacted operand.

Dense rows/columns cost nothing extra beyond the index lists, so the kernels stay correct at any
sparsity; they pay where zeros come in runs (dead channels, zero pixels in a panel). The choice of
sparse vs dense is the caller's policy; :class:`sparsa.adaptive.SparsityMonitor` estimates the density
on the device with the sampled-count kernel of this module (no host sync).

The panel compaction is private (``_compact_panels``): the public compaction of sparsa is
:func:`sparsa.adaptive.compact` (the ``relu_compact`` layout); ``compact`` here is its former name.

Example (on a GPU, or on the CPU with ``TRITON_INTERPRET=1``)::

    >>> import torch
    >>> from sparsa.gpu.act_sparse import act_sparse_linear
    >>> a = torch.relu(torch.randn(32, 64, requires_grad=True))
    >>> w = torch.randn(16, 64, requires_grad=True)
    >>> act_sparse_linear(a, w).sum().backward()                  # doctest: +SKIP
"""

from typing import NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ._launch import check_kernel_tensor, dot_flags, launch_opts
from ._triton import LazyKernel, interpreting, require_triton

triton = require_triton()
import triton.language as tl  # noqa: E402

__all__ = [
    "Compacted",
    "act_sparse_mm",
    "act_sparse_grad_input",
    "act_sparse_grad_weight",
    "act_sparse_linear",
    "act_sparse_conv2d",
]


# =============================================================================== kernels
@LazyKernel
def _compact_kernel(a_ptr, idx_ptr, cnt_ptr, R, C, stride_r, stride_c, BR: tl.constexpr, BC: tl.constexpr):
    """Per panel of BR rows: ascending list of columns with any nonzero in the panel, and its length."""
    p = tl.program_id(0)
    rr = (p * BR + tl.arange(0, BR)).to(tl.int64)
    total = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, C, BC):
        cc = c0 + tl.arange(0, BC)
        t = tl.load(
            a_ptr + rr[:, None] * stride_r + cc[None, :].to(tl.int64) * stride_c,
            mask=(rr[:, None] < R) & (cc[None, :] < C),
            other=0,
        )
        active = tl.max((t != 0).to(tl.int32), axis=0)
        slot = total + tl.cumsum(active, axis=0) - 1
        tl.store(idx_ptr + p.to(tl.int64) * C + slot, cc.to(tl.int32), mask=active != 0)
        total += tl.sum(active, axis=0)
    tl.store(cnt_ptr + p, total)


@LazyKernel
def _sampled_count_kernel(x_ptr, out_ptr, numel, n_samples, stride, offset, BLOCK: tl.constexpr):
    """Adds (nonzeros, samples) of ``x[offset + i * stride]``, ``i < n_samples``, into ``out``."""
    pid = tl.program_id(0)
    i = (pid * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    idx = i * stride + offset
    ok = (i < n_samples) & (idx < numel)
    v = tl.load(x_ptr + idx, mask=ok, other=0)
    tl.atomic_add(out_ptr, tl.sum(((v != 0) & ok).to(tl.int32), axis=0))
    tl.atomic_add(out_ptr + 1, tl.sum(ok.to(tl.int32), axis=0))


def _sampled_count(flat: Tensor, out: Tensor, numel: int, n_samples: int, stride: int, offset: int) -> None:
    """Launch :func:`_sampled_count_kernel` (the device path of :func:`sparsa.adaptive.monitor.sampled_counts`)."""
    block = 1024
    _sampled_count_kernel[(triton.cdiv(n_samples, block),)](
        flat, out, numel, n_samples, stride, offset, BLOCK=block, **launch_opts(4, 1)
    )


@LazyKernel
def _fwd_kernel(
    a_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    col_ptr,
    cnt_ptr,
    M,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    F64: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
):
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (p * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    rj = tl.arange(0, BK)
    cnt = tl.load(cnt_ptr + p)
    if F64:
        acc = tl.zeros((BM, BN), dtype=tl.float64)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for j0 in range(0, cnt, BK):
        jm = (j0 + rj) < cnt
        kk = tl.load(col_ptr + p.to(tl.int64) * K + j0 + rj, mask=jm, other=0).to(tl.int64)
        at = tl.load(a_ptr + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & jm[None, :], other=0.0)
        wt = tl.load(w_ptr + rn[:, None] * K + kk[None, :], mask=(rn[:, None] < N) & jm[None, :], other=0.0)
        if UPCAST:
            at = at.to(tl.float32)
            wt = wt.to(tl.float32)
        acc = tl.dot(at, tl.trans(wt), acc, input_precision=PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(acc.dtype)[None, :]
    tl.store(
        y_ptr + rm[:, None] * N + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


@LazyKernel
def _grad_input_kernel(
    g_ptr,
    w_ptr,
    act_ptr,
    ga_ptr,
    col_ptr,
    cnt_ptr,
    M,
    N,
    K,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    F64: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
):
    p = tl.program_id(0)
    j0 = tl.program_id(1) * BK
    cnt = tl.load(cnt_ptr + p)
    if j0 < cnt:
        rm = (p * BM + tl.arange(0, BM)).to(tl.int64)
        rj = j0 + tl.arange(0, BK)
        jm = rj < cnt
        kk = tl.load(col_ptr + p.to(tl.int64) * K + rj, mask=jm, other=0).to(tl.int64)
        if F64:
            acc = tl.zeros((BM, BK), dtype=tl.float64)
        else:
            acc = tl.zeros((BM, BK), dtype=tl.float32)
        for n0 in range(0, N, BN):
            rn = n0 + tl.arange(0, BN)
            gt = tl.load(g_ptr + rm[:, None] * N + rn[None, :], mask=(rm[:, None] < M) & (rn[None, :] < N), other=0.0)
            wt = tl.load(w_ptr + rn[:, None] * K + kk[None, :], mask=(rn[:, None] < N) & jm[None, :], other=0.0)
            if UPCAST:
                gt = gt.to(tl.float32)
                wt = wt.to(tl.float32)
            acc = tl.dot(gt, wt, acc, input_precision=PREC)
        io = (rm[:, None] < M) & jm[None, :]
        act = tl.load(act_ptr + rm[:, None] * K + kk[None, :], mask=io, other=0)
        acc = tl.where(act != 0, acc, 0.0)
        tl.store(ga_ptr + rm[:, None] * K + kk[None, :], acc.to(ga_ptr.dtype.element_ty), mask=io)


@LazyKernel
def _grad_weight_kernel(
    g_ptr,
    a_ptr,
    gw_ptr,
    row_ptr,
    cnt_ptr,
    M,
    N,
    K,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    F64: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    q = tl.program_id(1)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    kk = (q * BK + tl.arange(0, BK)).to(tl.int64)
    ri = tl.arange(0, BM)
    cnt = tl.load(cnt_ptr + q)
    if F64:
        acc = tl.zeros((BN, BK), dtype=tl.float64)
    else:
        acc = tl.zeros((BN, BK), dtype=tl.float32)
    for i0 in range(0, cnt, BM):
        im = (i0 + ri) < cnt
        rows = tl.load(row_ptr + q.to(tl.int64) * M + i0 + ri, mask=im, other=0).to(tl.int64)
        gt = tl.load(g_ptr + rows[:, None] * N + rn[None, :], mask=im[:, None] & (rn[None, :] < N), other=0.0)
        at = tl.load(a_ptr + rows[:, None] * K + kk[None, :], mask=im[:, None] & (kk[None, :] < K), other=0.0)
        if UPCAST:
            gt = gt.to(tl.float32)
            at = at.to(tl.float32)
        acc = tl.dot(tl.trans(gt), at, acc, input_precision=PREC)
    tl.store(
        gw_ptr + rn[:, None] * K + kk[None, :],
        acc.to(gw_ptr.dtype.element_ty),
        mask=(rn[:, None] < N) & (kk[None, :] < K),
    )


# =============================================================================== compaction
class Compacted(NamedTuple):
    """The compacted operand of a 2-D activation (M, K).

    ``cols``/``col_counts``: for each panel of ``block_m`` rows, the active columns (int32, ascending;
    entries past the count are unused) and their number. ``rows``/``row_counts``: for each panel of
    ``block_k`` columns, the active rows. ``density`` of the panels is ``col_counts.sum() / (panels*K)``.
    """

    cols: Tensor
    col_counts: Tensor
    rows: Tensor
    row_counts: Tensor
    block_m: int
    block_k: int


def _blocks() -> Tuple[int, int, int]:
    """(BM, BN, BK) tile sizes: small under the interpreter, GPU-sized otherwise."""
    return (16, 32, 32) if interpreting() else (64, 64, 64)


def _as_pattern(active: Tensor) -> Tensor:
    return active.view(torch.uint8) if active.dtype == torch.bool else active


def _compact_panels(
    active: Tensor, block_m: Optional[int] = None, block_k: Optional[int] = None, need_rows: bool = True
) -> Compacted:
    """Index lists of the nonzeros of the 2-D ``active`` (an activation, or a bool mask), by panel.

    >>> # c = _compact_panels(torch.relu(torch.randn(64, 32)))   # on a GPU or under TRITON_INTERPRET=1
    """
    if not isinstance(active, Tensor) or active.dim() != 2:
        raise ValueError(
            f"active must be a 2-D tensor (rows, cols), got "
            f"{tuple(active.shape) if isinstance(active, Tensor) else type(active).__name__}"
        )
    bm0, _, bk0 = _blocks()
    bm, bk = block_m or bm0, block_k or bk0
    pat = _as_pattern(active.contiguous())
    m, k = pat.shape
    pm, pk = triton.cdiv(m, bm), triton.cdiv(k, bk)
    cols = torch.empty(pm, max(k, 1), dtype=torch.int32, device=pat.device)
    ccnt = torch.zeros(pm, dtype=torch.int32, device=pat.device)
    scan = 64 if interpreting() else 128
    if m and k:
        _compact_kernel[(pm,)](pat, cols, ccnt, m, k, k, 1, BR=bm, BC=scan, **launch_opts(4, 2))
    rows = torch.empty(pk if need_rows else 0, max(m, 1), dtype=torch.int32, device=pat.device)
    rcnt = torch.zeros(pk if need_rows else 0, dtype=torch.int32, device=pat.device)
    if need_rows and m and k:
        _compact_kernel[(pk,)](pat, rows, rcnt, k, m, 1, k, BR=bk, BC=scan, **launch_opts(4, 2))
    return Compacted(cols, ccnt, rows, rcnt, bm, bk)


#: the former public name of :func:`_compact_panels` (kept so old imports work)
compact = _compact_panels


# =============================================================================== the three GEMMs
def _check(a: Tensor, w: Tensor) -> None:
    check_kernel_tensor(a, "a")
    check_kernel_tensor(w, "weight")
    if a.dim() != 2 or w.dim() != 2 or a.shape[1] != w.shape[1]:
        raise ValueError(f"a must be (tokens, K) and weight (out, K); got a {tuple(a.shape)}, weight {tuple(w.shape)}")
    if a.dtype != w.dtype:
        raise TypeError(f"a has dtype {a.dtype} but weight has {w.dtype}; convert one of them")


def act_sparse_mm(
    a: Tensor, weight: Tensor, bias: Optional[Tensor] = None, compacted: Optional[Compacted] = None
) -> Tensor:
    """Forward ``a @ weight^T + bias`` skipping the inactive columns of each row panel of ``a``."""
    _check(a, weight)
    a, weight = a.contiguous(), weight.contiguous()
    m, k = a.shape
    n = weight.shape[0]
    c = compacted if compacted is not None else _compact_panels(a, need_rows=False)
    y = torch.empty(m, n, dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return y
    _, bn, bk = _blocks()
    if not interpreting():
        bn = 128 if n >= 128 else 64
    b = bias.contiguous() if bias is not None else y
    grid = (c.col_counts.shape[0], triton.cdiv(n, bn))
    _fwd_kernel[grid](
        a,
        weight,
        b,
        y,
        c.cols,
        c.col_counts,
        m,
        n,
        k,
        HAS_BIAS=bias is not None,
        BM=c.block_m,
        BN=bn,
        BK=bk,
        **dot_flags(a.dtype),
        **launch_opts(),
    )
    return y


def act_sparse_grad_input(grad: Tensor, weight: Tensor, active: Tensor, compacted: Compacted) -> Tensor:
    """``(grad @ weight) * (active != 0)``, computed only at the active positions."""
    check_kernel_tensor(grad, "grad")
    grad, weight = grad.contiguous(), weight.contiguous()
    m, n = grad.shape
    k = weight.shape[1]
    ga = torch.zeros(m, k, dtype=grad.dtype, device=grad.device)
    if m == 0 or k == 0 or n == 0:
        return ga
    _, bn, bk = _blocks()
    grid = (compacted.col_counts.shape[0], triton.cdiv(k, bk))
    _grad_input_kernel[grid](
        grad,
        weight,
        _as_pattern(active.contiguous()),
        ga,
        compacted.cols,
        compacted.col_counts,
        m,
        n,
        k,
        BM=compacted.block_m,
        BN=bn,
        BK=bk,
        **dot_flags(grad.dtype),
        **launch_opts(),
    )
    return ga


def act_sparse_grad_weight(grad: Tensor, a: Tensor, compacted: Compacted) -> Tensor:
    """``grad^T @ a`` skipping the inactive rows of each column panel of ``a``."""
    check_kernel_tensor(grad, "grad")
    grad, a = grad.contiguous(), a.contiguous()
    m, n = grad.shape
    k = a.shape[1]
    gw = torch.zeros(n, k, dtype=a.dtype, device=a.device)
    if m == 0 or k == 0 or n == 0:
        return gw
    bm, bn, _ = _blocks()
    grid = (triton.cdiv(n, bn), compacted.row_counts.shape[0])
    _grad_weight_kernel[grid](
        grad,
        a,
        gw,
        compacted.rows,
        compacted.row_counts,
        m,
        n,
        k,
        BM=bm,
        BN=bn,
        BK=compacted.block_k,
        **dot_flags(a.dtype),
        **launch_opts(),
    )
    return gw


class _ActSparseLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        a: Tensor,
        weight: Tensor,
        bias: Optional[Tensor],  # type: ignore[override]
        active: Optional[Tensor] = None,
    ) -> Tensor:
        act = a if active is None else active
        c = _compact_panels(act, need_rows=ctx.needs_input_grad[1])
        ctx.compacted = c
        ctx.save_for_backward(a, weight, act)
        ctx.has_bias = bias is not None
        return act_sparse_mm(a, weight, bias, c)

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        a, weight, act = ctx.saved_tensors
        c = ctx.compacted
        g = g.contiguous()
        ga = act_sparse_grad_input(g, weight, act, c) if ctx.needs_input_grad[0] else None
        gw = act_sparse_grad_weight(g, a, c) if ctx.needs_input_grad[1] else None
        gb = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return ga, gw, gb, None


def act_sparse_linear(
    a: Tensor, weight: Tensor, bias: Optional[Tensor] = None, active: Optional[Tensor] = None
) -> Tensor:
    """``F.linear(a, weight, bias)`` for a ReLU output ``a`` (any leading dims), differentiable.

    The gradient w.r.t. ``a`` is returned only where ``a != 0`` (exact for ``linear(relu(z))``), or
    only where the optional bool ``active`` (same shape as ``a``, e.g. a layout's mask) is set.
    """
    lead = a.shape[:-1]
    act = None if active is None else active.reshape(-1, a.shape[-1])
    y = _ActSparseLinear.apply(a.reshape(-1, a.shape[-1]), weight, bias, act)
    return y.reshape(*lead, y.shape[-1])


def _pair(v: Union[int, Tuple[int, int]], arg: str) -> Tuple[int, int]:
    if isinstance(v, int):
        return v, v
    try:
        a, b = v
        return int(a), int(b)
    except (TypeError, ValueError):
        raise TypeError(f"{arg} must be an int or a pair of ints, got {v!r}") from None


def act_sparse_conv2d(
    a: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    stride=1,
    padding=0,
    dilation=1,
    groups: int = 1,
    active: Optional[Tensor] = None,
) -> Tensor:
    """``F.conv2d`` for a ReLU output ``a`` (N, C, H, W) via im2col + the activation-sparse GEMMs.

    Only ``groups=1`` and numeric padding are supported; the gradient w.r.t. ``a`` is returned only
    where ``a != 0`` (exact for ``conv2d(relu(z))``), or where the optional bool ``active`` is set.
    """
    if groups != 1:
        raise ValueError(f"groups must be 1 for the activation-sparse conv, got {groups}; use F.conv2d")
    if isinstance(padding, str):
        raise ValueError(f"padding must be numeric for the activation-sparse conv, got {padding!r}")
    if a.dim() != 4 or weight.dim() != 4:
        raise ValueError(
            f"a must be (N, C, H, W) and weight (O, C, kh, kw); got {tuple(a.shape)}, {tuple(weight.shape)}"
        )
    st, pd, dl = _pair(stride, "stride"), _pair(padding, "padding"), _pair(dilation, "dilation")
    nb, _, h, w_ = a.shape
    o, _, kh, kw = weight.shape
    ho = (h + 2 * pd[0] - dl[0] * (kh - 1) - 1) // st[0] + 1
    wo = (w_ + 2 * pd[1] - dl[1] * (kw - 1) - 1) // st[1] + 1
    cols = F.unfold(a, (kh, kw), dilation=dl, padding=pd, stride=st)  # (N, C*kh*kw, L)
    a2 = cols.transpose(1, 2).reshape(nb * ho * wo, cols.shape[1])
    act2 = None
    if active is not None:
        if active.shape != a.shape:
            raise ValueError(f"active must have a's shape {tuple(a.shape)}, got {tuple(active.shape)}")
        acols = F.unfold(active.to(a.dtype), (kh, kw), dilation=dl, padding=pd, stride=st)
        act2 = acols.transpose(1, 2).reshape(nb * ho * wo, acols.shape[1]) != 0
    y = _ActSparseLinear.apply(a2, weight.reshape(o, -1), bias, act2)  # (N*L, O)
    return y.reshape(nb, ho * wo, o).transpose(1, 2).reshape(nb, o, ho, wo)
