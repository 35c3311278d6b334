"""``sparsa::row_group_linear``: Y = X W^T + b with W in the RowGroup layout.

A ``torch.library`` custom op with a fake implementation (so it traces under ``torch.compile``) and
an autograd formula, around the native AVX2/FMA + OpenMP kernel in ``csrc/row_group_linear.cpp``
(AVX-512 tiles chosen at run time when the CPU has them; ``SPARSA_ISA=avx2`` keeps the AVX2 ones).
float32 and bfloat16 operands (fp32 accumulation, the output rounded once): bf16 with 16 tokens or
more runs AMX tiles (groups of 4 to 32; 4 and 8 fill 16-row tiles partly) where the CPU has AMX-BF16
(:func:`has_amx`), VDPBF16PS tiles for groups of 4 to 32 where it has AVX512-BF16 (:func:`has_dpbf16`),
otherwise bf16 weights are widened in registers. ``activation="gelu"`` applies GELU in the kernel's
epilogue, after the bias. When the kernel cannot be built, or ``SPARSA_NO_NATIVE=1``, the same op runs
:func:`row_group_linear_reference` (gather + batched matmul).

Example::

    >>> import torch
    >>> from sparsa.layouts import RowGroup
    >>> from sparsa.kernels.row_group import row_group_linear
    >>> w = RowGroup.from_dense(torch.randn(20, 30), group=8, sparsity=0.5)
    >>> x = torch.randn(5, 30)
    >>> y = row_group_linear(x, w.columns, w.values, None, 20)
    >>> torch.allclose(y, x @ w.to_dense().T, atol=1e-4)
    True
"""

from __future__ import annotations

import ctypes
import warnings
from typing import Optional, Tuple

import torch
import torch.utils.weak
from torch import Tensor

from . import loader
from .epilogue import ACTIVATIONS, activate, activation_backward, activation_code
from .operands import REDUCED_DTYPES, float_bias, native_kind, token_rows, version_key
from .opdef import kernel_op

__all__ = [
    "row_group_linear",
    "row_group_linear_kernel",
    "row_group_linear_impl",
    "row_group_linear_reference",
    "native_library",
    "native_kind",
    "has_dpbf16",
    "has_amx",
    "amx_pack",
    "amx_status",
    "emulated_amx_library",
    "ACTIVATIONS",
]


_SOURCES = ["row_group_linear.cpp"]


#: fewest tokens for the AMX (and VDPBF16PS) tiles, as ``kDpMinTokens`` in the kernel: fewer run the widening
#: tiles, which read the values, so no AMX pack is made for them
AMX_MIN_TOKENS = 16


def native_library() -> Optional[ctypes.CDLL]:
    """The native kernel library, or None when the fallback must run."""
    return loader.load("row_group_linear", _SOURCES)  # typed by abi.SIGNATURES["row_group_linear"]


def has_dpbf16() -> bool:
    """Whether bfloat16 calls with 16 tokens or more run the AVX512-BF16 dot-product tiles here (CPU,
    build and ``SPARSA_ISA``)."""
    lib = native_library()
    return lib is not None and bool(lib.sparsa_row_group_has_dpbf16())


#: why the AMX tiles cannot run, by ``sparsa_row_group_amx_status`` code
_AMX_STATUS = {
    0: "ok",
    1: "this CPU has no amx_bf16 (or no AVX-512)",
    2: "the OS refused this process the AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM)",
    3: "the AMX tiles failed their self-check (a wrong product on a fixed example); the AVX512-BF16 tiles run",
}


#: status codes already warned about (once per process)
_AMX_WARNED: set = set()


def amx_status(lib: Optional[ctypes.CDLL] = None) -> str:
    """``"ok"`` when this CPU and OS run the AMX tiles (whatever ``SPARSA_ISA`` says), else why not."""
    lib = lib or native_library()
    if lib is None:
        return "no native kernel (SPARSA_NO_NATIVE, SPARSA_ISA=portable or no compiler)"
    return _AMX_STATUS[int(lib.sparsa_row_group_amx_status())]


def has_amx() -> bool:
    """Whether bfloat16 calls with 16 tokens or more run the AMX tiles here (every group size; CPU,
    the OS's tile permission, the tiles' self-check, build and ``SPARSA_ISA``). On a CPU with AMX where
    they cannot run, a warning says why, once."""
    lib = native_library()
    if lib is None:
        return False
    if lib.sparsa_row_group_has_amx():
        return True
    code = int(lib.sparsa_row_group_amx_status())
    if code >= 2 and code not in _AMX_WARNED:
        _AMX_WARNED.add(code)
        warnings.warn(f"sparsa row_group: {_AMX_STATUS[code]}", RuntimeWarning, stacklevel=2)
    return False


def emulated_amx_library() -> Optional[ctypes.CDLL]:
    """The same kernels with software AMX tiles (a test build: AMX's data layout and arithmetic in plain
    C++), so the AMX path's packing and epilogue are checked on CPUs with AVX-512 but without AMX."""
    return loader.load("row_group_linear_amxemu", ["row_group_linear_amxemu.cpp"])


def row_group_linear_reference(
    x: Tensor,
    columns: Tensor,
    values: Tensor,
    bias: Optional[Tensor],
    out_features: int,
    row_perm: Optional[Tensor] = None,
    activation: str = "none",
) -> Tensor:
    """Pure-PyTorch semantics of the kernel: ``x[..., K] -> y[..., out_features]`` in ``x``'s dtype (slot
    ``s`` of the groups is output ``row_perm[s]``; None: consecutive rows). For bfloat16/float16 ``x`` it
    computes in float32 and rounds the result once, as the kernel does."""
    activation_code(activation, "row_group_linear")
    if x.dtype in REDUCED_DTYPES:
        y = row_group_linear_reference(
            x.float(),
            columns,
            values.float(),
            None if bias is None else bias.float(),
            out_features,
            row_perm,
            activation,
        )
        return y.to(x.dtype)
    ng, k, G = values.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    xg = x2[:, columns.reshape(-1).long()].view(-1, ng, k).transpose(0, 1)  # (ng, T, k)
    y = torch.bmm(xg, values.to(x2.dtype)).transpose(0, 1).reshape(x2.shape[0], ng * G)
    if row_perm is not None:
        y = y.new_empty(y.shape).index_copy_(1, row_perm.long(), y)
    y = y[:, :out_features]
    if bias is not None:
        y = y + bias.to(y.dtype)
    return activate(y, activation).reshape(*lead, out_features)


#: the attribute of a ``values`` tensor that keeps its AMX tile pack: (validity key, pack tensor, offset of
#: its 64-byte boundary); an attribute, not a weak dictionary, because the lookup is on every call's path
_PACK_ATTR = "_sparsa_amx_pack"


def amx_pack(lib: ctypes.CDLL, values: Tensor) -> Optional[Tuple[Tensor, int]]:
    """``values`` (bf16, ``(ng, k, G)``) in the order the AMX tiles read, as a buffer and the byte offset of its
    64-byte aligned start (hold the buffer while the kernel runs), or None where the tiles do not run for it
    (no AMX here, or a group size the tiles do not take).

    Made once per weight and kept while ``values`` is unchanged (its data pointer and version are the key,
    so an in-place update makes a new one), so a call does not reorder the weight again: a copy of the kept
    values, padded to whole 32-column blocks. Inference tensors, which have no version counter, get a
    fresh pack on every call. Keyed by library too: a test build with software tiles packs its own."""
    version = version_key(values)
    key = None if version is None else (id(lib), *version)
    hit = getattr(values, _PACK_ATTR, None) if key is not None else None
    if hit is not None and hit[0] == key:  # before any ctypes call: this is every call's path
        return hit[1], hit[2]
    ng, k, G = values.shape
    size = int(lib.sparsa_row_group_amx_pack_size(ng, k, G))
    if size == 0:
        return None
    v = values.contiguous()
    buf = torch.empty(size + 32, dtype=torch.bfloat16)  # 32 spare elements: room to start at 64 bytes
    off = (-buf.data_ptr()) % 64
    if lib.sparsa_row_group_amx_pack(v.data_ptr(), ng, k, G, buf.data_ptr() + off, torch.get_num_threads()) != 0:
        raise RuntimeError(f"row_group_linear: the AMX pack of a ({ng}, {k}, {G}) weight failed")
    if key is not None:
        setattr(values, _PACK_ATTR, (key, buf, off))
    return buf, off


def _native_forward(
    lib: ctypes.CDLL,
    kind: str,
    x: Tensor,
    columns: Tensor,
    values: Tensor,
    bias: Optional[Tensor],
    out_features: int,
    row_perm: Optional[Tensor],
    act: int,
) -> Tensor:
    ng, k, G = values.shape
    K = x.shape[-1]
    x2, T, y = token_rows(x, out_features)
    if T == 0 or out_features == 0:
        return y
    cols = columns.contiguous()
    vals = values.contiguous()
    # the kernels add a float bias before rounding
    b = None if bias is None else float_bias(bias, ng * G, holder=values)
    perm = None if row_perm is None else row_perm.to(torch.int32).contiguous()
    fn = lib.sparsa_row_group_linear_bf16 if kind == "bf16" else lib.sparsa_row_group_linear_f32
    extra = ()
    packed = getattr(lib, "sparsa_row_group_linear_bf16_packed", None)  # None: an older build (row_group_ab)
    if kind == "bf16" and packed is not None and T >= AMX_MIN_TOKENS:
        pack = amx_pack(lib, vals)  # held until the call returns
        if pack is not None:
            fn, extra = packed, (pack[0].data_ptr() + pack[1],)
    rc = fn(
        x2.data_ptr(),
        T,
        K,
        cols.data_ptr(),
        vals.data_ptr(),
        ng,
        k,
        G,
        None if b is None else b.data_ptr(),
        y.data_ptr(),
        out_features,
        None if perm is None else perm.data_ptr(),
        torch.get_num_threads(),
        act,
        *extra,
    )
    if rc != 0:
        raise ValueError(f"row_group_linear: unsupported group size {G}; use one of 4, 8, 16, 32")
    return y


def row_group_linear_impl(
    x: Tensor,
    columns: Tensor,
    values: Tensor,
    bias: Optional[Tensor],
    out_features: int,
    row_perm: Optional[Tensor] = None,
    activation: str = "none",
) -> Tensor:
    """Eager implementation (what the custom op runs): the native kernel for float32 or bfloat16 CPU
    operands when it is available, else the reference."""
    act = activation_code(activation, "row_group_linear")
    kind = native_kind(x, values, bias)
    lib = None if kind is None else native_library()
    if lib is None:
        return row_group_linear_reference(x, columns, values, bias, out_features, row_perm, activation).contiguous()
    return _native_forward(lib, kind, x, columns, values, bias, out_features, row_perm, act)


@torch.library.custom_op("sparsa::row_group_linear", mutates_args=())
def row_group_linear(
    x: Tensor,
    columns: Tensor,
    values: Tensor,
    bias: Optional[Tensor],
    out_features: int,
    row_perm: Optional[Tensor] = None,
    activation: str = "none",
) -> Tensor:
    """``y[..., R] = act(x[..., K] @ W.T + bias)`` for W given by RowGroup ``columns``/``values``/``row_perm``."""
    return row_group_linear_impl(x, columns, values, bias, out_features, row_perm, activation)


@row_group_linear.register_fake
def _forward_fake(x, columns, values, bias, out_features, row_perm=None, activation="none"):
    return x.new_empty(*x.shape[:-1], out_features)


# forward-only, low per-call cost (see kernels/opdef.py): the hot path of an autograd.Function that owns the backward
row_group_linear_kernel = kernel_op(
    "row_group_linear_kernel(Tensor x, Tensor columns, Tensor values, Tensor? bias, int out_features, "
    "Tensor? row_perm=None, str activation='none') -> Tensor",
    row_group_linear_impl,
    _forward_fake,
)


def _slot_grads(g2: Tensor, n_groups: int, group: int, row_perm: Optional[Tensor]) -> Tensor:
    """``grad_y`` columns in slot order ``(T, n_groups, group)`` (zero for padding slots)."""
    pad = n_groups * group - g2.shape[1]
    gp = g2 if pad == 0 else torch.nn.functional.pad(g2, (0, pad))
    if row_perm is not None:
        gp = gp[:, row_perm.long()]
    return gp.reshape(g2.shape[0], n_groups, group)


def row_group_grad_input(
    g2: Tensor, columns: Tensor, values: Tensor, in_features: int, row_perm: Optional[Tensor]
) -> Tensor:
    """``grad_y @ W`` as ``(T, in_features)``: one batched matmul per group, scattered to the kept columns."""
    ng, k, G = values.shape
    T = g2.shape[0]
    z = torch.bmm(_slot_grads(g2, ng, G, row_perm).transpose(0, 1), values.to(g2.dtype).transpose(1, 2))
    out = g2.new_zeros(T, in_features)
    out.index_add_(1, columns.reshape(-1).long(), z.transpose(0, 1).reshape(T, ng * k))
    return out


def row_group_grad_values(
    g2: Tensor, x2: Tensor, columns: Tensor, values: Tensor, row_perm: Optional[Tensor]
) -> Tensor:
    """``grad_y.T @ x`` on the kept pattern, in the values' shape ``(n_groups, k, group)``."""
    ng, k, G = values.shape
    T = x2.shape[0]
    xg = x2[:, columns.reshape(-1).long()].view(T, ng, k).permute(1, 2, 0)  # (ng, k, T)
    return torch.bmm(xg, _slot_grads(g2, ng, G, row_perm).transpose(0, 1))  # (ng, k, G)


def _setup_context(ctx, inputs, output):
    x, columns, values, bias, out_features, row_perm, activation = inputs
    ctx.save_for_backward(x, columns, values, bias, row_perm)
    ctx.out_features, ctx.activation = out_features, activation


def _backward(ctx, gy):
    x, columns, values, bias, row_perm = ctx.saved_tensors
    K = x.shape[-1]
    g2 = gy.reshape(-1, ctx.out_features)
    if ctx.activation != "none":  # the pre-activation is recomputed rather than kept from the forward
        pre = row_group_linear(
            x.detach(), columns, values, None if bias is None else bias.detach(), ctx.out_features, row_perm, "none"
        ).reshape(-1, ctx.out_features)
        g2 = activation_backward(pre, g2, ctx.activation)
    gx = gv = gb = None
    if ctx.needs_input_grad[0]:
        gx = row_group_grad_input(g2, columns, values, K, row_perm).reshape(x.shape).to(x.dtype)
    if ctx.needs_input_grad[2]:
        gv = row_group_grad_values(g2, x.reshape(-1, K).to(g2.dtype), columns, values, row_perm).to(values.dtype)
    if bias is not None and ctx.needs_input_grad[3]:
        gb = g2.sum(0).to(bias.dtype)
    return gx, None, gv, gb, None, None, None


row_group_linear.register_autograd(_backward, setup_context=_setup_context)
