"""The C ABI of sparsa's native kernel libraries: one typed table per library.

Every ``extern "C"`` function that Python calls is declared here once, by name, with its return type
and its named, typed arguments (the C prototypes in ``csrc/``, argument for argument).
:func:`sparsa.kernels.loader.load` binds the table of a library when it opens it and raises a
RuntimeError naming the library, the function and the fix if a function is missing. The kernels
are called only from the implementations of the ``sparsa::`` custom ops.

Example::

    >>> from sparsa.kernels import abi
    >>> abi.SIGNATURES["row_group_linear"]["sparsa_row_group_linear_f32"].args[0]
    ('x', <class 'ctypes.c_void_p'>)
"""

from __future__ import annotations

import ctypes
from typing import Dict, NamedTuple, Optional, Tuple

from .geometry import ConvGeoC

__all__ = ["Signature", "SIGNATURES", "PTR", "I64", "INT", "GEO", "I64S", "sig"]

PTR = ctypes.c_void_p  # a tensor's data_ptr() (or None for an absent optional tensor)
I64 = ctypes.c_int64
INT = ctypes.c_int
GEO = ctypes.POINTER(ConvGeoC)  # const int64_t* g: the conv geometry (pass ConvGeometry.c())
I64S = ctypes.POINTER(ctypes.c_int64)  # a few int64 (strides, pads): pass (ctypes.c_int64 * n)(...)


class Signature(NamedTuple):
    restype: Optional[type]
    args: Tuple[Tuple[str, type], ...]


def sig(restype: Optional[type], **args: type) -> Signature:
    """A signature from its return type and its arguments in C order (keyword order is kept)."""
    return Signature(restype, tuple(args.items()))


# the compaction entry points (ReLU, signed, zeroed) share one argument list
_COMPACT = sig(
    I64,
    x=PTR,
    N=I64,
    C=I64,
    H=I64,
    W=I64,
    sn=I64,
    sc=I64,
    sh=I64,
    sw=I64,
    CS=I64,
    cnt=PTR,
    idx=PTR,
    val=PTR,
    nthreads=INT,
)

_ADAPTIVE = {
    # adaptive_compact.cpp
    "sparsa_adaptive_compact_f32": _COMPACT,
    "sparsa_adaptive_compact_signed_f32": _COMPACT,
    "sparsa_adaptive_compact_zeroed_f32": _COMPACT,
    "sparsa_adaptive_mask_f32": sig(
        None, y=PTR, N=I64, C=I64, H=I64, W=I64, CS=I64, cnt=PTR, idx=PTR, dx=PTR, das=I64S, nthreads=INT
    ),
    "sparsa_adaptive_to_dense_f32": sig(
        None, N=I64, C=I64, H=I64, W=I64, CS=I64, cnt=PTR, idx=PTR, val=PTR, out=PTR, nthreads=INT
    ),
    "sparsa_adaptive_restrict_f32": sig(
        None, g=PTR, N=I64, C=I64, H=I64, W=I64, gs=I64S, CS=I64, cnt=PTR, idx=PTR, out=PTR, nthreads=INT
    ),
    "sparsa_adaptive_sample_f32": sig(None, x=PTR, base=PTR, m=I64, C=I64, sc=I64, CS=I64, out=PTR),
    # adaptive_conv.cpp
    "sparsa_adaptive_conv_fwd_f32": sig(INT, g=GEO, cnt=PTR, idx=PTR, val=PTR, wt=PTR, bias=PTR, y=PTR, nthreads=INT),
    "sparsa_adaptive_conv_wgrad_f32": sig(INT, g=GEO, cnt=PTR, idx=PTR, val=PTR, dy=PTR, dwt=PTR, nthreads=INT),
    "sparsa_adaptive_conv_igrad_f32": sig(INT, g=GEO, cnt=PTR, idx=PTR, dy=PTR, wt=PTR, da=PTR, das=I64S, nthreads=INT),
    "sparsa_adaptive_conv_fwd_packed_f32": sig(
        INT, g=GEO, cnt=PTR, idx=PTR, val=PTR, wp=PTR, bias=PTR, y=PTR, nthreads=INT
    ),
    "sparsa_adaptive_pack_weight_f32": sig(
        INT, w=PTR, ws=I64S, O=I64, C=I64, KH=I64, KW=I64, wf=PTR, wc=PTR, nthreads=INT
    ),
    "sparsa_adaptive_pack_flipped_f32": sig(INT, wc=PTR, O=I64, C=I64, KH=I64, KW=I64, wfl=PTR, nthreads=INT),
    # adaptive_bwd_s1.cpp
    "sparsa_adaptive_conv_bwd_s1_f32": sig(
        INT, g=GEO, cnt=PTR, idx=PTR, val=PTR, dyp=PTR, pads=I64S, wt=PTR, dwt=PTR, da=PTR, das=I64S, nthreads=INT
    ),
    "sparsa_adaptive_conv_bwd_s1_v2_f32": sig(
        INT, g=GEO, cnt=PTR, idx=PTR, val=PTR, dy=PTR, wc=PTR, dw=PTR, dws=I64S, da=PTR, das=I64S, nthreads=INT
    ),
    # adaptive_union.cpp
    "sparsa_union_supported": sig(INT),
    "sparsa_union_compact_f32": sig(
        I64,
        x=PTR,
        N=I64,
        C=I64,
        H=I64,
        W=I64,
        sn=I64,
        sc=I64,
        sh=I64,
        sw=I64,
        relu=INT,
        xa=PTR,
        bm=PTR,
        union4=PTR,
        nthreads=INT,
    ),
    "sparsa_union_conv_fwd_f32": sig(
        INT, g=GEO, xa=PTR, bm=PTR, wp=PTR, bias=PTR, y=PTR, omask=PTR, tiles=INT, group=INT, nthreads=INT
    ),
    "sparsa_union_conv_igrad_w_f32": sig(
        INT, g2=GEO, xa=PTR, bm=PTR, w=PTR, ws=I64S, y=PTR, omask=PTR, group=INT, nthreads=INT
    ),
    "sparsa_union_conv_wgrad_f32": sig(
        INT, g=GEO, xa=PTR, bm=PTR, dy=PTR, S=PTR, rs=I64S, ldS=I64, tiles=INT, nthreads=INT
    ),
    "sparsa_union_pack_f32": sig(INT, w=PTR, ws=I64S, O=I64, C=I64, KH=I64, KW=I64, wf=PTR, wfl=PTR, nthreads=INT),
    "sparsa_union_wc_from_wf_f32": sig(None, wf=PTR, O=I64, C=I64, K2=I64, wc=PTR, nthreads=INT),
    "sparsa_union_transpose_f32": sig(None, A=PTR, R=I64, M=I64, T=PTR, nthreads=INT),
    "sparsa_union_transpose_batched_f32": sig(None, A=PTR, B=I64, R=I64, M=I64, T=PTR, nthreads=INT),
    # adaptive_igrad_x.cpp
    "sparsa_union_conv_igrad_x_f32": sig(INT, g=GEO, bm=PTR, dy=PTR, wc=PTR, dx=PTR, lists=INT, nthreads=INT),
    "sparsa_union_conv_igrad_x_bf16": sig(INT, g=GEO, bm=PTR, dy=PTR, wc=PTR, dx=PTR, lists=INT, nthreads=INT),
    # adaptive_wgrad_lists.cpp
    "sparsa_union_conv_wgrad_lists_f32": sig(INT, g=GEO, xa=PTR, bm=PTR, dy=PTR, dw=PTR, ws=I64S, nthreads=INT),
    "sparsa_union_conv_wgrad_lists_bf16": sig(INT, g=GEO, xa=PTR, bm=PTR, dy=PTR, dw=PTR, ws=I64S, nthreads=INT),
    # adaptive_union_bf16.cpp
    "sparsa_union_has_dpbf16": sig(INT),
    "sparsa_union_compact_bf16": sig(
        I64, x=PTR, N=I64, C=I64, H=I64, W=I64, relu=INT, xa=PTR, bm=PTR, union4=PTR, nthreads=INT
    ),
    "sparsa_union_conv_wgrad_bf16": sig(
        INT, g=GEO, xa=PTR, bm=PTR, dy=PTR, S=PTR, rs=I64S, ldS=I64, tiles=INT, nthreads=INT
    ),
    "sparsa_transpose16": sig(None, A=PTR, B=I64, R=I64, M=I64, T=PTR, nthreads=INT),
    "sparsa_union_pair_packs_bf16": sig(
        INT, w=PTR, ws=I64S, O=I64, C=I64, KH=I64, KW=I64, wf2=PTR, wfl2=PTR, wc=PTR, nthreads=INT
    ),
    "sparsa_union_conv_fwd_bf16": sig(
        INT, g=GEO, xa=PTR, bm=PTR, wp2=PTR, bias=PTR, y=PTR, omask=PTR, tiles=INT, group=INT, nthreads=INT
    ),
}

# bitmask_amx_bf16.cpp: the AMX kernel on the components of a bf16 Bitmask weight
# the many-token Bitmask kernels (AMX, panels): one argument list, act = 1 for a GELU epilogue
_BITMASK_ROWS = sig(
    INT, x=PTR, T=I64, K=I64, bits=PTR, row_ptr=PTR, values=PTR, R=I64, bias=PTR, y=PTR, nthreads=INT, act=INT
)
_BITMASK_AMX = _BITMASK_ROWS

_BITMASK = {
    "sparsa_bitmask_has_avx512": sig(INT),
    "sparsa_bitmask_has_dpbf16": sig(INT),
    "sparsa_bitmask_linear_f32": sig(
        INT, x=PTR, T=I64, K=I64, bits=PTR, row_ptr=PTR, values=PTR, R=I64, bias=PTR, y=PTR, nthreads=INT, path=INT
    ),
    "sparsa_bitmask_linear_bf16": sig(
        INT,
        x=PTR,
        T=I64,
        K=I64,
        bits=PTR,
        row_ptr=PTR,
        values=PTR,
        R=I64,
        bias=PTR,
        bias_bf16=INT,
        y=PTR,
        nthreads=INT,
        path=INT,
    ),
    "sparsa_bitmask_has_panel_bf16": sig(INT),
    "sparsa_bitmask_panel_bf16": _BITMASK_ROWS,
    "sparsa_nm24_has_panel_bf16": sig(INT),
    "sparsa_nm24_panel_bf16": sig(INT, x=PTR, T=I64, K=I64, bits=PTR, values=PTR, R=I64, bias=PTR, y=PTR, nthreads=INT),
    "sparsa_bitmask_has_panel_f32": sig(INT),
    "sparsa_bitmask_panel_f32": _BITMASK_ROWS,
    "sparsa_bitmask_has_fused_f32": sig(INT),
    "sparsa_bitmask_fused_f32": _BITMASK_ROWS,
    "sparsa_bitmask_has_amx": sig(INT),
    "sparsa_bitmask_amx_status": sig(INT),
    "sparsa_bitmask_amx_bf16": _BITMASK_AMX,
    "sparsa_bitmask_expand": sig(
        INT,
        bits=PTR,
        row_ptr=PTR,
        values=PTR,
        values_bf16=INT,
        R=I64,
        K=I64,
        r0=I64,
        r1=I64,
        out=PTR,
        out_bf16=INT,
        nthreads=INT,
    ),
}

#: the arguments of the row_group linear entry points
_RG_LINEAR = dict(
    x=PTR,
    T=I64,
    K=I64,
    cols=PTR,
    vals=PTR,
    ng=I64,
    k=I64,
    G=I64,
    bias=PTR,
    y=PTR,
    R=I64,
    perm=PTR,
    nthreads=INT,
    act=INT,
)

_ROW_GROUP = {
    "sparsa_row_group_has_dpbf16": sig(INT),
    "sparsa_row_group_has_amx": sig(INT),
    "sparsa_row_group_amx_status": sig(INT),
    "sparsa_row_group_linear_f32": sig(INT, **_RG_LINEAR),
    "sparsa_row_group_linear_bf16": sig(INT, **_RG_LINEAR),
    "sparsa_row_group_amx_pack_size": sig(I64, ng=I64, k=I64, G=I64),
    "sparsa_row_group_amx_pack": sig(INT, vals=PTR, ng=I64, k=I64, G=I64, out=PTR, nthreads=INT),
    "sparsa_row_group_linear_bf16_packed": sig(INT, **_RG_LINEAR, amx_pack=PTR),
    "sparsa_row_group_mlp_bf16": sig(
        INT,
        x=PTR,
        T=I64,
        K=I64,
        cols1=PTR,
        pack1=PTR,
        ng1=I64,
        k1=I64,
        bias1=PTR,
        R1=I64,
        cols2=PTR,
        pack2=PTR,
        ng2=I64,
        k2=I64,
        bias2=PTR,
        y=PTR,
        R2=I64,
        nthreads=INT,
        act=INT,
    ),
}

_GNM_PLAN = dict(G=I64, n=I64, units=I64, unit_entries=I64, unit_span=I64)
_GROUPED_NM = {
    "sparsa_grouped_nm_has_avx512": sig(INT),
    "sparsa_gnm_spmm_f32": sig(
        INT,
        x=PTR,
        T=I64,
        K=I64,
        ldx=I64,
        idx=PTR,
        vals=PTR,
        out_rows=PTR,
        **_GNM_PLAN,
        gpb=I64,
        rpb=I64,
        in_pad=I64,
        out_pad=I64,
        bias=PTR,
        y=PTR,
        R=I64,
        nthreads=INT,
        tile_bytes=I64,
        vmax=INT,
        interleaved=INT,
        offsets=PTR,
        entries=I64,
    ),
    "sparsa_gnm_spmm_bf16": sig(
        INT,
        x=PTR,
        T=I64,
        K=I64,
        ldx=I64,
        idx=PTR,
        vals=PTR,
        out_rows=PTR,
        **_GNM_PLAN,
        gpb=I64,
        rpb=I64,
        in_pad=I64,
        out_pad=I64,
        bias=PTR,
        bias_bf16=INT,
        y=PTR,
        R=I64,
        nthreads=INT,
        tile_bytes=I64,
        vmax=INT,
        interleaved=INT,
        offsets=PTR,
        entries=I64,
    ),
    "sparsa_gnm_sddmm_f32": sig(
        INT,
        x=PTR,
        ldx=I64,
        gy=PTR,
        ldg=I64,
        T=I64,
        K=I64,
        R=I64,
        idx=PTR,
        out_rows=PTR,
        **_GNM_PLAN,
        in_pad=I64,
        out_pad=I64,
        gv=PTR,
        nthreads=INT,
        tile_bytes=I64,
    ),
}

#: the leading arguments of both sliced_ell linear entry points
_SE_LINEAR = dict(x=PTR, T=I64, K=I64, slice_ptr=PTR, cols=PTR, vals=PTR, bounds=PTR, nch=I64, R=I64, bias=PTR)

_SLICED_ELL = {
    "sparsa_sliced_ell_has_dpbf16": sig(INT),
    "sparsa_sliced_ell_n_chunks": sig(I64, K=I64, slice_ptr=PTR, ns=I64),
    "sparsa_sliced_ell_chunk_bounds": sig(INT, slice_ptr=PTR, cols=PTR, ns=I64, nch=I64, bounds=PTR),
    "sparsa_sliced_ell_linear_f32": sig(INT, **_SE_LINEAR, y=PTR, nthreads=INT, act=INT),
    "sparsa_sliced_ell_linear_bf16": sig(
        INT, **_SE_LINEAR, bias_bf16=INT, y=PTR, nthreads=INT, act=INT, dp_chunk_ptr=PTR, dp_pairs=PTR, dp_nch=I64
    ),
    "sparsa_sliced_ell_dp_chunks": sig(I64, slice_ptr=PTR, ns=I64, K=I64),
    "sparsa_sliced_ell_dp_plan": sig(
        INT, slice_ptr=PTR, cols=PTR, vals=PTR, ns=I64, K=I64, nch=I64, chunk_ptr=PTR, pairs=PTR
    ),
}

_PROBE = {
    "sparsa_probe_version": sig(INT),
    "sparsa_probe_max_threads": sig(INT),
    "sparsa_probe_saxpy": sig(None, n=I64, a=ctypes.c_float, x=PTR, y=PTR),
}

#: library name (as passed to :func:`sparsa.kernels.loader.load`) -> function name -> signature
SIGNATURES: Dict[str, Dict[str, Signature]] = {
    "adaptive": _ADAPTIVE,
    "bitmask_linear": _BITMASK,
    "row_group_linear": _ROW_GROUP,
    "row_group_linear_amxemu": _ROW_GROUP,
    "bitmask_amx_bf16_emu": {
        "sparsa_bitmask_has_amx": sig(INT),
        "sparsa_bitmask_amx_status": sig(INT),
        "sparsa_bitmask_amx_bf16": _BITMASK_AMX,
    },
    "grouped_nm_linear": _GROUPED_NM,
    "sliced_ell_linear": _SLICED_ELL,
    "probe": _PROBE,
}
