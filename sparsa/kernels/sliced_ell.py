"""``sparsa::sliced_ell_linear``: Y = X W^T + b with W in the SlicedELL layout (very sparse weights).

A ``torch.library`` custom op (with a fake implementation for ``torch.compile`` and an autograd formula)
around the native kernel in ``csrc/sliced_ell_linear.cpp`` (tokens vectorised over a transposed X panel,
two rows at a time); when the kernel cannot be built, or ``SPARSA_NO_NATIVE=1``, the op runs
:func:`sliced_ell_linear_reference` (rebuild the dense weight, then one matmul).

Every stored entry, padding included, is a parameter of the op: entry ``e`` of slice ``s`` adds
``values[e] * x[..., columns[e]]`` to output row ``2*s + (e - slice_ptr[s]) % 2`` (dropped when that row is
``>= out_features``). The backward (:func:`sliced_ell_grad_input`, :func:`sliced_ell_grad_values`) follows
that definition, so a padding entry gets ``sum_t grad_y[t, row] * x[t, column]`` like any other.

The native kernel runs for CPU tensors with ``x`` and ``values`` both float32 (bias float32 or None), or both
bfloat16 (bias bfloat16, float32 or None): then products accumulate in float32 and the bfloat16 output is
rounded once (nearest even); where the CPU has AVX512-BF16 (:func:`has_dpbf16`), two tokens or more take
VDPBF16PS rows, which sum a row's slots in pairs. Other combinations run the reference, which for
bfloat16/float16 inputs also computes in float32 and rounds once. The output has ``x``'s dtype.

Example::

    >>> import torch
    >>> from sparsa.layouts import SlicedELL
    >>> from sparsa.kernels.sliced_ell import sliced_ell_linear
    >>> w = SlicedELL.from_dense(torch.randn(20, 30), sparsity=0.9)
    >>> x = torch.randn(5, 30)
    >>> y = sliced_ell_linear(x, w.slice_ptr, w.columns, w.values, None, 20)
    >>> torch.allclose(y, x @ w.to_dense().T, atol=1e-4)
    True
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch
import torch.utils.weak
from torch import Tensor

from . import loader
from .epilogue import activate, activation_backward, activation_code
from .operands import REDUCED_DTYPES, compute_dtype, native_kind, token_rows
from .opdef import kernel_op

__all__ = [
    "sliced_ell_linear",
    "sliced_ell_linear_kernel",
    "sliced_ell_linear_impl",
    "sliced_ell_linear_reference",
    "sliced_ell_grad_input",
    "sliced_ell_grad_values",
    "native_library",
    "native_kind",
    "chunk_bounds",
    "has_dpbf16",
    "bf16_rows",
]

_SOURCES = ["sliced_ell_linear.cpp"]


def native_library() -> Optional[ctypes.CDLL]:
    """The native kernel library, or None when the fallback must run."""
    return loader.load("sliced_ell_linear", _SOURCES)  # typed by abi.SIGNATURES["sliced_ell_linear"]


def has_dpbf16() -> bool:
    """Whether bfloat16 calls with two tokens or more can run the AVX512-BF16 dot-product rows here (CPU,
    build and ``SPARSA_ISA``); :func:`bf16_rows` says whether they do."""
    lib = native_library()
    return lib is not None and bool(lib.sparsa_sliced_ell_has_dpbf16())


#: the rows bfloat16 calls of two tokens or more can run (see :func:`bf16_rows`)
BF16_ROWS = ("dp", "fma")


def bf16_rows(density: float, rows: Optional[str] = None) -> str:
    """Which rows a bfloat16 call of two tokens or more runs on a weight of this ``density`` (stored entries
    over ``out_features * in_features``): ``"dp"`` (VDPBF16PS on pairs of slots over a bf16 panel) or ``"fma"``
    (operands widened to fp32; 16-float FMAs where AVX-512 is enabled, else 8-float ones).

    Where the CPU has AVX512-BF16, ``fma`` up to the ``sliced_ell.fma_rows_bf16`` crossover density and
    ``dp`` above it: a VDPBF16PS does twice an FMA's products, but on some cores issues at a fraction of an
    FMA's rate, and the fp32 panel the FMA rows read is twice the bf16 one's bytes. ``rows`` forces one
    (``"dp"`` runs ``fma`` where the CPU lacks AVX512-BF16)."""
    if rows is not None and rows not in BF16_ROWS:
        raise ValueError(f"sliced_ell bf16 rows: expected one of {BF16_ROWS} or None (the faster here), got {rows!r}")
    if not has_dpbf16():
        return "fma"
    if rows is not None:
        return rows
    from ..crossovers import crossover  # late: crossovers reads the cost table, which imports the kernels

    return "fma" if density <= crossover("sliced_ell.fma_rows_bf16") else "dp"


def _entry_rows(slice_ptr: Tensor, n_entries: int) -> Tensor:
    """int64 ``(P,)``: the (padded) output row of every stored entry, in ``[0, 2 * n_slices)``."""
    e = torch.arange(n_entries, device=slice_ptr.device)
    # slice of every entry (searchsorted: repeat_interleave is slow on small CPU tensors, and data-dependent)
    slice_id = torch.searchsorted(slice_ptr[1:], e, right=True)
    return 2 * slice_id + (e - slice_ptr[slice_id]) % 2


def _dense_weight(
    slice_ptr: Tensor, columns: Tensor, values: Tensor, out_features: int, in_features: int, dtype: torch.dtype
) -> Tensor:
    """The logical weight (padding entries hold zeros, so they add nothing unless changed)."""
    ns = slice_ptr.numel() - 1
    rows = _entry_rows(slice_ptr, columns.numel())
    w = torch.zeros(2 * ns, in_features, dtype=dtype, device=values.device)
    w.index_put_((rows, columns.long()), values.to(dtype), accumulate=True)
    return w[:out_features]


def sliced_ell_linear_reference(
    x: Tensor,
    slice_ptr: Tensor,
    columns: Tensor,
    values: Tensor,
    bias: Optional[Tensor],
    out_features: int,
    activation: str = "none",
) -> Tensor:
    """Pure-PyTorch semantics of the kernel: ``x[..., K] -> y[..., out_features]`` in ``x``'s dtype. For
    bfloat16/float16 ``x`` it computes in float32 (weights and bias widened, not rounded to ``x``'s dtype)
    and rounds the result once."""
    activation_code(activation, "sliced_ell_linear")
    if x.dtype in REDUCED_DTYPES:
        w = _dense_weight(slice_ptr, columns, values, out_features, x.shape[-1], torch.float32)
        b = None if bias is None else bias.to(torch.float32)
        return activate(torch.nn.functional.linear(x.to(torch.float32), w, b), activation).to(x.dtype)
    w = _dense_weight(slice_ptr, columns, values, out_features, x.shape[-1], x.dtype)
    return activate(torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype)), activation)


#: chunk bounds per ``columns`` tensor: (slice_ptr, in_features, bounds or None), computed once per weight
_CHUNK_BOUNDS: "torch.utils.weak.WeakIdKeyDictionary" = torch.utils.weak.WeakIdKeyDictionary()


def chunk_bounds(lib: ctypes.CDLL, slice_ptr: Tensor, columns: Tensor, in_features: int) -> Optional[Tensor]:
    """int32 ``(n_slices, n_chunks - 1, 2)``: where each row's slots cross into the next chunk of input
    columns, which lets the kernel keep a chunk of the activations in L1 (None when the weight is too sparse
    or too narrow for chunks to pay). Cached per ``columns`` tensor; the kernel clamps the bounds, so a stale
    entry (``columns`` changed in place) can only cost speed, never correctness."""
    hit = _CHUNK_BOUNDS.get(columns)
    if hit is not None and hit[0] is slice_ptr and hit[1] == in_features:
        return hit[2]
    sp, c = slice_ptr.contiguous(), columns.contiguous()
    ns = sp.numel() - 1
    nch = int(lib.sparsa_sliced_ell_n_chunks(in_features, sp.data_ptr(), ns))
    bounds = None
    if nch > 1:
        bounds = torch.empty(ns, nch - 1, 2, dtype=torch.int32)
        lib.sparsa_sliced_ell_chunk_bounds(sp.data_ptr(), c.data_ptr(), ns, nch, bounds.data_ptr())
    _CHUNK_BOUNDS[columns] = (slice_ptr, in_features, bounds)
    return bounds


#: the bf16 dot-product plan per ``values`` tensor: (validity key, (chunk_ptr, pairs, n_chunks))
_DP_PLANS: "torch.utils.weak.WeakIdKeyDictionary" = torch.utils.weak.WeakIdKeyDictionary()
#: widest input the plan's 16-bit columns can address (the zero row is column K)
_DP_MAX_K = 65535


def _versions(*ts: Tensor) -> Optional[tuple]:
    """(data_ptr, version) of each tensor, or None for inference tensors (they have no version counter)."""
    try:
        return tuple((t.data_ptr(), t._version) for t in ts)
    except RuntimeError:
        return None


def dp_plan(lib: ctypes.CDLL, slice_ptr: Tensor, columns: Tensor, values: Tensor, in_features: int) -> Optional[tuple]:
    """``(chunk_ptr, pairs, n_chunks)``: the bf16 dot-product rows' plan of a weight (``DpPair`` in the kernel
    source): each row's slots paired, within chunks of input columns on wide or dense enough weights, as
    their two columns and the weight pair, 8 bytes a pair (two thirds of the slots' own bytes). None when
    ``in_features`` is too wide for it (over 65535): the widening rows run then.

    Built once per weight and cached while ``slice_ptr``, ``columns`` and ``values`` are unchanged: their
    versions are part of the key, so an in-place update rebuilds it. Inference tensors, which have no version
    counter, get a fresh plan on every call."""
    if in_features > _DP_MAX_K:
        return None
    key = _versions(slice_ptr, columns, values)
    key = None if key is None else key + (in_features,)
    hit = _DP_PLANS.get(values) if key is not None else None
    if hit is not None and hit[0] == key:
        return hit[1]
    sp, c, v = slice_ptr.contiguous(), columns.contiguous(), values.contiguous()
    ns = sp.numel() - 1
    nch = int(lib.sparsa_sliced_ell_dp_chunks(sp.data_ptr(), ns, in_features))
    chunk_ptr = torch.empty(nch * (ns + 1), dtype=torch.int64)
    args = (sp.data_ptr(), c.data_ptr(), v.data_ptr(), ns, in_features, nch, chunk_ptr.data_ptr())
    lib.sparsa_sliced_ell_dp_plan(*args, None)
    pairs = torch.empty(int(chunk_ptr[-1]), 2, dtype=torch.int32)  # (column | column << 16, weight pair)
    lib.sparsa_sliced_ell_dp_plan(*args, pairs.data_ptr())
    plan = (chunk_ptr, pairs, nch)
    if key is not None:
        _DP_PLANS[values] = (key, plan)
    return plan


def _native_forward(
    lib: ctypes.CDLL,
    kind: str,
    x: Tensor,
    slice_ptr: Tensor,
    columns: Tensor,
    values: Tensor,
    bias: Optional[Tensor],
    out_features: int,
    act: int,
    chunked: bool = True,
    rows: Optional[str] = None,
) -> Tensor:
    K = x.shape[-1]
    x2, T, y = token_rows(x, out_features)
    if T > 0 and out_features > 0:
        sp, c, v = slice_ptr.contiguous(), columns.contiguous(), values.contiguous()
        b = None if bias is None else bias.contiguous()
        bp = None if b is None else b.data_ptr()
        # the bf16 dot-product rows read their plan; the K-chunk bounds are for the other rows only
        dp = False
        if kind == "bf16" and T > 1:  # the import only where the rows are chosen: not on a decode call
            from ..crossovers import nominal_density  # late, as in bf16_rows

            dp = bf16_rows(nominal_density(values.numel(), out_features * K), rows) == "dp"
        plan = dp_plan(lib, slice_ptr, columns, values, K) if dp else None
        chunk_ptr, pairs, plan_nch = (None, None, 1) if plan is None else plan
        bounds = chunk_bounds(lib, slice_ptr, columns, K) if chunked and T > 1 and plan is None else None
        bnd, nch = (None, 1) if bounds is None else (bounds.data_ptr(), bounds.shape[1] + 1)
        if kind == "bf16":
            lib.sparsa_sliced_ell_linear_bf16(
                x2.data_ptr(),
                T,
                K,
                sp.data_ptr(),
                c.data_ptr(),
                v.data_ptr(),
                bnd,
                nch,
                out_features,
                bp,
                int(b is not None and b.dtype == torch.bfloat16),
                y.data_ptr(),
                torch.get_num_threads(),
                act,
                None if chunk_ptr is None else chunk_ptr.data_ptr(),
                None if pairs is None else pairs.data_ptr(),
                plan_nch,
            )
        else:
            lib.sparsa_sliced_ell_linear_f32(
                x2.data_ptr(),
                T,
                K,
                sp.data_ptr(),
                c.data_ptr(),
                v.data_ptr(),
                bnd,
                nch,
                out_features,
                bp,
                y.data_ptr(),
                torch.get_num_threads(),
                act,
            )
    return y


def sliced_ell_linear_impl(
    x: Tensor,
    slice_ptr: Tensor,
    columns: Tensor,
    values: Tensor,
    bias: Optional[Tensor],
    out_features: int,
    activation: str = "none",
    rows: Optional[str] = None,
) -> Tensor:
    """Eager implementation (what the custom op runs): native kernel if possible, else the reference.
    ``rows``: force the rows of bf16 calls (:func:`bf16_rows`; the crossover picks them when None)."""
    act = activation_code(activation, "sliced_ell_linear")
    kind = native_kind(x, values, bias)
    lib = None if kind is None else native_library()
    if lib is None:
        return sliced_ell_linear_reference(x, slice_ptr, columns, values, bias, out_features, activation).contiguous()
    return _native_forward(lib, kind, x, slice_ptr, columns, values, bias, out_features, act, rows=rows)


@torch.library.custom_op("sparsa::sliced_ell_linear", mutates_args=())
def sliced_ell_linear(
    x: Tensor,
    slice_ptr: Tensor,
    columns: Tensor,
    values: Tensor,
    bias: Optional[Tensor],
    out_features: int,
    activation: str = "none",
) -> Tensor:
    """``y[..., R] = act(x[..., K] @ W.T + bias)`` for W given by SlicedELL components."""
    return sliced_ell_linear_impl(x, slice_ptr, columns, values, bias, out_features, activation)


@sliced_ell_linear.register_fake
def _forward_fake(x, slice_ptr, columns, values, bias, out_features, activation="none"):
    return x.new_empty(*x.shape[:-1], out_features)


# forward-only, low per-call cost (see kernels/opdef.py): the hot path of an autograd.Function that owns the backward
sliced_ell_linear_kernel = kernel_op(
    "sliced_ell_linear_kernel(Tensor x, Tensor slice_ptr, Tensor columns, Tensor values, Tensor? bias, "
    "int out_features, str activation='none') -> Tensor",
    sliced_ell_linear_impl,
    _forward_fake,
)


# ---------------------------------------------------------------------------------------------- autograd
#: stored entries per element of the weight above which the backward uses dense BLAS products; the
#: gathered products below it only pay off when extremely sparse (figures in docs/benchmarks.md)
_DENSE_BACKWARD = 1 / 256
#: elements of a ``(tokens, entries)`` temporary per chunk in the sparse backward
_CHUNK = 1 << 22


def _padded_rows(g2: Tensor, n_slices: int) -> Tensor:
    """``grad_y`` with zero columns up to ``2 * n_slices`` rows (the last slice of an odd R)."""
    pad = 2 * n_slices - g2.shape[1]
    return g2 if pad == 0 else torch.nn.functional.pad(g2, (0, pad))


def sliced_ell_grad_input(g2: Tensor, slice_ptr: Tensor, columns: Tensor, values: Tensor, in_features: int) -> Tensor:
    """``grad_y @ W`` as ``(T, in_features)`` in ``g2``'s dtype, ``g2`` being ``(T, out_features)``; every
    stored entry counts (padding too)."""
    R = g2.shape[1]
    P = columns.numel()
    if P > _DENSE_BACKWARD * R * in_features:
        return g2 @ _dense_weight(slice_ptr, columns, values, R, in_features, g2.dtype)
    T = g2.shape[0]
    gp = _padded_rows(g2, slice_ptr.numel() - 1)
    rows, cols, vals = _entry_rows(slice_ptr, P), columns.long(), values.to(g2.dtype)
    out = g2.new_zeros(T, in_features)
    step = max(1, _CHUNK // max(T, 1))
    for i in range(0, P, step):
        out.index_add_(1, cols[i : i + step], gp[:, rows[i : i + step]] * vals[i : i + step])
    return out


def sliced_ell_grad_values(g2: Tensor, x2: Tensor, slice_ptr: Tensor, columns: Tensor) -> Tensor:
    """``(P,)``: ``sum_t grad_y[t, row(e)] * x[t, columns[e]]`` for every stored entry ``e`` (padding too; zero
    for the missing row of an odd ``out_features``), in the dtype of ``g2`` and ``x2`` (both ``(T, .)``)."""
    R, K = g2.shape[1], x2.shape[1]
    P = columns.numel()
    gp = _padded_rows(g2, slice_ptr.numel() - 1)
    rows, cols = _entry_rows(slice_ptr, P), columns.long()
    if P > _DENSE_BACKWARD * R * K:
        return (gp.t() @ x2)[rows, cols]
    T = g2.shape[0]
    out = g2.new_empty(P)
    step = max(1, _CHUNK // max(T, 1))
    for i in range(0, P, step):
        out[i : i + step] = (gp[:, rows[i : i + step]] * x2[:, cols[i : i + step]]).sum(0)
    return out


def _setup_context(ctx, inputs, output):
    x, slice_ptr, columns, values, bias, out_features, activation = inputs
    ctx.save_for_backward(x, slice_ptr, columns, values, bias if activation != "none" else None)
    ctx.out_features, ctx.activation = out_features, activation
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, gy):
    x, slice_ptr, columns, values, bias = ctx.saved_tensors
    K = x.shape[-1]
    ct = compute_dtype(gy.dtype, x.dtype, values.dtype)
    g2 = gy.reshape(-1, ctx.out_features).to(ct)
    if ctx.activation != "none":  # the pre-activation is recomputed rather than kept from the forward
        pre = sliced_ell_linear(
            x.detach(),
            slice_ptr,
            columns,
            values.detach(),
            None if bias is None else bias.detach(),
            ctx.out_features,
            "none",
        )
        g2 = activation_backward(pre.reshape(-1, ctx.out_features).to(ct), g2, ctx.activation)
    gx = gv = gb = None
    if ctx.needs_input_grad[0]:
        gx = sliced_ell_grad_input(g2, slice_ptr, columns, values, K).reshape(x.shape).to(x.dtype)
    if ctx.needs_input_grad[3]:
        gv = sliced_ell_grad_values(g2, x.reshape(-1, K).to(ct), slice_ptr, columns).to(values.dtype)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[4]:
        gb = g2.sum(0).to(ctx.bias_dtype)
    return gx, None, None, gv, gb, None, None


sliced_ell_linear.register_autograd(_backward, setup_context=_setup_context)
