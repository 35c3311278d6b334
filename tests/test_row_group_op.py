"""``sparsa::row_group_linear`` as a first-class op: float32 and bfloat16 operands, the fused GELU
epilogue, every ISA path this CPU has plus the PyTorch fallback, autograd and ``opcheck``."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st

import sparsa
from sparsa import cpu
from sparsa.kernels import row_group as rg
from sparsa.kernels.epilogue import activation_code
from sparsa.layouts import RowGroup

PATHS = ["amx", "avx512", "avx2", "fallback"]


@pytest.fixture
def path(request, monkeypatch):
    """Run the test on one kernel path; a path this CPU lacks is skipped, naming the missing flag."""
    p = request.param
    monkeypatch.delenv("SPARSA_NO_AVX512", raising=False)
    if p == "fallback":
        monkeypatch.setenv("SPARSA_NO_NATIVE", "1")
        assert rg.native_library() is None
        return p
    monkeypatch.delenv("SPARSA_NO_NATIVE", raising=False)
    have = cpu.hardware_isa()
    if cpu.ISA_LEVELS.index(have) < cpu.ISA_LEVELS.index(p):
        missing = {"amx": "amx_bf16", "avx512": "avx512f/bw/vl/dq", "avx2": "avx2/fma"}[p]
        pytest.skip(f"this CPU has no {missing} (best kernel path here: {have})")
    monkeypatch.setenv("SPARSA_ISA", p)
    assert cpu.isa() == p
    assert rg.native_library() is not None, "native row_group kernel failed to build"
    return p


def _reference(x, lay, bias, activation):
    """float64 product of the operands exactly as given (already rounded to their dtype)."""
    y = F.linear(x.double(), lay.to_dense().double(), None if bias is None else bias.double())
    return F.gelu(y) if activation == "gelu" else y


def _accumulated(x, lay, bias):
    """float64 ``|x| @ |W|^T + |b|``: the magnitude the kernel's fp32 sums run through."""
    return F.linear(x.double().abs(), lay.to_dense().double().abs(), None if bias is None else bias.double().abs())


def _check(y, ref, dtype, acc):
    assert y.dtype == dtype
    # fp32: accumulation-order rounding, bounded by the accumulated magnitudes (not by the output, which
    # cancellation can make tiny); bf16 adds one rounding of the output (2^-8 relative)
    bound = 2e-6 * acc.max().clamp_min(1e-6).item()
    if dtype == torch.bfloat16:
        bound += 8e-3 * ref.abs().max().clamp_min(1e-6).item()
    err = (y.double() - ref).abs().max().item()
    assert err <= bound, f"max error {err:.2e} above the bound {bound:.2e}"


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["none", "gelu"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    group=st.sampled_from([4, 8, 16, 32]),
    out_features=st.integers(1, 70),
    in_features=st.integers(1, 2600),
    tokens=st.sampled_from([0, 1, 2, 5, 7, 13, 33]),
    sparsity=st.sampled_from([0.5, 0.75, 0.9]),
    permute=st.booleans(),
    bias=st.booleans(),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_matches_float64_reference(
    path, dtype, activation, group, out_features, in_features, tokens, sparsity, permute, bias, threads, seed
):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen)
    lay = RowGroup.from_dense(w, group=group, sparsity=sparsity, permute=permute)
    lay = RowGroup(lay.columns, lay.values.to(dtype), lay.shape, lay.row_perm, validate=False)
    x = torch.randn(tokens, in_features, generator=gen).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype) if bias else None
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = rg.row_group_linear(x, lay.columns, lay.values, b, out_features, lay.row_perm, activation)
    finally:
        torch.set_num_threads(old)
    assert y.shape == (tokens, out_features)
    if tokens:
        _check(y, _reference(x, lay, b, activation), dtype, _accumulated(x, lay, b))


@pytest.mark.parametrize("path", ["avx2"], indirect=True)
def test_native_path_is_taken(path, monkeypatch):
    # a native run must never quietly become the reference
    def boom(*a, **k):
        raise AssertionError("reference ran although the native kernel is available")

    monkeypatch.setattr(rg, "row_group_linear_reference", boom)
    lay = RowGroup.from_dense(torch.randn(32, 40), group=16, sparsity=0.5)
    for dtype in (torch.float32, torch.bfloat16):
        rg.row_group_linear_impl(
            torch.randn(3, 40).to(dtype), lay.columns, lay.values.to(dtype), None, 32, lay.row_perm, "gelu"
        )


def test_bf16_output_is_rounded_once():
    # native and reference both round the float32 result to bf16 once: bit-identical up to accumulation order
    gen = torch.Generator().manual_seed(3)
    lay = RowGroup.from_dense(torch.randn(48, 64, generator=gen), group=16, sparsity=0.5)
    v = lay.values.bfloat16()
    x = torch.randn(9, 64, generator=gen).bfloat16()
    want = F.linear(x.float(), RowGroup(lay.columns, v, lay.shape, lay.row_perm, validate=False).to_dense().float())
    got = rg.row_group_linear_impl(x, lay.columns, v, None, 48, lay.row_perm)
    assert (got.float() - want).abs().max() <= want.abs().max() * 2**-8


@pytest.mark.parametrize("path", ["avx2", "fallback"], indirect=True)
def test_bf16_rounds_ties_to_even(path):
    # exact float32 sums 256 + odd are bf16 ties (8 significant bits): round to the even neighbour,
    # in the vector stores (first 16 outputs) and the scalar tail (3 more)
    R, G = 19, 16
    columns = torch.tensor([[0, 1], [0, 1]], dtype=torch.int32)
    odd = torch.arange(R, dtype=torch.float32) * 2 + 1  # 1, 3, 5, ... (exact in bf16)
    values = torch.zeros(2, 2, G)
    values[:, 0, :] = 1.0
    second = torch.zeros(2 * G)
    second[:R] = odd
    values[:, 1, :] = second.view(2, G)
    lay = RowGroup(columns, values.bfloat16(), (R, 2), torch.arange(2 * G, dtype=torch.int32), validate=False)
    x = torch.tensor([[256.0, 1.0]]).bfloat16()
    y = rg.row_group_linear_impl(x, lay.columns, lay.values, None, R, lay.row_perm)
    exact = 256 + odd  # 257, 259, ...: all ties
    want = torch.where((exact.to(torch.int64) // 2) % 2 == 0, exact - 1, exact + 1)
    assert torch.equal(y.float()[0], want), (y.float()[0], want)


@pytest.mark.parametrize("path", ["avx2"], indirect=True)
def test_nan_and_inf_propagate(path):
    lay = RowGroup.from_dense(torch.ones(16, 8), group=16, sparsity=0.5)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.ones(2, 8, dtype=dtype)
        x[0, lay.columns[0, 0]] = float("nan")
        x[1, lay.columns[0, 0]] = float("inf")
        y = rg.row_group_linear_impl(x, lay.columns, lay.values.to(dtype), None, 16, lay.row_perm, "gelu")
        assert torch.isnan(y[0]).all() and torch.isinf(y[1]).all()


def _bf16_tiles(tiles, group, monkeypatch):
    """``run(x, columns, values, bias, R, row_perm, activation)`` on the bf16 tile kernel ``tiles`` (``amx``:
    AMX-BF16; ``amx_emulated``: the same kernel with software tiles; ``dp``: AVX512-BF16 dot products,
    forced below AMX), or skip, naming what this CPU lacks."""
    monkeypatch.delenv("SPARSA_NO_NATIVE", raising=False)
    monkeypatch.delenv("SPARSA_NO_AVX512", raising=False)
    monkeypatch.delenv("SPARSA_ISA", raising=False)
    assert group in (4, 8, 16, 32)
    if tiles == "amx_emulated":
        lib = rg.emulated_amx_library()
        if lib is None or not lib.sparsa_row_group_has_amx():
            pytest.skip("the software AMX tiles run inside the AVX-512 kernels: this CPU has no AVX-512")

        def run(x, columns, values, bias, R, row_perm, activation="none"):
            return rg._native_forward(
                lib, "bf16", x, columns, values, bias, R, row_perm, activation_code(activation, "test")
            )

        return run
    if tiles == "amx":
        if not rg.has_amx():
            pytest.skip(f"the AMX tiles do not run here: {rg.amx_status()}")
    else:
        monkeypatch.setenv("SPARSA_ISA", "avx512")
        if not rg.has_dpbf16():
            pytest.skip("this CPU has no avx512_bf16: the bf16 dot-product tiles do not run")
        assert not rg.has_amx()
    return rg.row_group_linear_impl


TILES = ["amx", "amx_emulated", "dp"]


@pytest.mark.parametrize(
    ("tiles", "group"), [(t, g) for t in TILES for g in (4, 8, 16, 32)]
)  # the AMX tiles take groups of 4 and 8 in the first rows of 16-row tiles
@pytest.mark.parametrize("permute", [False, True])
@pytest.mark.parametrize("activation", ["none", "gelu"])
def test_bf16_dot_product_tiles(tiles, group, permute, activation, monkeypatch):
    # 16 bf16 tokens or more take the bf16 tiles: pairs of kept columns (odd k leaves a lone last column;
    # AMX: blocks of 32, whole or with a partial last one), token panels of 16/32/64 with a partial last
    # one, a partial last group, 1 and 2 threads
    run = _bf16_tiles(tiles, group, monkeypatch)
    gen = torch.Generator().manual_seed(group + permute)
    old = torch.get_num_threads()
    try:
        for K, sparsity in ((301, 0.5), (64, 0.75), (128, 0.5), (1030, 0.9)):
            lay = RowGroup.from_dense(
                torch.randn(2 * group + 3, K, generator=gen), group=group, sparsity=sparsity, permute=permute
            )
            lay = RowGroup(lay.columns, lay.values.bfloat16(), lay.shape, lay.row_perm, validate=False)
            b = torch.randn(lay.shape[0], generator=gen).bfloat16()
            for T, threads in ((16, 1), (17, 2), (47, 2), (130, 1)):
                torch.set_num_threads(threads)
                x = torch.randn(T, K, generator=gen).bfloat16()
                y = run(x, lay.columns, lay.values, b, lay.shape[0], lay.row_perm, activation)
                _check(y, _reference(x, lay, b, activation), torch.bfloat16, _accumulated(x, lay, b))
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("group", [8, 16, 32])
def test_bf16_tiles_are_exact_for_every_count_of_kept_columns(tiles, group, monkeypatch):
    # every k from 1 to 70 (one to three 32-column blocks, a partial last block of every width, odd and even,
    # and whole blocks): small integers, whose products and sums the tiles compute exactly, so the result is
    # the float64 one rounded once
    run = _bf16_tiles(tiles, group, monkeypatch)
    gen = torch.Generator().manual_seed(group)
    K, T = 75, 40
    x = torch.randint(-2, 3, (T, K), generator=gen).bfloat16()
    for k in range(1, 71):
        dense = torch.randint(-2, 3, (group + 3, K), generator=gen).float()
        lay = RowGroup.from_dense(dense, group=group, sparsity=1 - k / K)
        assert lay.values.shape[1] == k
        values = lay.values.bfloat16()
        y = run(x, lay.columns, values, None, lay.shape[0], lay.row_perm)
        w = RowGroup(lay.columns, values, lay.shape, lay.row_perm, validate=False).to_dense()
        want = x.double() @ w.double().T
        assert torch.equal(y, want.bfloat16()), k


@pytest.mark.parametrize("tiles", TILES)
def test_bf16_dot_product_tiles_propagate_nan_and_inf(tiles, monkeypatch):
    run = _bf16_tiles(tiles, 16, monkeypatch)
    lay = RowGroup.from_dense(torch.ones(16, 9), group=16, sparsity=0.5)  # k = 5: a lone last column
    for c in (lay.columns[0, 0], lay.columns[0, -1]):
        x = torch.ones(16, 9, dtype=torch.bfloat16)
        x[0, c] = float("nan")
        x[1, c] = float("inf")
        y = run(x, lay.columns, lay.values.bfloat16(), None, 16, lay.row_perm)
        assert torch.isnan(y[0]).all() and torch.isinf(y[1]).all() and torch.isfinite(y[2:]).all()


def test_amx_status_names_why_the_tiles_do_not_run(monkeypatch):
    if rg.native_library() is None:
        pytest.skip("no native kernel here")
    status = rg.amx_status()
    if cpu.hardware_isa() == "amx":  # the tiles' product is right (an OS may still refuse tile data)
        assert status == "ok" or status.startswith("the OS refused"), status
    else:
        assert status.startswith("this CPU has no amx_bf16"), status
    emu = rg.emulated_amx_library()
    if emu is not None and cpu.hardware_isa() in ("avx512", "amx"):
        assert rg.amx_status(emu) == "ok"  # the software tiles' self-check


def test_bf16_dot_product_gelu_epilogue_matches_torch(monkeypatch):
    # identity weights make the products exact, so the epilogue's GELU (16 lanes) sees bf16 inputs as they
    # are: rounded once, it must give torch's GELU within one bf16 rounding plus the erf approximation's
    # absolute error (4e-7 times |x| / 2, which dominates in the far negative tail)
    monkeypatch.delenv("SPARSA_ISA", raising=False)
    if not rg.has_dpbf16():
        pytest.skip("this CPU has no avx512_bf16 (or SPARSA_ISA is below avx512): the bf16 tiles do not run")
    w = torch.cat([torch.eye(16), torch.zeros(16, 16)], dim=1)
    lay = RowGroup.from_dense(w, group=16, sparsity=0.5)
    assert torch.equal(lay.to_dense(), w)
    x = (torch.randn(500, 32, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    y = rg.row_group_linear_impl(x, lay.columns, lay.values.bfloat16(), None, 16, lay.row_perm, "gelu")
    exact = F.gelu(x[:, :16].double())
    bound = 2.0**-8 * exact.abs() + 1e-6 * x[:, :16].double().abs()
    assert ((y.double() - exact).abs() <= bound).all()
    monkeypatch.setenv("SPARSA_ISA", "avx2")  # the same operations on 8 lanes: the same bits
    y8 = rg.row_group_linear_impl(x, lay.columns, lay.values.bfloat16(), None, 16, lay.row_perm, "gelu")
    assert torch.equal(y, y8)


def test_bf16_dot_product_tiles_follow_sparsa_isa(monkeypatch):
    if rg.native_library() is None:
        pytest.skip("no native kernel here")
    monkeypatch.setenv("SPARSA_ISA", "avx2")
    assert not rg.has_dpbf16() and not rg.has_amx()
    monkeypatch.setenv("SPARSA_ISA", "avx512")
    assert not rg.has_amx()
    monkeypatch.delenv("SPARSA_ISA")
    assert rg.has_dpbf16() == bool(cpu.cpu_flags()["avx512_bf16"] and cpu.hardware_isa() in ("avx512", "amx"))
    assert rg.has_amx() <= (cpu.hardware_isa() == "amx")  # the OS may still refuse tile data


def test_unknown_activation_is_a_clear_error():
    lay = RowGroup.from_dense(torch.randn(16, 8), group=16, sparsity=0.5)
    with pytest.raises(ValueError, match="activation must be one of"):
        rg.row_group_linear_impl(torch.randn(2, 8), lay.columns, lay.values, None, 16, lay.row_perm, "relu6")


def test_unknown_isa_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv("SPARSA_ISA", "sse9")
    lay = RowGroup.from_dense(torch.randn(16, 8), group=16, sparsity=0.5)
    with pytest.raises(ValueError, match=r"SPARSA_ISA='sse9' is not a kernel path; use one of") as e:
        rg.row_group_linear_impl(torch.randn(2, 8), lay.columns, lay.values, None, 16, lay.row_perm)
    assert "\n" not in str(e.value)


def test_isa_never_exceeds_the_cpu(monkeypatch):
    monkeypatch.setenv("SPARSA_ISA", "amx")
    assert cpu.isa() == cpu.hardware_isa()
    monkeypatch.setenv("SPARSA_ISA", "avx2")
    assert cpu.isa() in ("portable", "avx2")
    monkeypatch.setenv("SPARSA_ISA", "portable")
    from sparsa.kernels import loader

    assert not loader.native_enabled()


@pytest.mark.parametrize("activation", ["none", "gelu"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("permute", [False, True])
def test_gradcheck(activation, bias, permute):
    # float64 runs the reference forward; the autograd formula is the op's own
    gen = torch.Generator().manual_seed(5)
    lay = RowGroup.from_dense(torch.randn(20, 12, generator=gen), group=8, sparsity=0.5, permute=permute)
    vals = lay.values.double().requires_grad_()
    x = torch.randn(3, 12, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(20, dtype=torch.float64, generator=gen, requires_grad=True) if bias else None
    fn = lambda x, v, b: rg.row_group_linear(x, lay.columns, v, b, 20, lay.row_perm, activation)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, vals, b))


@pytest.mark.parametrize("path", ["avx2", "fallback"], indirect=True)
@pytest.mark.parametrize("activation", ["none", "gelu"])
def test_native_gradients_match_dense_autograd(path, activation):
    gen = torch.Generator().manual_seed(11)
    lay = RowGroup.from_dense(torch.randn(40, 50, generator=gen), group=8, sparsity=0.75, permute=True)
    x = torch.randn(2, 7, 50, generator=gen, requires_grad=True)
    v = lay.values.clone().requires_grad_()
    b = torch.randn(40, generator=gen, requires_grad=True)
    y = rg.row_group_linear(x, lay.columns, v, b, 40, lay.row_perm, activation)
    gy = torch.randn_like(y)
    gx, gv, gb = torch.autograd.grad(y, (x, v, b), gy)
    xr, br = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    wd = RowGroup(lay.columns, v.detach(), lay.shape, lay.row_perm, validate=False).to_dense().requires_grad_()
    yr = F.linear(xr, wd, br)
    yr = F.gelu(yr) if activation == "gelu" else yr
    gxr, gwr, gbr = torch.autograd.grad(yr, (xr, wd, br), gy)
    torch.testing.assert_close(gx, gxr, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gb, gbr, rtol=1e-4, atol=1e-4)
    gw = RowGroup(lay.columns, gv, lay.shape, lay.row_perm, validate=False).to_dense()
    torch.testing.assert_close(gw, gwr * lay.mask(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["none", "gelu"])
def test_opcheck(dtype, activation):
    gen = torch.Generator().manual_seed(2)
    lay = RowGroup.from_dense(torch.randn(24, 20, generator=gen), group=8, sparsity=0.5, permute=True)
    x = torch.randn(5, 20, generator=gen).to(dtype).requires_grad_()
    v = lay.values.to(dtype).requires_grad_()
    b = torch.randn(24, generator=gen).to(dtype).requires_grad_()
    torch.library.opcheck(
        torch.ops.sparsa.row_group_linear.default, (x, lay.columns, v, b, 24, lay.row_perm, activation)
    )
    torch.library.opcheck(
        torch.ops.sparsa.row_group_linear.default, (x.detach(), lay.columns, v.detach(), None, 24, None, activation)
    )


def _amx_lib(tiles):
    lib = rg.emulated_amx_library() if tiles == "amx_emulated" else rg.native_library()
    if lib is None or not lib.sparsa_row_group_has_amx():
        pytest.skip(f"the {tiles} tiles do not run here: {rg.amx_status()}")
    return lib


@pytest.mark.parametrize("tiles", ["amx", "amx_emulated"])
@pytest.mark.parametrize("group", [4, 8, 16, 32])
def test_amx_pack_is_made_once_and_remade_after_an_in_place_update(tiles, group, monkeypatch):
    # the AMX tiles read the weight's pack (made once per weight) instead of reordering it on every call;
    # the results equal those of a call that reorders it (no pack), also after values change in place
    for v in ("SPARSA_NO_NATIVE", "SPARSA_NO_AVX512", "SPARSA_ISA"):
        monkeypatch.delenv(v, raising=False)
    lib = _amx_lib(tiles)
    gen = torch.Generator().manual_seed(group)
    lay = RowGroup.from_dense(torch.randn(2 * group + 5, 77, generator=gen), group=group, sparsity=0.6)
    values = lay.values.bfloat16()
    x = torch.randn(40, 77, generator=gen).bfloat16()
    R = lay.shape[0]

    def run(packed=True):
        with monkeypatch.context() as m:
            if not packed:
                m.setattr(rg, "amx_pack", lambda lib, values: None)
            return rg._native_forward(lib, "bf16", x, lay.columns, values, None, R, lay.row_perm, 0)

    y = run()
    first = getattr(values, rg._PACK_ATTR)[1].data_ptr()
    assert torch.equal(run(), y) and getattr(values, rg._PACK_ATTR)[1].data_ptr() == first  # the same pack, reused
    assert torch.equal(run(packed=False), y)
    with torch.no_grad():
        values.mul_(-2)
    y2 = run()
    assert torch.equal(y2, run(packed=False)) and not torch.equal(y2, y)
    lay2 = RowGroup(lay.columns, values, lay.shape, lay.row_perm, validate=False)
    _check(y2, _reference(x, lay2, None, "none"), torch.bfloat16, _accumulated(x, lay2, None))
    with torch.inference_mode():  # no version counter: a pack per call, never cached
        vi = values.clone()
        yi = rg._native_forward(lib, "bf16", x, lay.columns, vi, None, R, lay.row_perm, 0)
    assert torch.equal(yi, y2) and not hasattr(vi, rg._PACK_ATTR)


def test_a_weight_sparsified_in_inference_mode_keeps_its_amx_pack(monkeypatch):
    # a model pruned and converted under inference mode used to hold inference tensors, whose pack was
    # rebuilt on every call (no version counter to key it on): 2.3x slower per layer on intel-amx
    for v in ("SPARSA_NO_NATIVE", "SPARSA_NO_AVX512", "SPARSA_ISA"):
        monkeypatch.delenv(v, raising=False)
    _amx_lib("amx")
    gen = torch.Generator().manual_seed(3)
    dense = torch.randn(48, 96, generator=gen)
    x = torch.randn(20, 96, generator=gen).bfloat16()
    with torch.inference_mode():
        w = sparsa.to_sparse(dense, "row_group", group=16, sparsity=0.75).to(torch.bfloat16)
        values = w.sparse_layout.values
        y = F.linear(x, w)
        pack = getattr(values, rg._PACK_ATTR)[1]
        assert torch.equal(F.linear(x, w), y) and getattr(values, rg._PACK_ATTR)[1] is pack
    torch.testing.assert_close(y.float(), x.float() @ w.to_dense().float().T, rtol=2e-2, atol=2e-2)


def test_amx_pack_rejects_what_the_tiles_cannot_read():
    lib = _amx_lib("amx_emulated") if rg.emulated_amx_library() is not None else _amx_lib("amx")
    vals = torch.zeros(2, 40, 16, dtype=torch.bfloat16)
    assert lib.sparsa_row_group_amx_pack_size(2, 40, 2) == 0  # no group size of RowGroup's
    n = int(lib.sparsa_row_group_amx_pack_size(2, 40, 16))
    assert n == 2 * 2 * 16 * 32  # two groups of two 32-column blocks of 16 rows
    buf = torch.empty(n + 64, dtype=torch.bfloat16)
    off = (-buf.data_ptr()) % 64
    assert lib.sparsa_row_group_amx_pack(vals.data_ptr(), 2, 40, 16, buf.data_ptr() + off, 1) == 0
    assert lib.sparsa_row_group_amx_pack(vals.data_ptr(), 2, 40, 16, buf.data_ptr() + off + 2, 1) == -1  # misaligned
    assert lib.sparsa_row_group_amx_pack(vals.data_ptr(), 2, 40, 2, buf.data_ptr() + off, 1) == -1


@pytest.mark.parametrize("group", [4, 8])
def test_amx_pack_of_small_groups_fills_the_first_rows_of_16_row_tiles(group):
    # groups of 4 or 8 rows run 16-row tiles: their rows first, zero weights below (never stored)
    lib = _amx_lib("amx_emulated") if rg.emulated_amx_library() is not None else _amx_lib("amx")
    ng, k = 3, 40
    vals = (torch.arange(ng * k * group) % 251 - 125).reshape(ng, k, group).to(torch.bfloat16)  # exact in bf16
    n = int(lib.sparsa_row_group_amx_pack_size(ng, k, group))
    assert n == ng * 2 * 16 * 32  # per group: two 32-column blocks of a 16-row tile
    buf = torch.empty(n + 64, dtype=torch.bfloat16)
    off = (-buf.data_ptr()) % 64
    assert lib.sparsa_row_group_amx_pack(vals.data_ptr(), ng, k, group, buf.data_ptr() + off, 1) == 0
    got = buf[off // 2 : off // 2 + n].reshape(ng, 2, 16, 32)  # [group, block, tile row, column in block]
    want = torch.zeros(ng, 64, 16, dtype=torch.bfloat16)
    want[:, :k, :group] = vals
    assert torch.equal(got, want.reshape(ng, 2, 32, 16).transpose(2, 3))
