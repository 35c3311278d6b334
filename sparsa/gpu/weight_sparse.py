"""Triton GEMMs with a sparse weight: ``y = x @ W^T (+ b)`` for N:M and block-sparse (BSR) ``W``.

* **Block-sparse** (:class:`~sparsa.layouts.BSR` with power-of-two blocks of at least 16x16): each
  program owns a tile of tokens and one block row of ``W`` and multiplies only the stored blocks, so
  the work is proportional to the kept blocks (this is what beats dense cuBLAS at high sparsity).
  The input gradient walks the blocks column by column (a cached CSC order); the weight gradient is
  a block SDDMM (only stored blocks are computed).
* **N:M** (:class:`~sparsa.layouts.NM`, ``n`` of every ``m`` along the input dim): the weight tile is
  decompressed in registers from ``values``/``indices`` and fed to ``tl.dot``. The weight is read in
  compressed form (memory traffic ``n/m`` of dense), but the tensor-core work is dense, so this pays in
  the memory-bound regime (few tokens); for 2:4 on Ampere+ the semi-structured path
  (:mod:`sparsa.gpu.semi_structured`) uses the sparse tensor cores instead.

All functions take 2-D ``x`` (tokens, in) and return plain tensors; the weight gradient is returned as
a dense ``(out, in)`` tensor that is zero outside the stored pattern (what the dispatcher expects).

Example (on a GPU, or on the CPU with ``TRITON_INTERPRET=1``)::

    >>> import torch, sparsa
    >>> from sparsa.gpu.weight_sparse import bsr_linear
    >>> w = sparsa.layouts.BSR.from_dense(torch.randn(64, 64), blocksize=(16, 16))
    >>> y = bsr_linear(torch.randn(8, 64), w)                      # doctest: +SKIP
"""

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from ._launch import check_kernel_tensor, dot_flags, launch_opts
from ._triton import LazyKernel, interpreting, require_triton

triton = require_triton()
import triton.language as tl  # noqa: E402

__all__ = [
    "bsr_supported",
    "bsr_linear",
    "bsr_linear_forward",
    "bsr_linear_grad_input",
    "bsr_linear_grad_weight",
    "nm_linear",
    "nm_linear_forward",
    "nm_linear_grad_input",
    "nm_linear_grad_weight",
]


# =============================================================================== block-sparse kernels
@LazyKernel
def _bsr_fwd_kernel(
    x_ptr,
    crow_ptr,
    col_ptr,
    val_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BH: tl.constexpr,
    BW: tl.constexpr,
    F64: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    r = tl.program_id(1)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rh = tl.arange(0, BH)
    rw = tl.arange(0, BW)
    if F64:
        acc = tl.zeros((BM, BH), dtype=tl.float64)
    else:
        acc = tl.zeros((BM, BH), dtype=tl.float32)
    start = tl.load(crow_ptr + r)
    end = tl.load(crow_ptr + r + 1)
    for p in range(start, end):
        c = tl.load(col_ptr + p)
        kk = c * BW + rw
        xt = tl.load(x_ptr + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        wt = tl.load(val_ptr + p * (BH * BW) + rh[:, None] * BW + rw[None, :])
        if UPCAST:
            xt = xt.to(tl.float32)
            wt = wt.to(tl.float32)
        acc = tl.dot(xt, tl.trans(wt), acc, input_precision=PREC)
    nn = r * BH + rh
    if HAS_BIAS:
        acc += tl.load(b_ptr + nn, mask=nn < N, other=0.0).to(acc.dtype)[None, :]
    tl.store(
        y_ptr + rm[:, None] * N + nn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (nn[None, :] < N),
    )


@LazyKernel
def _bsr_grad_input_kernel(
    g_ptr,
    ccol_ptr,
    perm_ptr,
    row_ptr,
    val_ptr,
    gx_ptr,
    M,
    N,
    K,
    BM: tl.constexpr,
    BH: tl.constexpr,
    BW: tl.constexpr,
    F64: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    c = tl.program_id(1)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rh = tl.arange(0, BH)
    rw = tl.arange(0, BW)
    if F64:
        acc = tl.zeros((BM, BW), dtype=tl.float64)
    else:
        acc = tl.zeros((BM, BW), dtype=tl.float32)
    start = tl.load(ccol_ptr + c)
    end = tl.load(ccol_ptr + c + 1)
    for q in range(start, end):
        p = tl.load(perm_ptr + q)
        r = tl.load(row_ptr + p)
        nn = r * BH + rh
        gt = tl.load(g_ptr + rm[:, None] * N + nn[None, :], mask=(rm[:, None] < M) & (nn[None, :] < N), other=0.0)
        wt = tl.load(val_ptr + p * (BH * BW) + rh[:, None] * BW + rw[None, :])
        if UPCAST:
            gt = gt.to(tl.float32)
            wt = wt.to(tl.float32)
        acc = tl.dot(gt, wt, acc, input_precision=PREC)
    kk = c * BW + rw
    tl.store(
        gx_ptr + rm[:, None] * K + kk[None, :],
        acc.to(gx_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (kk[None, :] < K),
    )


@LazyKernel
def _bsr_grad_weight_kernel(
    g_ptr,
    x_ptr,
    row_ptr,
    col_ptr,
    gv_ptr,
    M,
    N,
    K,
    BM: tl.constexpr,
    BH: tl.constexpr,
    BW: tl.constexpr,
    F64: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
):
    p = tl.program_id(0)
    r = tl.load(row_ptr + p)
    c = tl.load(col_ptr + p)
    nn = r * BH + tl.arange(0, BH)
    kk = c * BW + tl.arange(0, BW)
    if F64:
        acc = tl.zeros((BH, BW), dtype=tl.float64)
    else:
        acc = tl.zeros((BH, BW), dtype=tl.float32)
    for m0 in range(0, M, BM):
        rm = (m0 + tl.arange(0, BM)).to(tl.int64)
        gt = tl.load(g_ptr + rm[:, None] * N + nn[None, :], mask=(rm[:, None] < M) & (nn[None, :] < N), other=0.0)
        xt = tl.load(x_ptr + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        if UPCAST:
            gt = gt.to(tl.float32)
            xt = xt.to(tl.float32)
        acc = tl.dot(tl.trans(gt), xt, acc, input_precision=PREC)
    rh = tl.arange(0, BH)
    rw = tl.arange(0, BW)
    tl.store(gv_ptr + p * (BH * BW) + rh[:, None] * BW + rw[None, :], acc.to(gv_ptr.dtype.element_ty))


# =============================================================================== N:M kernels
@LazyKernel
def _nm_fwd_kernel(
    x_ptr,
    v_ptr,
    i_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    G,
    HAS_BIAS: tl.constexpr,
    KEEP: tl.constexpr,
    GROUP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    F64: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    rk = tl.arange(0, BK)
    if F64:
        acc = tl.zeros((BM, BN), dtype=tl.float64)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        xt = tl.load(x_ptr + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        # decompress the (BN, BK) weight tile from the n stored values per group of m
        valid = (rn[:, None] < N) & (kk[None, :] < K)
        base = rn[:, None] * (G * KEEP) + (kk // GROUP)[None, :] * KEEP
        pos = (kk % GROUP)[None, :]
        wt = tl.zeros((BN, BK), dtype=v_ptr.dtype.element_ty)
        for j in tl.static_range(KEEP):
            v = tl.load(v_ptr + base + j, mask=valid, other=0.0)
            ix = tl.load(i_ptr + base + j, mask=valid, other=0).to(tl.int32)
            wt = tl.where(ix == pos, v, wt)
        if UPCAST:
            xt = xt.to(tl.float32)
            wt = wt.to(tl.float32)
        acc = tl.dot(xt, tl.trans(wt), acc, input_precision=PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(acc.dtype)[None, :]
    tl.store(
        y_ptr + rm[:, None] * N + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


@LazyKernel
def _nm_grad_input_kernel(
    g_ptr,
    v_ptr,
    i_ptr,
    gx_ptr,
    M,
    N,
    K,
    G,
    KEEP: tl.constexpr,
    GROUP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    F64: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    kk = (pid_k * BK + tl.arange(0, BK)).to(tl.int64)
    if F64:
        acc = tl.zeros((BM, BK), dtype=tl.float64)
    else:
        acc = tl.zeros((BM, BK), dtype=tl.float32)
    pos = (kk % GROUP)[None, :]
    for n0 in range(0, N, BN):
        rn = n0 + tl.arange(0, BN)
        gt = tl.load(g_ptr + rm[:, None] * N + rn[None, :], mask=(rm[:, None] < M) & (rn[None, :] < N), other=0.0)
        valid = (rn[:, None] < N) & (kk[None, :] < K)
        base = rn[:, None] * (G * KEEP) + (kk // GROUP)[None, :] * KEEP
        wt = tl.zeros((BN, BK), dtype=v_ptr.dtype.element_ty)
        for j in tl.static_range(KEEP):
            v = tl.load(v_ptr + base + j, mask=valid, other=0.0)
            ix = tl.load(i_ptr + base + j, mask=valid, other=0).to(tl.int32)
            wt = tl.where(ix == pos, v, wt)
        if UPCAST:
            gt = gt.to(tl.float32)
            wt = wt.to(tl.float32)
        acc = tl.dot(gt, wt, acc, input_precision=PREC)
    tl.store(
        gx_ptr + rm[:, None] * K + kk[None, :],
        acc.to(gx_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (kk[None, :] < K),
    )


@LazyKernel
def _nm_grad_weight_kernel(
    g_ptr,
    x_ptr,
    i_ptr,
    gw_ptr,
    M,
    N,
    K,
    G,
    KEEP: tl.constexpr,
    GROUP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    F64: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    kk = (pid_k * BK + tl.arange(0, BK)).to(tl.int64)
    if F64:
        acc = tl.zeros((BN, BK), dtype=tl.float64)
    else:
        acc = tl.zeros((BN, BK), dtype=tl.float32)
    for m0 in range(0, M, BM):
        rm = m0 + tl.arange(0, BM)
        gt = tl.load(g_ptr + rm[:, None] * N + rn[None, :], mask=(rm[:, None] < M) & (rn[None, :] < N), other=0.0)
        xt = tl.load(x_ptr + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        if UPCAST:
            gt = gt.to(tl.float32)
            xt = xt.to(tl.float32)
        acc = tl.dot(tl.trans(gt), xt, acc, input_precision=PREC)
    valid = (rn[:, None] < N) & (kk[None, :] < K)
    base = rn[:, None] * (G * KEEP) + (kk // GROUP)[None, :] * KEEP
    pos = (kk % GROUP)[None, :]
    keep = tl.zeros((BN, BK), dtype=tl.int32)
    for j in tl.static_range(KEEP):
        ix = tl.load(i_ptr + base + j, mask=valid, other=GROUP).to(tl.int32)
        keep = tl.where(ix == pos, 1, keep)
    acc = tl.where(keep != 0, acc, 0.0)
    tl.store(gw_ptr + rn[:, None] * K + kk[None, :], acc.to(gw_ptr.dtype.element_ty), mask=valid)


# =============================================================================== wrappers
def _tiles() -> Tuple[int, int, int]:
    """(BM, BN, BK): small tiles under the interpreter (fast tests), GPU-sized otherwise."""
    return (16, 32, 32) if interpreting() else (64, 64, 64)


def _check_x(x: Tensor, k: int, dtype: torch.dtype, arg: str = "x") -> None:
    check_kernel_tensor(x, arg)
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{arg} must be 2-D (tokens, {k}), got shape {tuple(x.shape)}; reshape it to (-1, {k}) first")
    if x.dtype != dtype:
        raise TypeError(f"{arg} has dtype {x.dtype} but the weight is {dtype}; convert one of them")


def bsr_supported(layout) -> bool:
    """True when the BSR layout's blocks fit the kernels: power-of-two sides, each at least 16."""
    bh, bw = layout.blocksize
    return all(b >= 16 and b & (b - 1) == 0 for b in (bh, bw))


def _bsr_check(layout) -> Tuple[int, int]:
    if not bsr_supported(layout):
        raise ValueError(
            f"layout.blocksize is {tuple(layout.blocksize)}; the Triton BSR kernels need power-of-two "
            "block sides >= 16 (e.g. BSR.from_dense(w, blocksize=(32, 32)))"
        )
    return layout.blocksize


def _bsr_pattern(layout) -> Tuple[Tensor, Tensor, Tensor]:
    """(block row of every stored block, CSC pointer over block cols, CSC order of blocks); cached."""
    cache = layout.__dict__.setdefault("_gpu_cache", {})
    hit = cache.get("pattern")
    if hit is not None and hit[0].device == layout.values.device:
        return hit
    crow, col = layout.crow_indices, layout.col_indices
    n_br, n_bc = layout.grid
    rows = torch.repeat_interleave(torch.arange(n_br, device=crow.device), crow[1:] - crow[:-1])
    perm = torch.argsort(col, stable=True)
    ccol = torch.zeros(n_bc + 1, dtype=torch.int64, device=crow.device)
    ccol[1:] = torch.cumsum(torch.bincount(col, minlength=n_bc), 0)
    hit = cache["pattern"] = (rows.contiguous(), ccol, perm.contiguous())
    return hit


def bsr_linear_forward(x: Tensor, layout, bias: Optional[Tensor] = None) -> Tensor:
    """``x @ W^T + bias`` for a BSR weight ``W`` (out, in); ``x`` is 2-D (tokens, in)."""
    bh, bw = _bsr_check(layout)
    n, k = layout.shape
    _check_x(x, k, layout.dtype)
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    bm = _tiles()[0] if interpreting() else 128
    grid = (triton.cdiv(m, bm), layout.grid[0])
    b = bias.contiguous() if bias is not None else y
    _bsr_fwd_kernel[grid](
        x,
        layout.crow_indices,
        layout.col_indices,
        layout.values.contiguous(),
        b,
        y,
        m,
        n,
        k,
        HAS_BIAS=bias is not None,
        BM=bm,
        BH=bh,
        BW=bw,
        **dot_flags(x.dtype),
        **launch_opts(4 if bh * bw <= 1024 else 8, 3),
    )
    return y


def bsr_linear_grad_input(grad: Tensor, layout) -> Tensor:
    """``grad @ W`` (tokens, in) for a BSR weight; ``grad`` is 2-D (tokens, out)."""
    bh, bw = _bsr_check(layout)
    n, k = layout.shape
    _check_x(grad, n, layout.dtype, "grad")
    grad = grad.contiguous()
    m = grad.shape[0]
    gx = torch.empty(m, k, dtype=grad.dtype, device=grad.device)
    if m == 0 or k == 0:
        return gx
    rows, ccol, perm = _bsr_pattern(layout)
    bm = _tiles()[0] if interpreting() else 128
    grid = (triton.cdiv(m, bm), layout.grid[1])
    _bsr_grad_input_kernel[grid](
        grad,
        ccol,
        perm,
        rows,
        layout.values.contiguous(),
        gx,
        m,
        n,
        k,
        BM=bm,
        BH=bh,
        BW=bw,
        **dot_flags(grad.dtype),
        **launch_opts(),
    )
    return gx


def bsr_linear_grad_weight(grad: Tensor, x: Tensor, layout) -> Tensor:
    """``grad^T @ x`` restricted to the stored pattern, as a dense (out, in) tensor."""
    bh, bw = _bsr_check(layout)
    n, k = layout.shape
    _check_x(grad, n, layout.dtype, "grad")
    _check_x(x, k, layout.dtype)
    grad, x = grad.contiguous(), x.contiguous()
    m = x.shape[0]
    nblk = layout.values.shape[0]
    gv = torch.zeros(nblk, bh, bw, dtype=x.dtype, device=x.device)
    if nblk and m:
        rows, _, _ = _bsr_pattern(layout)
        bm = _tiles()[0] if interpreting() else 64
        _bsr_grad_weight_kernel[(nblk,)](
            grad, x, rows, layout.col_indices, gv, m, n, k, BM=bm, BH=bh, BW=bw, **dot_flags(x.dtype), **launch_opts()
        )
    gv = gv * layout.block_mask.to(gv.dtype)
    n_br, n_bc = layout.grid
    dense = torch.zeros(n_br, n_bc, bh, bw, dtype=gv.dtype, device=gv.device)
    rows, _, _ = _bsr_pattern(layout)
    dense[rows, layout.col_indices] = gv
    return dense.permute(0, 2, 1, 3).reshape(n_br * bh, n_bc * bw)[:n, :k]


def bsr_linear(x: Tensor, layout, bias: Optional[Tensor] = None) -> Tensor:
    """Inference ``F.linear(x, W, bias)`` for a BSR weight; ``x`` may have any leading dims."""
    lead = x.shape[:-1]
    y = bsr_linear_forward(x.reshape(-1, x.shape[-1]), layout, bias)
    return y.reshape(*lead, y.shape[-1])


def _nm_parts(layout) -> Tuple[Tensor, Tensor, int, int, int]:
    if len(layout.shape) != 2:
        raise ValueError(f"the N:M weight must be 2-D (out, in), got shape {tuple(layout.shape)}")
    n_out, k = layout.shape
    g = math.ceil(k / layout.m) if k else 0
    return layout.values.contiguous(), layout.indices.contiguous(), n_out, k, g


def nm_linear_forward(x: Tensor, layout, bias: Optional[Tensor] = None) -> Tensor:
    """``x @ W^T + bias`` for an N:M weight ``W`` (out, in); ``x`` is 2-D (tokens, in)."""
    v, ix, n, k, g = _nm_parts(layout)
    _check_x(x, k, layout.dtype)
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_() + (bias if bias is not None else 0)
    bm, bn, bk = _tiles()
    if not interpreting():
        bm = 128 if m >= 128 else 64
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    b = bias.contiguous() if bias is not None else y
    _nm_fwd_kernel[grid](
        x,
        v,
        ix,
        b,
        y,
        m,
        n,
        k,
        g,
        HAS_BIAS=bias is not None,
        KEEP=layout.n,
        GROUP=layout.m,
        BM=bm,
        BN=bn,
        BK=bk,
        **dot_flags(x.dtype),
        **launch_opts(),
    )
    return y


def nm_linear_grad_input(grad: Tensor, layout) -> Tensor:
    """``grad @ W`` (tokens, in) for an N:M weight."""
    v, ix, n, k, g = _nm_parts(layout)
    _check_x(grad, n, layout.dtype, "grad")
    grad = grad.contiguous()
    m = grad.shape[0]
    gx = torch.zeros(m, k, dtype=grad.dtype, device=grad.device)
    if m == 0 or k == 0 or n == 0:
        return gx
    bm, bn, bk = _tiles()
    grid = (triton.cdiv(m, bm), triton.cdiv(k, bk))
    _nm_grad_input_kernel[grid](
        grad,
        v,
        ix,
        gx,
        m,
        n,
        k,
        g,
        KEEP=layout.n,
        GROUP=layout.m,
        BM=bm,
        BN=bn,
        BK=bk,
        **dot_flags(grad.dtype),
        **launch_opts(),
    )
    return gx


def nm_linear_grad_weight(grad: Tensor, x: Tensor, layout) -> Tensor:
    """``grad^T @ x`` restricted to the stored N:M positions, as a dense (out, in) tensor."""
    _, ix, n, k, g = _nm_parts(layout)
    _check_x(grad, n, layout.dtype, "grad")
    _check_x(x, k, layout.dtype)
    grad, x = grad.contiguous(), x.contiguous()
    m = x.shape[0]
    gw = torch.zeros(n, k, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0 or k == 0:
        return gw
    bm, bn, bk = _tiles()
    grid = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    _nm_grad_weight_kernel[grid](
        grad,
        x,
        ix,
        gw,
        m,
        n,
        k,
        g,
        KEEP=layout.n,
        GROUP=layout.m,
        BM=bm,
        BN=bn,
        BK=bk,
        **dot_flags(x.dtype),
        **launch_opts(),
    )
    return gw


def nm_linear(x: Tensor, layout, bias: Optional[Tensor] = None) -> Tensor:
    """Inference ``F.linear(x, W, bias)`` for an N:M weight; ``x`` may have any leading dims."""
    lead = x.shape[:-1]
    y = nm_linear_forward(x.reshape(-1, x.shape[-1]), layout, bias)
    return y.reshape(*lead, y.shape[-1])
