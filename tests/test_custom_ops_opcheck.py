"""``torch.library.opcheck`` for every ``sparsa::`` op, with the native kernels and with ``SPARSA_NO_NATIVE=1``
(where the op has a fallback). The registered ops are listed from the dispatcher: an op without a sample
here fails ``test_every_op_has_a_sample``, so a new op comes with its check.

Ops whose outputs hold undefined entries (the list operand's slots past a count, the tail room for vector
stores) skip the eager-vs-compiled value comparison (``test_aot_dispatch_dynamic``); their schema, fake
(shapes, strides, dtypes) and autograd registration are checked all the same."""

import pytest
import torch

from sparsa import cpu
from sparsa.kernels import adaptive as A
from sparsa.kernels import adaptive_union as U
from sparsa.kernels import adaptive_union_bf16 as UB
from sparsa.kernels import adaptive_union_ops  # noqa: F401 - registers the union ops
from sparsa.kernels import bitmask, grouped_nm as gk, loader, row_group, sliced_ell  # noqa: F401 - register ops
from sparsa.kernels import row_group_mlp  # noqa: F401 - registers the op
from sparsa.layouts import Bitmask, GroupedNM, RowGroup, SlicedELL

ALL = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
NO_VALUES = ("test_schema", "test_autograd_registration", "test_faketensor")


def _registered() -> list:
    """The library's sparsa:: ops (``test_*`` ops are defined by other test modules, for themselves)."""
    names = (n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("sparsa::"))
    return sorted(n for n in names if not n.startswith("test_"))


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# -------------------------------------------------------------------------------------------- adaptive
def _conv():
    """A stride-1 3x3 conv (C, O multiples of 8, 4-channel slices), its list operands and packs."""
    g = _gen(1)
    x = torch.randn(2, 8, 5, 5, generator=g)
    w = torch.randn(16, 8, 3, 3, generator=g)
    geo = A.geometry(x.shape, w.shape, (1, 1), (1, 1), (1, 1), 4)
    cnt, idx, val = A.compact(x, 4)
    dy = torch.randn(2, 5, 5, 16, generator=g)
    gc, gi, gv = A.compact_signed(dy.relu().permute(0, 3, 1, 2), 4)
    return dict(
        x=x,
        w=w,
        wt=w.permute(2, 3, 1, 0).contiguous(),
        geo=list(geo),
        cnt=cnt,
        idx=idx,
        val=val,
        dy=dy,
        b=torch.randn(16, generator=g),
        gc=gc,
        gi=gi,
        gv=gv,
    )


def _packed(c):
    wf, wc = A.pack_weight(c["w"])
    return wf, wc, A.pack_flipped(wc, list(c["w"].shape))


def _s_compact(native):
    x = torch.randn(2, 8, 3, 3, generator=_gen())
    return [((x, 4), NO_VALUES), ((x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2), 64), NO_VALUES)]


def _s_restrict(native):
    x = torch.randn(2, 8, 3, 3, generator=_gen())
    g = torch.randn(2, 8, 3, 3, generator=_gen(1))
    cnt, idx, _ = A.compact_zeroed(x, 4)
    return [((cnt, idx, g, 4), ALL), ((cnt, idx, g.contiguous(memory_format=torch.channels_last), 4), ALL)]


def _s_to_dense(native):
    x = torch.randn(2, 8, 3, 3, generator=_gen())
    cnt, idx, val = A.compact_zeroed(x, 4)
    return [((cnt, idx, val, [2, 8, 3, 3], 4), ALL)]


def _s_conv_fwd(native):
    c = _conv()
    return [((c["cnt"], c["idx"], c["val"], c["wt"], c["b"], c["geo"], f), ALL) for f in (0, 1, 2)]


def _s_conv_wgrad(native):
    c = _conv()
    return [((c["cnt"], c["idx"], c["val"], c["dy"], c["geo"]), ALL)]


def _s_conv_igrad(native):
    c = _conv()
    return [((c["cnt"], c["idx"], c["val"], c["dy"], c["wt"], c["geo"], cl), ALL) for cl in (False, True)]


def _s_conv_bwd(native):
    c = _conv()
    return [((c["cnt"], c["idx"], c["val"], c["dy"], c["wt"], c["geo"], True), ALL)]


def _s_sample_zeros(native):
    x = torch.randn(2, 8, 3, 3, generator=_gen()).relu()
    base = torch.arange(4, dtype=torch.int64) * 8
    return [((x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2), base, 4), ALL)]


def _s_pack_weight(native):
    w = torch.randn(16, 8, 3, 3, generator=_gen())
    return [((w,), ALL), ((w.contiguous(memory_format=torch.channels_last),), ALL)]


def _s_pack_flipped(native):
    c = _conv()
    return [((_packed(c)[1], list(c["w"].shape)), ALL)]


def _s_fwd_packed(native):
    c = _conv()
    wf = _packed(c)[0]
    return [((c["cnt"], c["idx"], c["val"], wf, c["b"], c["geo"], f), ALL) for f in (0, 1)]


def _s_bwd_packed(native):
    c = _conv()
    wc = _packed(c)[1]
    args = (c["cnt"], c["idx"], c["val"], c["dy"], wc, c["geo"])
    return [
        (args + (True, True, True, None), ALL),
        (args + (False, False, True, [72, 1, 24, 8]), ALL),
        (args + (True, True, False, None), ALL),
    ]


def _s_wgrad_dy(native):
    c = _conv()
    xr = c["x"].relu().permute(0, 2, 3, 1).contiguous()
    return [
        ((c["gc"], c["gi"], c["gv"], xr, c["geo"], 4, None), ALL),
        ((c["gc"], c["gi"], c["gv"], xr, c["geo"], 4, [72, 1, 24, 8]), ALL),
    ]


def _s_igrad_dy(native):
    c = _conv()
    wfl = _packed(c)[2]
    return [((c["gc"], c["gi"], c["gv"], wfl, c["cnt"], c["idx"], c["geo"], 4, cl), ALL) for cl in (False, True)]


# -------------------------------------------------------------------------------------------- union
def _union():
    g = _gen(3)
    x = torch.randn(2, 16, 4, 4, generator=g)
    w = torch.randn(16, 16, 3, 3, generator=g)
    geo = U.geometry(x.shape, w.shape, (1, 1), (1, 1), (1, 1))
    xop = U.union_operand(x)
    dy = torch.randn(2, 4, 4, 16, generator=g).relu()
    gop = U.union_operand(dy.permute(0, 3, 1, 2), relu=False)
    wf, wfl = adaptive_union_ops.union_pack(w, True, True)
    return dict(x=x, w=w, geo=list(geo), xop=xop, gop=gop, dy=dy, wf=wf, wfl=wfl, b=torch.randn(16, generator=g))


def _s_u_compact(native):
    x = torch.randn(2, 16, 3, 3, generator=_gen())
    cases = [((x, True, True), ALL), ((x, False, False), ALL)]
    if UB.union_dpbf16():  # bf16 operands (native only)
        xb = x.bfloat16()
        cases += [((xb, True, True), ALL), ((xb.contiguous(memory_format=torch.channels_last), False, False), ALL)]
    return cases


def _s_u_pack(native):
    w = torch.randn(16, 16, 3, 3, generator=_gen())
    return [((w, True, True), ALL), ((w, True, False), ALL)]


def _s_u_wc(native):
    u = _union()
    return [((u["wf"], list(u["w"].shape)), ALL)]


def _s_u_fwd(native):
    cases = []
    for u in (_union(),) + ((_union_bf16(),) if UB.union_dpbf16() else ()):  # fp32, and bf16 operands
        wf, wfl = (u["wf2"], u["wfl2"]) if "wf2" in u else (u["wf"], u["wfl"])
        g2 = list(A.igrad_dy_geometry(u["geo"]))
        cases += [
            ((u["xop"].values, u["xop"].mask, wf, u["b"], u["geo"], None, 1, 4), ALL),
            ((u["gop"].values, u["gop"].mask, wfl, None, g2, u["xop"].mask, 0, 2), ALL),
        ]
    return cases


def _s_u_igrad_w(native):
    u = _union()
    g2 = list(A.igrad_dy_geometry(u["geo"]))
    w = u["w"].contiguous(memory_format=torch.channels_last)
    return [((u["gop"].values, u["gop"].mask, w, g2, u["xop"].mask, 4), ALL)]


def _s_u_igrad_x(native):
    u = _union()
    wc = adaptive_union_ops.union_wc(u["wf"], list(u["w"].shape))
    cases = [((u["xop"].mask, u["dy"], wc, u["geo"], lists), ALL) for lists in (False, True)]
    if UB.union_dpbf16():  # bf16 dY and weight rows (native only)
        for lists in (False, True):
            cases.append(((u["xop"].mask, u["dy"].bfloat16(), _union_bf16()["wc"], u["geo"], lists), ALL))
    return cases


def _s_u_wgrad(native):
    u = _union()
    a = (u["xop"].values, u["xop"].mask, u["dy"], u["geo"])
    cases = [(a + (None, False), ALL), (a + ([144, 1, 48, 16], False), ALL), (a + (None, True), ALL)]
    if UB.union_dpbf16():  # bf16 operands, fp32 dW (native only)
        b = _union_bf16()
        cases.append(((b["xop"].values, b["xop"].mask, b["dy"].bfloat16(), b["geo"], None, False), ALL))
        # the list kernel widens bf16 operands as it reads them
        cases.append(((b["xop"].values, b["xop"].mask, b["dy"].bfloat16(), b["geo"], None, True), ALL))
    return cases


def _s_u_wgrad_dy(native):
    u = _union()
    xr = u["x"].relu().permute(0, 2, 3, 1).contiguous()
    return [((u["gop"].values, u["gop"].mask, xr, u["geo"], None), ALL)]


def _s_u_wgrad_dy_lists(native):
    u = _union()
    xr = u["x"].relu().permute(0, 2, 3, 1).contiguous()
    cases = [
        ((u["gop"].values, u["gop"].mask, xr, u["geo"], None), ALL),
        ((u["gop"].values, u["gop"].mask, xr, u["geo"], [144, 1, 48, 16]), ALL),
    ]
    if UB.union_dpbf16():  # bf16 operands (the kernel widens them as it reads them)
        gop = UB.union_operand_bf16(u["dy"].bfloat16().permute(0, 3, 1, 2), relu=False)
        cases.append(((gop.values, gop.mask, xr.bfloat16(), u["geo"], None), ALL))
    return cases


def _union_bf16():
    u = _union()
    xop = UB.union_operand_bf16(u["x"].bfloat16())
    gop = UB.union_operand_bf16(u["dy"].bfloat16().permute(0, 3, 1, 2), relu=False)
    wf2, wfl2, wc = adaptive_union_ops.union_pair_packs(u["w"], True, True)
    return dict(u, xop=xop, gop=gop, wf2=wf2, wfl2=wfl2, wc=wc)


def _s_layout16(native):
    x = torch.randn(2, 24, 4, 5, generator=_gen()).bfloat16()
    return [((x, True), ALL), ((x.contiguous(memory_format=torch.channels_last).half(), False), ALL)]


def _s_u_pair_packs(native):
    w = _union()["w"]
    return [((w, True, True), ALL), ((w.contiguous(memory_format=torch.channels_last), True, False), ALL)]


# -------------------------------------------------------------------------------------------- linear
def _rg(native):
    lay = RowGroup.from_dense(torch.randn(24, 20, generator=_gen()), group=8, sparsity=0.5, permute=True)
    x = torch.randn(5, 20, generator=_gen(1))
    b = torch.randn(24, generator=_gen(2))
    return lay, x, b


def _s_row_group(native, grad=True):
    lay, x, b = _rg(native)
    v = lay.values.clone()
    if grad:
        x, v, b = x.requires_grad_(), v.requires_grad_(), b.requires_grad_()
    return [((x, lay.columns, v, b, 24, lay.row_perm, "none"), ALL), ((x, lay.columns, v, None, 24, None, "gelu"), ALL)]


def _s_row_group_mlp(native):
    # float32 with permuted groups of 8 (the two products); bf16 in groups of 16 with 32 tokens (AMX: fused)
    w1, _, b1 = _rg(native)
    w2 = RowGroup.from_dense(torch.randn(12, 24, generator=_gen(3)), group=8, sparsity=0.5, permute=True)
    x = torch.randn(5, 20, generator=_gen(1))
    u1 = RowGroup.from_dense(torch.randn(48, 40, generator=_gen(4)), group=16, sparsity=0.75)
    u2 = RowGroup.from_dense(torch.randn(16, 48, generator=_gen(5)), group=16, sparsity=0.75)
    xb = torch.randn(32, 40, generator=_gen(6)).bfloat16()
    return [
        ((x, w1.columns, w1.values, b1, 24, w1.row_perm, w2.columns, w2.values, None, 12, w2.row_perm, "gelu"), ALL),
        (
            (xb, u1.columns, u1.values.bfloat16(), None, 48, None, u2.columns, u2.values.bfloat16(), None, 16, None),
            ALL,
        ),
    ]


def _s_sliced_ell(native, grad=True):
    lay = SlicedELL.from_dense(torch.randn(9, 40, generator=_gen()), sparsity=0.8)
    x, b, v = torch.randn(3, 40, generator=_gen(1)), torch.randn(9, generator=_gen(2)), lay.values.clone()
    if grad:
        x, v, b = x.requires_grad_(), v.requires_grad_(), b.requires_grad_()
    return [
        ((x, lay.slice_ptr, lay.columns, v, b, 9, "none"), ALL),
        ((x, lay.slice_ptr, lay.columns, v, None, 9, "gelu"), ALL),
    ]


def _s_bitmask(native, grad=True):
    w = Bitmask.from_dense(torch.randn(9, 21, generator=_gen()), sparsity=0.5)
    x, b, v = torch.randn(3, 21, generator=_gen(1)), torch.randn(9, generator=_gen(2)), w.values.clone()
    if grad:
        x, v, b = x.requires_grad_(), v.requires_grad_(), b.requires_grad_()
    return [((x, w.bits, w.row_ptr, v, b, 9), ALL), ((x, w.bits, w.row_ptr, v, None, 9), ALL)]


def _gnm_plan(kind):
    w = GroupedNM.from_dense(torch.randn(7, 26, generator=_gen(), dtype=torch.float64), n=2, m=4, g=2)
    vals = w.values.float()
    plan = {"pattern": gk.pattern_plan, "forward": gk.forward_plan}[kind](vals, w.columns, 2, 4)
    return plan


def _s_spmm(native, grad=True):
    out = []
    for kind in ("pattern", "forward"):
        plan = _gnm_plan(kind)
        x, v = torch.randn(2, 3, 26, generator=_gen(1)), plan.vals.detach().clone()
        b = torch.randn(7, generator=_gen(2))
        if grad:
            x, v, b = x.requires_grad_(), v.requires_grad_(), b.requires_grad_()
        out.append(
            (
                (
                    x,
                    plan.idx,
                    v,
                    plan.out_rows,
                    b,
                    7,
                    plan.units,
                    plan.unit_entries,
                    plan.unit_span,
                    plan.gpb,
                    plan.rpb,
                    plan.interleaved,
                    plan.offsets,
                ),
                ALL,
            )
        )
    return out


def _s_sddmm(native, grad=True):
    plan = _gnm_plan("pattern")
    x, gy = torch.randn(5, 26, generator=_gen(1)), torch.randn(5, 7, generator=_gen(2))
    if grad:
        x, gy = x.requires_grad_(), gy.requires_grad_()
    return [((x, gy, plan.idx, plan.out_rows, plan.units, plan.unit_entries, plan.unit_span, plan.out_pad), ALL)]


def _fwd_only(fn):
    """The samples of a differentiable op without grad: the kernel ops are forward-only."""
    return lambda native: fn(native, grad=False)


# name -> (samples(native) -> [(args, test_utils)], has a fallback, needs the union kernels (True: AVX-512,
# "bf16": AVX-512 and AVX512-BF16))
SAMPLES = {
    "adaptive_compact": (_s_compact, True, False),
    "adaptive_compact_signed": (_s_compact, True, False),
    "adaptive_compact_zeroed": (_s_compact, True, False),
    "adaptive_restrict": (_s_restrict, True, False),
    "adaptive_to_dense": (_s_to_dense, True, False),
    "adaptive_conv_fwd": (_s_conv_fwd, True, False),
    "adaptive_conv_wgrad": (_s_conv_wgrad, True, False),
    "adaptive_conv_igrad": (_s_conv_igrad, True, False),
    "adaptive_conv_bwd": (_s_conv_bwd, True, False),
    "adaptive_sample_zeros": (_s_sample_zeros, False, False),
    "adaptive_pack_weight": (_s_pack_weight, False, False),
    "adaptive_pack_flipped": (_s_pack_flipped, False, False),
    "adaptive_conv_fwd_packed": (_s_fwd_packed, False, False),
    "adaptive_conv_bwd_packed": (_s_bwd_packed, False, False),
    "adaptive_conv_wgrad_dy": (_s_wgrad_dy, False, False),
    "adaptive_conv_igrad_dy": (_s_igrad_dy, False, False),
    "adaptive_union_compact": (_s_u_compact, False, True),
    "adaptive_union_pack": (_s_u_pack, False, True),
    "adaptive_union_wc": (_s_u_wc, False, True),
    "adaptive_union_conv_fwd": (_s_u_fwd, False, True),
    "adaptive_union_conv_igrad_w": (_s_u_igrad_w, False, True),
    "adaptive_union_conv_igrad_x": (_s_u_igrad_x, False, True),
    "adaptive_union_conv_wgrad": (_s_u_wgrad, False, True),
    "adaptive_union_conv_wgrad_dy": (_s_u_wgrad_dy, False, True),
    "adaptive_union_conv_wgrad_dy_lists": (_s_u_wgrad_dy_lists, False, True),
    "adaptive_union_pair_packs": (_s_u_pair_packs, False, "bf16"),
    "adaptive_layout16": (_s_layout16, False, False),
    "row_group_linear": (_s_row_group, True, False),
    "row_group_linear_kernel": (_fwd_only(_s_row_group), True, False),
    "row_group_mlp_kernel": (_s_row_group_mlp, True, False),
    "sliced_ell_linear": (_s_sliced_ell, True, False),
    "sliced_ell_linear_kernel": (_fwd_only(_s_sliced_ell), True, False),
    "bitmask_linear": (_s_bitmask, True, False),
    "bitmask_linear_kernel": (_fwd_only(_s_bitmask), True, False),
    "grouped_nm_spmm": (_s_spmm, True, False),
    "grouped_nm_spmm_kernel": (_fwd_only(_s_spmm), True, False),
    "grouped_nm_sddmm": (_s_sddmm, True, False),
    "grouped_nm_sddmm_kernel": (_fwd_only(_s_sddmm), True, False),
}


def test_every_op_has_a_sample():
    missing = [n for n in _registered() if n not in SAMPLES]
    assert not missing, f"sparsa:: ops without an opcheck sample in {__file__}: {missing}; add one to SAMPLES"
    stale = [n for n in SAMPLES if n not in _registered()]
    assert not stale, f"SAMPLES names ops that are not registered: {stale}"


@pytest.fixture(params=["native", "fallback"])
def mode(request, monkeypatch):
    if request.param == "fallback":
        monkeypatch.setenv("SPARSA_NO_NATIVE", "1")
        assert not loader.native_enabled()
    else:
        monkeypatch.delenv("SPARSA_NO_NATIVE", raising=False)
        if cpu.ISA_LEVELS.index(cpu.hardware_isa()) < cpu.ISA_LEVELS.index("avx2"):
            pytest.skip("this CPU has no avx2/fma")
        if A.native_library() is None:
            pytest.skip("the native kernels did not build here")
    return request.param


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_opcheck(name, mode):
    samples, has_fallback, needs_union = SAMPLES[name]
    native = mode == "native"
    if not native and not has_fallback:
        pytest.skip(f"sparsa::{name} is native only (its callers run the fallback themselves)")
    if native and needs_union and not U.union_native():
        pytest.skip("the union kernels need AVX-512")
    if native and needs_union == "bf16" and not UB.union_dpbf16():
        pytest.skip("the bf16 union kernels need AVX512-BF16 (avx512_bf16 in /proc/cpuinfo)")
    op = getattr(torch.ops.sparsa, name).default
    for args, utils in samples(native):
        torch.library.opcheck(op, args, test_utils=utils)


def test_native_only_op_without_native_says_so(monkeypatch):
    monkeypatch.setenv("SPARSA_NO_NATIVE", "1")
    with pytest.raises(RuntimeError, match="packed_supported"):
        A.pack_weight(torch.randn(16, 8, 3, 3))
