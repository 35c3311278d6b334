"""GroupedNM linear: native kernels and pure-PyTorch fallback, forward and backward, vs the dense reference."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st

import sparsa
from sparsa.kernels import grouped_nm as kern
from sparsa.layouts import GroupedNM
from sparsa.ops import native_grouped_nm

PATHS = ["native", "fallback"]
# (n, m): 1:m (interleaved plans, Q = 4, 2, 5 or 1), 2:m and n > 4 (several register pieces)
NMS = [(1, 4), (1, 10), (1, 7), (1, 5), (2, 4), (2, 8), (3, 5), (5, 8), (1, 2), (1, 3)]


@pytest.fixture
def path(request, monkeypatch):
    if request.param == "fallback":
        monkeypatch.setenv("SPARSA_NO_NATIVE", "1")
        assert kern.native_library() is None
    else:
        monkeypatch.delenv("SPARSA_NO_NATIVE", raising=False)
        assert kern.native_library() is not None, "native grouped_nm kernel failed to build"
    return request.param


@pytest.fixture(autouse=True)
def _restore_threads():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def _close(y, ref, tol=1e-4):
    scale = max(1.0, float(ref.abs().max())) if ref.numel() else 1.0
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol * scale)


def _input(lead, K, noncontig, gen, dtype=torch.float32):
    if noncontig:  # a transposed view: same logical values, strided storage
        return torch.randn(K, *lead, generator=gen, dtype=dtype).movedim(0, -1)
    return torch.randn(*lead, K, generator=gen, dtype=dtype)


def _weight(R, K, n, m, g, gen, dtype=torch.float32):
    return sparsa.to_sparse(torch.randn(R, K, generator=gen, dtype=dtype), "grouped_nm", n=n, m=m, g=g)


def test_registered_over_the_pure_torch_implementation():
    impls = sparsa.ops.registered_impls("linear")
    assert impls[("linear", ("dense", "grouped_nm", "dense"))] == "GroupedNMLinear"


# ---------------------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("path", PATHS, indirect=True)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    T=st.integers(1, 40),
    R=st.integers(1, 45),
    K=st.integers(1, 70),
    nm=st.sampled_from(NMS),
    g=st.integers(1, 4),
    bias=st.booleans(),
    three_d=st.booleans(),
    noncontig=st.booleans(),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_forward_matches_dense(path, T, R, K, nm, g, bias, three_d, noncontig, threads, seed):
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(seed)
    w = _weight(R, K, *nm, g, gen)
    lead = (2, -(-T // 2)) if three_d else (T,)
    x = _input(lead, K, noncontig, gen)
    b = torch.randn(R, generator=gen) if bias else None
    sparsa.reset_fallback_counts()
    y = F.linear(x, w, b)
    assert y.shape == (*lead, R) and y.dtype == torch.float32
    _close(y, F.linear(x, w.to_dense(), b))
    assert sparsa.fallback_counts() == {}


@pytest.mark.parametrize("nm", [(1, 4), (1, 8), (1, 10), (1, 3)])
@pytest.mark.parametrize("tile_bytes", [0, 24 << 10])
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_interleaved_plans_large_k_tiles(nm, tile_bytes, isa, monkeypatch):
    # many units per group: the default tile of sparse interleaved plans spans more than an L1 tile;
    # both builds of the interleaved pieces (AVX-512 when the CPU has it, else both runs take AVX2)
    monkeypatch.delenv("SPARSA_NO_NATIVE", raising=False)
    if isa == "avx2":
        monkeypatch.setenv("SPARSA_NO_AVX512", "1")
    else:
        monkeypatch.delenv("SPARSA_NO_AVX512", raising=False)
    monkeypatch.setattr(kern, "TILE_BYTES", tile_bytes)
    gen = torch.Generator().manual_seed(nm[1])
    n, m = nm
    R, K = 3 * m + 1, 2000
    w = GroupedNM.from_dense(torch.randn(R, K, generator=gen), n=n, m=m, g=4)
    wd = w.to_dense()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for T in (5, 50, 101):
            x, gy = torch.randn(T, K, generator=gen), torch.randn(T, R, generator=gen)
            _close(kern.spmm(x, kern.forward_plan(w.values, w.columns, n, m), None, R), x @ wd.T)
            _close(kern.spmm(gy, kern.input_grad_plan(w.values, w.columns, n, m), None, K), gy @ wd)


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("nm", [(1, 4), (1, 10), (2, 4), (5, 8)])
@pytest.mark.parametrize("T", [1, 7, 8, 9, 33, 97, 130])
@pytest.mark.parametrize("threads", [1, 2])
def test_plans_token_remainders(path, nm, T, threads):
    """Every plan (forward, pattern, input-grad) and sddmm vs the dense products, across panel tails."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(T * 10 + nm[1])
    n, m = nm
    R, K = 2 * m + 3, 41
    w = GroupedNM.from_dense(torch.randn(R, K, generator=gen), n=n, m=m, g=3)
    wd = w.to_dense()
    x, gy, b = torch.randn(T, K, generator=gen), torch.randn(T, R, generator=gen), torch.randn(R, generator=gen)
    for plan in (kern.forward_plan(w.values, w.columns, n, m), kern.pattern_plan(w.values, w.columns, n, m)):
        _close(kern.spmm(x, plan, b, R), x @ wd.T + b)
    _close(kern.spmm(gy, kern.input_grad_plan(w.values, w.columns, n, m), None, K), gy @ wd)
    gv = kern.sddmm(x, gy, kern.pattern_plan(w.values, w.columns, n, m))
    B, C, P, g, _ = w.values.shape
    gw = w._scatter(gv.view(B, P, C, g, n).permute(0, 2, 1, 3, 4))
    _close(gw, (gy.T @ x) * w.mask())


@pytest.mark.parametrize("path", ["native-avx512", "native-avx2", "fallback"])
@pytest.mark.parametrize(
    "m,R,K,unit_cols", [(4, 13, 200, 0), (4, 16, 300, 64), (10, 25, 410, 80), (2, 7, 33, 0), (3, 9, 61, 12)]
)
def test_block_pair_plans(path, m, R, K, unit_cols, monkeypatch):
    """Block-pair plans (1:m rows of two blocks share an entry; odd block counts, several units, varying runs)."""
    if path == "fallback":
        monkeypatch.setenv("SPARSA_NO_NATIVE", "1")
    else:
        monkeypatch.delenv("SPARSA_NO_NATIVE", raising=False)
        if path == "native-avx2":
            monkeypatch.setenv("SPARSA_NO_AVX512", "1")
        else:
            monkeypatch.delenv("SPARSA_NO_AVX512", raising=False)
    gen = torch.Generator().manual_seed(R * K)
    w = GroupedNM.from_dense(torch.randn(R, K, generator=gen), n=1, m=m, g=2)
    wd = w.to_dense()
    plan = kern.pair_plan(w.values, w.columns, 1, m, unit_cols)
    assert plan.offsets is not None and plan.offsets.shape == (plan.groups, plan.units + 1)
    if unit_cols:
        assert plan.units > 1
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for T in (1, 9, 70, 200):
            x, b = torch.randn(T, K, generator=gen), torch.randn(R, generator=gen)
            _close(kern.spmm(x, plan, b, R), x @ wd.T + b)
    with pytest.raises(ValueError, match="pattern_plan"):
        kern.sddmm(torch.randn(3, K), torch.randn(3, R), plan)


def test_forward_plan_pairs_blocks_for_large_k():
    lib = kern.native_library()
    w = GroupedNM.from_dense(torch.randn(12, 800), n=1, m=4, g=4)
    plan = kern.forward_plan(w.values, w.columns, 1, 4)
    assert (plan.offsets is not None) == bool(lib is not None and lib.sparsa_grouped_nm_has_avx512())
    x = torch.randn(40, 800)
    ws = _weight(12, 800, 1, 4, 4, torch.Generator().manual_seed(1))
    _close(F.linear(x, ws), x @ ws.to_dense().T)
    small = GroupedNM.from_dense(torch.randn(12, 40), n=1, m=4, g=2)
    assert kern.forward_plan(small.values, small.columns, 1, 4).offsets is None


def test_sddmm_rejects_interleaved_plan():
    w = GroupedNM.from_dense(torch.randn(8, 16), n=1, m=4, g=2)
    with pytest.raises(ValueError, match="pattern_plan"):
        kern.sddmm(torch.randn(3, 16), torch.randn(3, 8), kern.forward_plan(w.values, w.columns, 1, 4))


def test_wrong_input_width_names_the_fix():
    w = _weight(8, 16, 1, 4, 2, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="last dimension of 16"):
        F.linear(torch.randn(3, 15), w)


# --------------------------------------------------------------------------------------------- backward
@pytest.mark.parametrize("path", PATHS, indirect=True)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    T=st.integers(1, 30),
    R=st.integers(1, 30),
    K=st.integers(1, 50),
    nm=st.sampled_from(NMS),
    g=st.integers(1, 3),
    bias=st.booleans(),
    three_d=st.booleans(),
    noncontig=st.booleans(),
    needs=st.sampled_from(["all", "x", "w"]),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_backward_matches_dense(path, T, R, K, nm, g, bias, three_d, noncontig, needs, threads, seed):
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(seed)
    w = _weight(R, K, *nm, g, gen)
    lead = (2, -(-T // 2)) if three_d else (T,)
    x = _input(lead, K, noncontig, gen)
    b = torch.randn(R, generator=gen) if bias else None
    wd = w.to_dense().clone()
    mask = w.sparse_layout.mask()
    x.requires_grad_(needs in ("all", "x"))
    w.requires_grad_(needs in ("all", "w"))
    wd.requires_grad_(needs in ("all", "w"))
    if b is not None:
        b.requires_grad_(needs == "all")
    gy = torch.randn(*lead, R, generator=gen)
    sparsa.reset_fallback_counts()
    y = F.linear(x, w, b)
    grads = torch.autograd.grad(y, [t for t in (x, w, b) if t is not None and t.requires_grad], gy)
    x2 = x.detach().requires_grad_(x.requires_grad)
    b2 = None if b is None else b.detach().requires_grad_(b.requires_grad)
    ref_y = F.linear(x2, wd, b2)
    refs = torch.autograd.grad(ref_y, [t for t in (x2, wd, b2) if t is not None and t.requires_grad], gy)
    assert sparsa.fallback_counts() == {}
    for got, want, t in zip(grads, refs, [t for t in (x, w, b) if t is not None and t.requires_grad]):
        if t is w:
            want = want * mask  # grad_W only on the stored pattern, zero elsewhere
            assert not bool((got * ~mask).any())
        _close(got, want)


# small pattern counts: every gradcheck evaluation re-derives the layout from a mask (greedy assignment)
@pytest.mark.parametrize("nm,three_d", [((1, 4), False), ((2, 4), True), ((1, 5), True), ((3, 5), False)])
def test_gradcheck_fallback_float64(monkeypatch, nm, three_d):
    monkeypatch.setenv("SPARSA_NO_NATIVE", "1")
    gen = torch.Generator().manual_seed(nm[1])
    R, K = 7, 13
    dense = torch.randn(R, K, generator=gen, dtype=torch.float64)
    mask = GroupedNM.from_dense(dense, n=nm[0], m=nm[1], g=1).mask()
    lead = (2, 3) if three_d else (5,)
    x = torch.randn(*lead, K, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(R, generator=gen, dtype=torch.float64, requires_grad=True)
    wd = dense.clone().requires_grad_(True)

    def f(x, wd, b):
        w = sparsa.to_sparse(wd, "grouped_nm", mask=mask, n=nm[0], m=nm[1], g=1)
        return F.linear(x, w, b)

    sparsa.reset_fallback_counts()
    assert torch.autograd.gradcheck(f, (x, wd, b))
    assert sparsa.fallback_counts() == {}


def test_plan_cache_follows_in_place_updates():
    gen = torch.Generator().manual_seed(3)
    w = _weight(12, 20, 1, 4, 2, gen)
    x = torch.randn(4, 20, generator=gen)
    y1 = F.linear(x, w)
    _close(y1, x @ w.to_dense().T)
    assert native_grouped_nm._CACHE_KEY in w.sparse_layout._cache
    with torch.no_grad():
        w.mul_(2.0)  # updates the stored values: the cached plan must be rebuilt
    _close(F.linear(x, w), 2 * y1)
