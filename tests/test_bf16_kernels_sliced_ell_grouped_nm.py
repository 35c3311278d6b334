"""bfloat16 linear kernels of the SlicedELL and GroupedNM layouts: native (every ISA path this CPU has) and the
pure-PyTorch fallback, against a float64 reference of the same bf16-rounded operands.

Semantics under test: ``y = x @ W.T + bias`` with bf16 ``x`` and weight values, bias bf16 / fp32 / None, products
accumulated in fp32 and the bf16 output rounded once (nearest even). One rounding of the exact result is off by
at most half a bf16 ulp (<= 2**-8 relative); fp32 accumulation adds far less than the ``atol`` below.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import sparsa
from sparsa import cpu
from sparsa.kernels import grouped_nm as gk
from sparsa.kernels import sliced_ell as se
from sparsa.layouts import GroupedNM, SlicedELL
from sparsa.ops import native_grouped_nm

BF = torch.bfloat16
RTOL = 2.0**-8  # half a bf16 ulp, relative
ATOL_REL = 1e-4  # of sum_k |x||w| + |b| per element: fp32 accumulation (far below) + denormal room

# kernel paths: the CPU flags each needs (SPARSA_ISA forces it; "default" = the best this CPU has)
_NEEDS = {"avx2": ("avx2", "fma"), "avx512": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq")}
PATHS = ["avx2", "avx512", "default", "fallback"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    p = request.param
    for v in ("SPARSA_ISA", "SPARSA_NO_AVX512", "SPARSA_NO_NATIVE"):
        monkeypatch.delenv(v, raising=False)
    if p in _NEEDS:
        flags = cpu.cpu_flags()
        missing = [f for f in _NEEDS[p] if not flags[f]]
        if missing:
            pytest.skip(f"{p} path: this CPU lacks {', '.join(missing)} (hardware_isa={cpu.hardware_isa()})")
        monkeypatch.setenv("SPARSA_ISA", p)
    elif p == "fallback":
        monkeypatch.setenv("SPARSA_NO_NATIVE", "1")
    return p


def _native_expected(p: str) -> bool:
    return p != "fallback" and cpu.hardware_isa() != "portable"


def _bias(kind, R, gen):
    if kind is None:
        return None
    b = torch.randn(R, generator=gen)
    return b.to(BF) if kind == "bf16" else b


def _check(y, x, wd, bias):
    """``y`` (bf16) against float64 ``x @ wd.T + bias`` of the very same operands."""
    assert y.dtype == BF
    x64, w64 = x.double().reshape(-1, x.shape[-1]), wd.double()
    ref = x64 @ w64.T
    scale = x64.abs() @ w64.abs().T
    if bias is not None:
        ref = ref + bias.double()
        scale = scale + bias.double().abs()
    y2 = y.reshape(ref.shape).double()
    err = (y2 - ref).abs()
    tol = RTOL * ref.abs() + ATOL_REL * scale + 1e-30
    bad = err > tol
    assert not bad.any(), (
        f"{int(bad.sum())} of {bad.numel()} outside bf16 tolerance; worst err "
        f"{float((err / tol).max()):.3g} x tol, max |y - ref| {float(err.max()):.4g}"
    )


# ---------------------------------------------------------------------------------------------- SlicedELL
def _se_weight(R, K, sparsity, gen):
    w = torch.randn(R, K, generator=gen).to(BF).float()
    e = SlicedELL.from_dense(w, sparsity=sparsity)
    vb = e.values.to(BF)  # exact: the dense weight was bf16 already
    return e, vb, SlicedELL(e.slice_ptr, e.columns, vb, e.row_nnz, e.shape).to_dense().float()


SE_SHAPES = [(1, 1, 1), (1, 5, 13), (7, 31, 70), (32, 64, 96), (33, 9, 8), (70, 16, 129)]


@pytest.mark.parametrize("T,R,K", SE_SHAPES)
@pytest.mark.parametrize("bias_kind", [None, "f32", "bf16"])
@pytest.mark.parametrize("sparsity", [0.5, 0.9])
def test_sliced_ell_bf16_matches_float64(path, T, R, K, bias_kind, sparsity):
    gen = torch.Generator().manual_seed(T * 1000 + R * 10 + K)
    e, vb, wd = _se_weight(R, K, sparsity, gen)
    x = torch.randn(T, K, generator=gen).to(BF)
    b = _bias(bias_kind, R, gen)
    y = se.sliced_ell_linear_impl(x, e.slice_ptr, e.columns, vb, b, R)
    assert y.shape == (T, R)
    _check(y, x, wd, b)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    T=st.integers(1, 80),
    R=st.integers(1, 40),
    K=st.integers(1, 150),
    sparsity=st.sampled_from([0.0, 0.7, 0.95]),
    bias_kind=st.sampled_from([None, "f32", "bf16"]),
    lead=st.sampled_from([(), (2,)]),
    seed=st.integers(0, 99),
)
def test_sliced_ell_bf16_property(path, T, R, K, sparsity, bias_kind, lead, seed):
    gen = torch.Generator().manual_seed(seed)
    e, vb, wd = _se_weight(R, K, sparsity, gen)
    x = (torch.randn(*lead, T, K, generator=gen) * 3).to(BF)
    b = _bias(bias_kind, R, gen)
    y = se.sliced_ell_linear(x, e.slice_ptr, e.columns, vb, b, R)  # through the custom op
    assert y.shape == (*lead, T, R)
    _check(y, x, wd, b)


def test_sliced_ell_bf16_noncontiguous_input(path):
    gen = torch.Generator().manual_seed(3)
    e, vb, wd = _se_weight(10, 24, 0.8, gen)
    x = torch.randn(24, 9, generator=gen).to(BF).t()  # (9, 24), column-major
    y = se.sliced_ell_linear_impl(x, e.slice_ptr, e.columns, vb, None, 10)
    _check(y, x, wd, None)


def test_sliced_ell_bf16_native_path_is_taken(monkeypatch):
    """Where native kernels run, bf16 operands never reach the reference; and the AVX2 path's result is exactly
    the fp32 kernel's result on the widened operands, rounded once (same accumulation order). The AVX512-BF16
    rows sum slots in pairs: test_sliced_ell_bf16_dot_product_rows checks them against float64."""
    if cpu.hardware_isa() == "portable":
        pytest.skip("no native kernels: this CPU lacks avx2/fma")
    for v in ("SPARSA_NO_AVX512", "SPARSA_NO_NATIVE"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("SPARSA_ISA", "avx2")
    assert se.native_library() is not None, "native sliced_ell kernel failed to build"
    gen = torch.Generator().manual_seed(7)
    e, vb, wd = _se_weight(37, 85, 0.9, gen)
    x = torch.randn(3, 45, 85, generator=gen).to(BF)
    for b in (None, _bias("f32", 37, gen), _bias("bf16", 37, gen)):
        assert se.native_kind(x, vb, b) == "bf16"
        exp = se.sliced_ell_linear_impl(
            x.float(), e.slice_ptr, e.columns, vb.float(), None if b is None else b.float(), 37
        ).to(BF)
        with monkeypatch.context() as m:
            m.setattr(se, "sliced_ell_linear_reference", _no_reference)
            y = se.sliced_ell_linear_impl(x, e.slice_ptr, e.columns, vb, b, 37)
            y_op = torch.ops.sparsa.sliced_ell_linear(x, e.slice_ptr, e.columns, vb, b, 37)
        assert torch.equal(y, exp) and torch.equal(y_op, exp)
        _check(y, x, wd, b)
    # mixed dtypes are not a native kind: they run the reference
    assert se.native_kind(x, vb.float(), None) is None and se.native_kind(x.float(), vb, None) is None


@pytest.mark.parametrize("T", [2, 17, 32, 45, 100])
@pytest.mark.parametrize("K,sparsity", [(77, 0.5), (700, 0.75), (3000, 0.5), (2100, 0.85)])
def test_sliced_ell_bf16_dot_product_rows(monkeypatch, T, K, sparsity):
    # two tokens or more take the AVX512-BF16 rows: slot pairs and a lone last slot, weights walked in
    # column chunks (K = 3000 at 50%, 2100 at 85%) or not, panels of 32 tokens with a partial last one,
    # GELU after a bias
    for v in ("SPARSA_ISA", "SPARSA_NO_AVX512", "SPARSA_NO_NATIVE"):
        monkeypatch.delenv(v, raising=False)
    if not se.has_dpbf16():
        pytest.skip(f"this CPU has no avx512_bf16 (hardware_isa={cpu.hardware_isa()}): the bf16 rows do not run")
    gen = torch.Generator().manual_seed(T + K)
    e, vb, wd = _se_weight(29, K, sparsity, gen)
    if K == 3000:
        assert se.chunk_bounds(se.native_library(), e.slice_ptr, e.columns, K) is not None, "expected K chunks"
    x = torch.randn(T, K, generator=gen).to(BF)
    b = _bias("bf16", 29, gen)
    with monkeypatch.context() as m:
        m.setattr(se, "sliced_ell_linear_reference", _no_reference)
        y = se.sliced_ell_linear_impl(x, e.slice_ptr, e.columns, vb, b, 29, rows="dp")
        g = se.sliced_ell_linear_impl(x, e.slice_ptr, e.columns, vb, b, 29, "gelu", rows="dp")
    _check(y, x, wd, b)
    ref = torch.nn.functional.gelu(x.double() @ wd.double().T + b.double())
    assert (g.double() - ref).abs().max() <= 2e-2 * ref.abs().max()
    monkeypatch.setenv("SPARSA_ISA", "avx2")
    assert not se.has_dpbf16()


@pytest.mark.parametrize("T", [2, 16, 17, 45])
@pytest.mark.parametrize("K,sparsity", [(77, 0.5), (700, 0.9), (3000, 0.5)])
def test_sliced_ell_fma_rows_same_at_both_widths(monkeypatch, T, K, sparsity):
    # the FMA rows sum each token's products in slot order at 8 and 16 floats alike: bf16 and fp32 results of
    # the AVX-512 rows equal the AVX2 rows' bit for bit (two slices at a time, a lone last one, chunks); after
    # GELU within an ulp or two (the 16-lane GELU takes a reciprocal estimate where the 8-lane one divides)
    for v in ("SPARSA_ISA", "SPARSA_NO_AVX512", "SPARSA_NO_NATIVE"):
        monkeypatch.delenv(v, raising=False)
    if not cpu.cpu_flags()["avx512f"] or se.native_library() is None:
        pytest.skip(f"no AVX-512 rows here (hardware_isa={cpu.hardware_isa()})")
    gen = torch.Generator().manual_seed(T * K)
    e, vb, wd = _se_weight(29, K, sparsity, gen)
    x = torch.randn(T, K, generator=gen)
    b = _bias("f32", 29, gen)
    with monkeypatch.context() as m:
        m.setattr(se, "sliced_ell_linear_reference", _no_reference)
        wide = [
            se.sliced_ell_linear_impl(x.to(BF), e.slice_ptr, e.columns, vb, b, 29, rows="fma"),
            se.sliced_ell_linear_impl(x, e.slice_ptr, e.columns, e.values, b, 29, "gelu"),
        ]
        monkeypatch.setenv("SPARSA_ISA", "avx2")
        narrow = [
            se.sliced_ell_linear_impl(x.to(BF), e.slice_ptr, e.columns, vb, b, 29, rows="fma"),
            se.sliced_ell_linear_impl(x, e.slice_ptr, e.columns, e.values, b, 29, "gelu"),
        ]
    assert torch.equal(wide[0], narrow[0])
    torch.testing.assert_close(wide[1], narrow[1], rtol=5e-7, atol=1e-7)
    _check(wide[0], x.to(BF), wd, b)


def test_sliced_ell_bf16_rows_choice(monkeypatch):
    for v in ("SPARSA_ISA", "SPARSA_NO_AVX512", "SPARSA_NO_NATIVE"):
        monkeypatch.delenv(v, raising=False)
    with pytest.raises(ValueError, match="expected one of"):
        se.bf16_rows(0.5, "avx")
    assert se.bf16_rows(0.5, "fma") == "fma"
    if not se.has_dpbf16():
        assert se.bf16_rows(0.5, "dp") == "fma" and se.bf16_rows(0.01) == "fma"
        return
    from sparsa import crossovers

    c = crossovers.crossover("sliced_ell.fma_rows_bf16")
    assert se.bf16_rows(0.5, "dp") == "dp"
    assert se.bf16_rows(c) == "fma" and se.bf16_rows(min(1.0, c + 0.01)) == "dp"


@pytest.fixture
def dp_rows(monkeypatch):
    """The AVX512-BF16 rows in force (skips on CPUs without them)."""
    for v in ("SPARSA_ISA", "SPARSA_NO_AVX512", "SPARSA_NO_NATIVE"):
        monkeypatch.delenv(v, raising=False)
    if not se.has_dpbf16():
        pytest.skip(f"this CPU has no avx512_bf16 (hardware_isa={cpu.hardware_isa()}): the bf16 rows do not run")
    monkeypatch.setattr(se, "bf16_rows", lambda density, rows=None: "dp" if rows is None else rows)


def _plan_rows(e, vb, K):
    """Per (chunk, slice, row): the plan's pairs decoded to (column, value bits) slots, zero row dropped."""
    chunk_ptr, pairs, nch = se.dp_plan(se.native_library(), e.slice_ptr, e.columns, vb, K)
    ns = e.slice_ptr.numel() - 1
    assert chunk_ptr.numel() == nch * (ns + 1)
    out = {}
    for k in range(nch):
        for s in range(ns):
            lo, hi = int(chunk_ptr[k * (ns + 1) + s]), int(chunk_ptr[k * (ns + 1) + s + 1])
            assert (hi - lo) % 2 == 0, "both rows of a slice have the same number of pairs"
            for i in range(2):
                got = []
                for ab, wp in (tuple(int(v) & 0xFFFFFFFF for v in pairs[q]) for q in range(lo + i, hi, 2)):
                    for col, bits in ((ab & 0xFFFF, wp & 0xFFFF), (ab >> 16, wp >> 16)):
                        if col == K:
                            assert bits == 0, "the zero row carries weight 0"
                        else:
                            got.append((col, bits))
                out[k, s, i] = got
    return out, nch


@pytest.mark.parametrize(
    "K,sparsity,chunked", [(50, None, False), (700, 0.7, False), (700, 0.5, True), (2100, 0.8, True)]
)
def test_sliced_ell_dp_plan_pairs_each_rows_slots(dp_rows, K, sparsity, chunked):
    # every slot of every row exactly once, in slot order, in the chunk of its column (512 columns, on wide
    # or dense enough weights); rows of unequal length (padding slots), odd counts (the zero row), odd R
    gen = torch.Generator().manual_seed(K)
    R = 7
    if sparsity is None:
        mask = torch.rand(R, K, generator=gen) < torch.linspace(0.05, 0.6, R).unsqueeze(1)
    else:
        mask = torch.rand(R, K, generator=gen) >= sparsity
    w = (torch.randn(R, K, generator=gen) * mask).to(BF)
    e = SlicedELL.from_dense(w.float(), mask=mask)
    vb = e.values.to(BF)
    got, nch = _plan_rows(e, vb, K)
    assert (nch > 1) == chunked
    vbits = vb.view(torch.int16).int() & 0xFFFF
    for s in range(e.slice_ptr.numel() - 1):
        p0, L = int(e.slice_ptr[s]), int(e.slice_ptr[s + 1] - e.slice_ptr[s]) // 2
        for i in range(2):
            slots = [(int(e.columns[p0 + 2 * j + i]), int(vbits[p0 + 2 * j + i])) for j in range(L)]
            for k in range(nch):
                want = [c for c in slots if nch == 1 or min(c[0] // 512, nch - 1) == k]
                assert got[k, s, i] == want


def test_sliced_ell_dp_plan_too_wide_runs_the_widening_rows(dp_rows):
    # the plan's 16-bit columns cannot address K > 65535: no plan, and the widening rows give the result
    gen = torch.Generator().manual_seed(2)
    K = 70000
    e, vb, wd = _se_weight(5, K, 0.999, gen)
    assert se.dp_plan(se.native_library(), e.slice_ptr, e.columns, vb, K) is None
    x = torch.randn(3, K, generator=gen).to(BF)
    _check(se.sliced_ell_linear_impl(x, e.slice_ptr, e.columns, vb, None, 5), x, wd, None)


def test_sliced_ell_dp_plan_cached_and_rebuilt_after_in_place_update(dp_rows, monkeypatch):
    gen = torch.Generator().manual_seed(4)
    e, vb, wd = _se_weight(30, 90, 0.7, gen)
    x = torch.randn(40, 90, generator=gen).to(BF)
    built = []
    orig = se.dp_plan

    def spy(*a):
        plan = orig(*a)
        built.append(plan)
        return plan

    monkeypatch.setattr(se, "dp_plan", spy)
    y1 = se.sliced_ell_linear_impl(x, e.slice_ptr, e.columns, vb, None, 30)
    y2 = se.sliced_ell_linear_impl(x, e.slice_ptr, e.columns, vb, None, 30)
    assert len(built) == 2 and built[0] is built[1], "the plan is built once per weight"
    assert torch.equal(y1, y2)
    _check(y1, x, wd, None)
    with torch.no_grad():
        vb.mul_(-2)  # an in-place update (an optimizer step) must not leave a stale plan
    y3 = se.sliced_ell_linear_impl(x, e.slice_ptr, e.columns, vb, None, 30)
    assert built[2] is not built[0]
    _check(y3, x, wd * -2, None)
    assert not se.sliced_ell_linear_impl(x[:1], e.slice_ptr, e.columns, vb, None, 30).isnan().any()
    assert len(built) == 3, "one token runs the one-token rows, without the plan"


def test_sliced_ell_dp_plan_inference_tensors(dp_rows):
    # inference tensors have no version counter: the plan is rebuilt per call, never stale
    gen = torch.Generator().manual_seed(6)
    with torch.inference_mode():
        e, vb, wd = _se_weight(12, 64, 0.6, gen)
        x = torch.randn(5, 64, generator=gen).to(BF)
        _check(se.sliced_ell_linear_impl(x, e.slice_ptr, e.columns, vb, None, 12), x, wd, None)
        vb.mul_(-2)  # exact in bf16
        _check(se.sliced_ell_linear_impl(x, e.slice_ptr, e.columns, vb, None, 12), x, wd * -2, None)


def test_sliced_ell_dp_rows_do_not_depend_on_the_batch(dp_rows):
    # each (row, token) sums its pairs in one fixed order: a token's output is bit-identical whether it is
    # multiplied alone with one other token or in a batch of 100
    gen = torch.Generator().manual_seed(8)
    e, vb, _ = _se_weight(45, 300, 0.75, gen)
    x = torch.randn(100, 300, generator=gen).to(BF)
    full = se.sliced_ell_linear_impl(x, e.slice_ptr, e.columns, vb, None, 45)
    for i in (0, 33, 99):
        two = se.sliced_ell_linear_impl(x[[i, (i + 1) % 100]], e.slice_ptr, e.columns, vb, None, 45)
        assert torch.equal(two[0], full[i])


def _no_reference(*a, **k):
    raise AssertionError("the reference ran although the native bf16 kernel should have")


def test_sliced_ell_bf16_through_f_linear(path):
    gen = torch.Generator().manual_seed(11)
    wdense = torch.randn(21, 40, generator=gen).to(BF)
    w = sparsa.to_sparse(wdense, "sliced_ell", sparsity=0.85)
    x = torch.randn(2, 5, 40, generator=gen).to(BF)
    b = torch.randn(21, generator=gen).to(BF)
    y = torch.nn.functional.linear(x, w, b)
    _check(y, x, w.to_dense().float(), b)


def test_sliced_ell_bf16_nan_inf_propagate(path):
    gen = torch.Generator().manual_seed(5)
    R, K, T = 12, 40, 20
    e, vb, wd = _se_weight(R, K, 0.8, gen)
    x = torch.randn(T, K, generator=gen).to(BF)
    kept = wd != 0
    c = int(kept.sum(0).argmax())  # a column some rows keep
    users = kept[:, c]
    x[3, c] = float("nan")
    x[9, c] = float("inf")
    vb2 = vb.clone()
    r_nan = int((~users).nonzero()[0]) if (~users).any() else None
    if r_nan is not None:  # a NaN weight in a row that does not use column c
        rows, _, offsets = e._entries()
        vb2[offsets[rows == r_nan][0]] = float("nan")
    y = se.sliced_ell_linear_impl(x, e.slice_ptr, e.columns, vb2, None, R).float()
    assert torch.isnan(y[3, users]).all()
    assert not torch.isfinite(y[9, users]).any()
    if r_nan is not None:
        assert torch.isnan(y[:, r_nan]).all()
    clean = [t for t in range(T) if t not in (3, 9)]
    ok_rows = torch.ones(R, dtype=torch.bool)
    if r_nan is not None:
        ok_rows[r_nan] = False
    assert torch.isfinite(y[clean][:, ok_rows]).all()


# ---------------------------------------------------------------------------------------------- GroupedNM
def _gnm_weight(R, K, n, m, g, gen):
    w = GroupedNM.from_dense(torch.randn(R, K, generator=gen).to(BF).float(), n=n, m=m, g=g)
    vb = w.values.to(BF)  # exact: the dense weight was bf16 already
    return w, vb, w.to_dense().float()


def _gnm_plan(kind, vb, w):
    if kind == "forward":
        return gk.forward_plan(vb, w.columns, w.n, w.m)
    if kind == "pattern":
        return gk.pattern_plan(vb, w.columns, w.n, w.m)
    if kind == "pair":
        return gk.pair_plan(vb, w.columns, w.n, w.m, unit_cols=1)  # smallest units: many (group, unit) runs
    return gk.input_grad_plan(vb, w.columns, w.n, w.m)


GNM_SHAPES = [(1, 1, 1), (1, 10, 30), (7, 33, 70), (32, 64, 96), (33, 9, 8), (70, 17, 129)]
GNM_NMG = [(1, 4, 2), (2, 4, 1), (1, 10, 1), (3, 8, 1)]


@pytest.mark.parametrize("T,R,K", GNM_SHAPES)
@pytest.mark.parametrize("nmg", GNM_NMG, ids=lambda t: "%d:%d:g%d" % t)
@pytest.mark.parametrize("bias_kind", [None, "f32", "bf16"])
def test_grouped_nm_bf16_forward_matches_float64(path, T, R, K, nmg, bias_kind):
    gen = torch.Generator().manual_seed(T * 1000 + R * 10 + K + nmg[1])
    w, vb, wd = _gnm_weight(R, K, *nmg, gen)
    x = torch.randn(T, K, generator=gen).to(BF)
    b = _bias(bias_kind, R, gen)
    y = gk.spmm(x, _gnm_plan("forward", vb, w), b, R)
    assert y.shape == (T, R)
    _check(y, x, wd, b)


@pytest.mark.parametrize("plan_kind", ["pattern", "pair", "input_grad"])
@pytest.mark.parametrize("T,R,K", [(1, 10, 30), (45, 33, 70), (70, 17, 129)])
@pytest.mark.parametrize("threads", [1, 2])
def test_grouped_nm_bf16_plans_and_threads(path, plan_kind, T, R, K, threads):
    n, m, g = (1, 4, 2) if plan_kind == "pair" else (2, 4, 1)
    gen = torch.Generator().manual_seed(T + R + K)
    w, vb, wd = _gnm_weight(R, K, n, m, g, gen)
    plan = _gnm_plan(plan_kind, vb, w)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if plan_kind == "input_grad":  # grad_x = grad_y @ W
            gy = torch.randn(T, R, generator=gen).to(BF)
            out = gk.spmm(gy, plan, None, K)
            _check(out, gy, wd.t(), None)
        else:
            x = torch.randn(T, K, generator=gen).to(BF)
            b = _bias("bf16", R, gen)
            _check(gk.spmm(x, plan, b, R), x, wd, b)
    finally:
        torch.set_num_threads(old)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    T=st.integers(1, 80),
    R=st.integers(1, 40),
    K=st.integers(1, 150),
    nmg=st.sampled_from(GNM_NMG + [(2, 6, 1)]),
    bias_kind=st.sampled_from([None, "bf16"]),
    lead=st.sampled_from([(), (2,)]),
    seed=st.integers(0, 99),
)
def test_grouped_nm_bf16_property_through_f_linear(path, T, R, K, nmg, bias_kind, lead, seed):
    """F.linear (the dispatcher wants one dtype for input, weight and bias: no fp32 bias here)."""
    gen = torch.Generator().manual_seed(seed)
    n, m, g = nmg
    wdense = torch.randn(R, K, generator=gen).to(BF)
    w = sparsa.to_sparse(wdense, "grouped_nm", n=n, m=m, g=g)
    x = (torch.randn(*lead, T, K, generator=gen) * 3).to(BF)
    b = _bias(bias_kind, R, gen)
    y = torch.nn.functional.linear(x, w, b)
    assert y.shape == (*lead, T, R)
    _check(y, x, w.to_dense().float(), b)


def test_grouped_nm_bf16_noncontiguous_rows(path):
    gen = torch.Generator().manual_seed(4)
    w, vb, wd = _gnm_weight(12, 40, 1, 4, 2, gen)
    x = torch.randn(9, 64, generator=gen).to(BF)[:, 5:45]  # row stride 64 > K
    _check(gk.spmm(x, _gnm_plan("forward", vb, w), None, 12), x, wd, None)


def test_grouped_nm_bf16_native_path_is_taken(monkeypatch):
    """Where native kernels run, bf16 operands never reach the reference; the native result is exactly the fp32
    kernel's result on the widened operands, rounded once (same accumulation order, AVX2 pieces)."""
    if cpu.hardware_isa() == "portable":
        pytest.skip("no native kernels: this CPU lacks avx2/fma")
    for v in ("SPARSA_ISA", "SPARSA_NO_AVX512", "SPARSA_NO_NATIVE"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("SPARSA_ISA", "avx2")  # the fp32 comparison must run the AVX2 pieces too
    assert gk.native_library() is not None, "native grouped_nm kernel failed to build"
    gen = torch.Generator().manual_seed(8)
    for nmg in [(1, 4, 2), (2, 4, 1)]:
        w, vb, wd = _gnm_weight(37, 85, *nmg, gen)
        x = torch.randn(3, 45, 85, generator=gen).to(BF)
        for kind in ("forward", "pattern", "pair", "input_grad"):
            if kind == "pair" and nmg[0] != 1:
                continue
            plan, plan32 = _gnm_plan(kind, vb, w), _gnm_plan(kind, vb.float(), w)
            xin = torch.randn(3, 45, 37, generator=gen).to(BF) if kind == "input_grad" else x
            nout = 85 if kind == "input_grad" else 37
            for b in (None,) if kind == "input_grad" else (None, _bias("f32", 37, gen), _bias("bf16", 37, gen)):
                assert gk.spmm_native_kind(xin, plan.vals, b) == "bf16"
                exp = gk.spmm(xin.float(), plan32, None if b is None else b.float(), nout).to(BF)
                with monkeypatch.context() as mp:
                    mp.setattr(gk, "spmm_reference", _no_reference)
                    y = gk.spmm(xin, plan, b, nout)
                    y_op = gk.grouped_nm_spmm(
                        xin,
                        plan.idx,
                        plan.vals,
                        plan.out_rows,
                        b,
                        nout,
                        plan.units,
                        plan.unit_entries,
                        plan.unit_span,
                        plan.gpb,
                        plan.rpb,
                        plan.interleaved,
                        plan.offsets,
                    )
                assert torch.equal(y, exp) and torch.equal(y_op, exp), (nmg, kind)
    assert gk.spmm_native_kind(x, vb.float(), None) is None and gk.spmm_native_kind(x.float(), vb, None) is None


def test_grouped_nm_bf16_no_pair_plans():
    """bf16 forward plans are never block-pair plans (their AVX-512 pieces are fp32-only)."""
    gen = torch.Generator().manual_seed(9)
    w, vb, _ = _gnm_weight(64, 1024, 1, 4, 4, gen)
    assert gk.forward_plan(vb, w.columns, 1, 4).offsets is None


def _spy_linear_paths(monkeypatch):
    """Record what F.linear on a grouped_nm weight runs: ("twin",) for the sliced_ell kernel, else
    (x dtype, plan value dtype, block-pair plan?) of each grouped spmm."""
    ran = []
    spmm, twin = gk.spmm, se.sliced_ell_linear_kernel
    monkeypatch.setattr(
        gk, "spmm", lambda xx, p, *a: ran.append((xx.dtype, p.vals.dtype, p.offsets is not None)) or spmm(xx, p, *a)
    )
    monkeypatch.setattr(se, "sliced_ell_linear_kernel", lambda *a, **k: ran.append(("twin",)) or twin(*a, **k))
    return ran


@pytest.mark.parametrize("bias_kind", [None, "bf16"])
def test_grouped_nm_bf16_linear_path(path, bias_kind, monkeypatch):
    """F.linear on a bf16 1:m weight with bf16 tokens: where the CPU has the sliced_ell VDPBF16PS rows, they run
    on the weight's SlicedELL twin (exactly its pattern and values); else the fp32 block-pair plan where its
    pieces run (the fp32 kernel's result on the widened operands, rounded once); else the bf16 plan."""
    gen = torch.Generator().manual_seed(13)
    wdense = torch.randn(64, 512, generator=gen).to(BF)
    w = sparsa.to_sparse(wdense, "grouped_nm", n=1, m=4, g=4)
    lay = w.sparse_layout
    x = torch.randn(2, 40, 512, generator=gen).to(BF)
    b = _bias(bias_kind, 64, gen)
    ran = _spy_linear_paths(monkeypatch)
    y = torch.nn.functional.linear(x, w, b)
    _check(y, x, w.to_dense().float(), b)
    if se.has_dpbf16():
        assert ran == [("twin",)] and path in ("avx512", "default")
        twin = native_grouped_nm._sliced_ell_twin(lay)
        assert torch.equal(twin.mask(), lay.mask()) and torch.equal(twin.to_dense(), lay.to_dense())
        assert torch.equal(y, se.sliced_ell_linear_impl(x, twin.slice_ptr, twin.columns, twin.values, b, 64))
        return
    widened = gk.pairs_when_widened(lay.values, 1, 4)
    assert widened == (path in ("avx512", "default") and cpu.hardware_isa() == "avx512")
    assert ran == [(torch.float32, torch.float32, True) if widened else (BF, BF, False)]
    if widened:
        plan32 = gk.forward_plan(lay.values.float(), lay.columns, 1, 4)
        assert plan32.offsets is not None  # a block-pair plan
        exp = gk.spmm(x.float(), plan32, None if b is None else b.float(), 64).to(BF)
        assert torch.equal(y, exp)
    # a 2:4 weight has no pair plan to widen to
    assert not gk.pairs_when_widened(sparsa.to_sparse(wdense, "grouped_nm", n=2, m=4, g=4).sparse_layout.values, 2, 4)


def test_grouped_nm_bf16_twin_cached_rebuilt_after_update_and_not_for_one_token(monkeypatch):
    if not se.has_dpbf16():
        pytest.skip("this CPU (or SPARSA_ISA) has no AVX512-BF16: the sliced_ell dot-product rows do not run")
    gen = torch.Generator().manual_seed(21)
    w = sparsa.to_sparse(torch.randn(48, 96, generator=gen).to(BF), "grouped_nm", n=2, m=4, g=4)
    lay = w.sparse_layout
    built = []
    real = SlicedELL.from_dense
    monkeypatch.setattr(SlicedELL, "from_dense", lambda *a, **k: built.append(1) or real(*a, **k))
    x = torch.randn(7, 96, generator=gen).to(BF)
    y1 = torch.nn.functional.linear(x, w)
    torch.nn.functional.linear(x, w)
    assert len(built) == 1  # cached with the plans
    with torch.no_grad():
        lay.values.mul_(2)
    y2 = torch.nn.functional.linear(x, w)
    assert len(built) == 2
    _check(y2, x, w.to_dense().float(), None)
    torch.testing.assert_close(y2.float(), 2 * y1.float(), rtol=RTOL, atol=1e-2)
    ran = _spy_linear_paths(monkeypatch)
    y = torch.nn.functional.linear(x[:1], w)  # one token: the grouped stream of plans, no twin
    assert ran and ("twin",) not in ran
    _check(y, x[:1], w.to_dense().float(), None)


def test_grouped_nm_bf16_nan_inf_propagate(path):
    gen = torch.Generator().manual_seed(6)
    R, K, T = 12, 40, 20
    w, vb, wd = _gnm_weight(R, K, 1, 4, 2, gen)
    x = torch.randn(T, K, generator=gen).to(BF)
    c = 17
    users = wd[:, c] != 0
    assert users.any()
    x[3, c] = float("nan")
    x[9, c] = float("inf")
    y = gk.spmm(x, _gnm_plan("forward", vb, w), None, R).float()
    assert torch.isnan(y[3, users]).all()
    assert not torch.isfinite(y[9, users]).any()
    clean = [t for t in range(T) if t not in (3, 9)]
    assert torch.isfinite(y[clean]).all()


@pytest.mark.parametrize("layout", ["sliced_ell", "grouped_nm"])
def test_bf16_backward_input_grad(path, layout):
    """grad_x of F.linear with bf16 operands (grouped_nm: the native bf16 spmm on the input-grad plan)."""
    gen = torch.Generator().manual_seed(12)
    wdense = torch.randn(19, 45, generator=gen).to(BF)
    kw = {"sparsity": 0.8} if layout == "sliced_ell" else {"n": 1, "m": 4, "g": 2}
    w = sparsa.to_sparse(wdense, layout, **kw)
    x = torch.randn(2, 13, 45, generator=gen).to(BF).requires_grad_(True)
    gy = torch.randn(2, 13, 19, generator=gen).to(BF)
    torch.nn.functional.linear(x, w).backward(gy)
    assert x.grad.dtype == BF
    _check(x.grad, gy, w.to_dense().float().t(), None)


def test_bf16_rows_see_a_pruned_weight_at_its_nominal_density(monkeypatch):
    # 70% of 1536 columns keeps 461 per row (0.30013): the rows' choice must get 0.3, the grid point the
    # crossover sliced_ell.fma_rows_bf16 is measured and stored at
    if se.native_library() is None:
        pytest.skip("no native kernel here")
    seen = []
    real = se.bf16_rows
    monkeypatch.setattr(se, "bf16_rows", lambda density, rows=None: seen.append(density) or real(density, rows))
    w = torch.randn(32, 1536)
    mask = torch.zeros_like(w, dtype=torch.bool).scatter_(1, w.abs().topk(461, dim=1).indices, True)  # per row
    e = SlicedELL.from_dense(w, mask=mask)
    assert e.values.numel() / (32 * 1536) > 0.3  # rows of equal length: no slice padding
    se.sliced_ell_linear_impl(torch.randn(4, 1536).bfloat16(), e.slice_ptr, e.columns, e.values.bfloat16(), None, 32)
    assert seen == [0.3]
