"""``sparsa::nm24_linear``: the 2:4 panel kernel and its fallbacks against the float64 dense product."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import sparsa
from sparsa import crossovers
from sparsa.kernels import bitmask as bm
from sparsa.kernels import nm24
from sparsa.layouts import NM, Bitmask, nm_mask
from sparsa.ops import bitmask_linear, nm_linear

BF = torch.bfloat16
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture
def needs_kernel():
    if not nm24.has_nm24_panel():
        pytest.skip("this CPU (or SPARSA_ISA) has no AVX512-BF16: the 2:4 panel kernel does not run")


def _weight(R, K, seed, dtype=BF):
    gen = torch.Generator().manual_seed(seed)
    return NM.from_dense(torch.randn(R, K, generator=gen).to(dtype), n=2, m=4)


def _parts(w):
    bits, row_ptr, _ = nm_linear.nm_bitmask_components(w)
    return nm_linear.nm24_components(w), w.values, bits, row_ptr


def _want(x, w, b):
    y = x.double() @ w.to_dense().double().T
    return y if b is None else y + b.double()


def _close(got, want, dtype=BF):
    assert got.dtype == dtype and got.shape == want.shape
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol * scale)


def _spy_kernel(monkeypatch):
    """Counts the calls of the native 2:4 kernel (and the codes it returned)."""
    codes = []
    lib = bm.native_library()
    if lib is None:
        return codes

    class Spy:
        def __getattr__(self, name):
            real = getattr(lib, name)
            if name != "sparsa_nm24_panel_bf16":
                return real

            def call(*a):
                codes.append(real(*a))
                return codes[-1]

            return call

    monkeypatch.setattr(bm, "native_library", lambda: Spy())
    return codes


# ---------------------------------------------------------------------------------------------- slots
@SETTINGS
@given(R=st.integers(1, 9), G=st.integers(1, 12), seed=st.integers(0, 99))
def test_slots_and_values_rebuild_the_weight(R, G, seed):
    w = _weight(R, 4 * G, seed, torch.float32)
    slots = nm24.nm24_slots(w.indices)
    assert slots.dtype == torch.uint8 and slots.shape == (R, G) and int(slots.max()) <= 5
    assert torch.equal(nm24.nm24_dense_weight(slots, w.values), w.to_dense())


def test_every_pair_has_its_own_slot():
    assert sorted(nm24.SLOT_PAIRS) == [(a, b) for a in range(4) for b in range(a + 1, 4)]
    idx = torch.tensor([[list(p) for p in nm24.SLOT_PAIRS]], dtype=torch.uint8)
    assert nm24.nm24_slots(idx).tolist() == [[0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize(
    "indices, message",
    [
        (torch.zeros(2, 3, dtype=torch.uint8), r"\[R, K / 4, 2\]"),
        (torch.tensor([[[2, 1]]], dtype=torch.uint8), "ascending"),
        (torch.tensor([[[1, 1]]], dtype=torch.uint8), "ascending"),
        (torch.tensor([[[0, 4]]], dtype=torch.uint8), "0..3"),
    ],
)
def test_bad_indices_are_named(indices, message):
    with pytest.raises(ValueError, match=message):
        nm24.nm24_slots(indices)


def test_in_features_not_a_multiple_of_4_is_named():
    w = _weight(4, 8, 0)
    with pytest.raises(ValueError, match="multiple of 4"):
        nm24.nm24_linear_impl(torch.randn(2, 6).to(BF), *_parts(w), None, 4)
    with pytest.raises(ValueError, match="strategy"):
        nm24.nm24_linear_impl(torch.randn(2, 8).to(BF), *_parts(w), None, 4, "dense")


# ---------------------------------------------------------------------------------------------- kernel
@pytest.mark.usefixtures("needs_kernel")
@SETTINGS
@given(
    R=st.integers(1, 70),
    G=st.integers(0, 40),
    T=st.sampled_from([1, 5, 16, 17, 33, 70]),  # one 16-token panel; 32-token panels and their tails
    bias=st.sampled_from([None, torch.float32, BF]),
    seed=st.integers(0, 999),
)
def test_kernel_matches_float64(monkeypatch, R, G, T, bias, seed):
    codes = _spy_kernel(monkeypatch)
    w = _weight(R, 4 * G, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, 4 * G, generator=gen).to(BF)
    b = None if bias is None else torch.randn(R, generator=gen).to(bias)
    _close(nm24.nm24_linear_impl(x, *_parts(w), b, R, "panel"), _want(x, w, b))
    assert codes == ([0] if G else [])  # K == 0: the bias alone, without a kernel call


@pytest.mark.usefixtures("needs_kernel")
@pytest.mark.parametrize("R, K, T", [(1000, 1536, 40), (129, 4864, 130), (8, 896, 2), (200, 12, 300)])
def test_kernel_on_model_shapes_and_row_tails(R, K, T):
    # many rows (super blocks split between threads), wide rows (many chunks), few rows (panels split)
    w = _weight(R, K, 7)
    x = torch.randn(T, K).to(BF)
    _close(nm24.nm24_linear_impl(x, *_parts(w), None, R, "panel"), _want(x, w, None))


@pytest.mark.usefixtures("needs_kernel")
def test_token_results_do_not_depend_on_the_batch_or_threads():
    # every token is one lane summing its groups in one order, in either panel width and on any thread
    w = _weight(90, 520, 3)
    x = torch.randn(45, 520).to(BF)
    whole = nm24.nm24_linear_impl(x, *_parts(w), None, 90, "panel")
    for i in (0, 15, 16, 31, 44):
        one = nm24.nm24_linear_impl(x[i : i + 9], *_parts(w), None, 90, "panel")
        assert torch.equal(one[0], whole[i])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(nm24.nm24_linear_impl(x, *_parts(w), None, 90, "panel"), whole)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.usefixtures("needs_kernel")
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_nan_or_inf_in_x_runs_the_bitmask_strategies_like_dense(monkeypatch, bad):
    codes = _spy_kernel(monkeypatch)
    dense = torch.zeros(6, 40)
    dense[:, :2] = torch.randn(6, 2)  # every row keeps columns 0 and 1 (and zeros); column 39 is dropped
    w = NM.from_dense(dense.to(BF), mask=(dense != 0), n=2, m=4)
    x = torch.randn(20, 40).to(BF)
    x[4, 39] = bad
    y = nm24.nm24_linear_impl(x, *_parts(w), None, 6, "panel")
    assert codes == [1]
    assert torch.isnan(y[4]).all()
    keep = torch.arange(20) != 4
    _close(y[keep], _want(x[keep], w, None))


def test_the_reference_and_the_fallback_match_float64(monkeypatch):
    w = _weight(10, 24, 5)
    x = torch.randn(3, 7, 24).to(BF)
    b = torch.randn(10)
    _close(nm24.nm24_linear_reference(x, *_parts(w)[:2], b, 10), _want(x, w, b))
    monkeypatch.setenv("SPARSA_NO_NATIVE", "1")
    codes = _spy_kernel(monkeypatch)
    _close(nm24.nm24_linear_impl(x, *_parts(w), b, 10, "panel"), _want(x, w, b))
    assert codes == []


def test_without_the_kernel_the_panel_strategy_runs_the_bitmask_strategies(monkeypatch):
    monkeypatch.setenv("SPARSA_ISA", "avx2")  # below AVX-512: no VDPBF16PS
    assert not nm24.has_nm24_panel()
    w = _weight(30, 64, 2)
    x = torch.randn(40, 64).to(BF)
    _close(nm24.nm24_linear_impl(x, *_parts(w), None, 30, "panel"), _want(x, w, None))


def test_float32_runs_the_bitmask_strategies(monkeypatch):
    codes = _spy_kernel(monkeypatch)
    w = _weight(12, 32, 1, torch.float32)
    x = torch.randn(50, 32)
    _close(nm24.nm24_linear_impl(x, *_parts(w), None, 12, "panel"), _want(x, w, None), torch.float32)
    assert codes == []


# ---------------------------------------------------------------------------------------------- choice
@pytest.fixture
def table(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSA_COST_DIR", str(tmp_path))
    return sparsa.cost_model.default_cost_model()


def test_the_crossover_decides_and_its_top_means_never(table, monkeypatch):
    grid = crossovers.CROSSOVERS[nm24.PANEL_CROSSOVER].grid
    assert crossovers.CROSSOVERS[nm24.PANEL_CROSSOVER].default == grid[-1]
    monkeypatch.setattr(crossovers, "_this_class", lambda: "some-other-cpu")
    assert nm24.panel_min_tokens() is None and not nm24.uses_panel(10**6, BF)
    assert crossovers.describe(nm24.PANEL_CROSSOVER, grid[-1]).endswith("never the 2:4 panel kernel")
    assert crossovers.describe(nm24.PANEL_CROSSOVER, 12).startswith("the bitmask strategies up to 12 tokens")
    monkeypatch.setattr(nm24, "has_nm24_panel", lambda: True)
    table.set_fit(crossovers.PREFIX + nm24.PANEL_CROSSOVER, {"max_tokens": 12})
    assert nm24.panel_min_tokens() == 13
    assert [nm24.uses_panel(t, BF) for t in (12, 13, 4096)] == [False, True, True]
    assert not nm24.uses_panel(4096, torch.float32)
    monkeypatch.setattr(nm24, "has_nm24_panel", lambda: False)
    assert not nm24.uses_panel(4096, BF)


@pytest.mark.usefixtures("needs_kernel")
@pytest.mark.parametrize("tokens, runs", [(4, False), (40, True)])
def test_f_linear_on_a_2_4_weight_takes_the_kernel_above_the_crossover(table, monkeypatch, tokens, runs):
    codes = _spy_kernel(monkeypatch)
    table.set_fit(crossovers.PREFIX + nm24.PANEL_CROSSOVER, {"max_tokens": 12})
    dense = torch.randn(48, 64).to(BF)
    w = sparsa.to_sparse(dense, "nm", n=2, m=4)
    x = torch.randn(2, tokens // 2, 64).to(BF)
    b = torch.randn(48).to(BF)
    _close(torch.nn.functional.linear(x, w, b), _want(x, w.sparse_layout, b))
    assert codes == ([0] if runs else [])


def test_only_2_4_weights_with_whole_groups_take_it():
    assert nm_linear.nm24_components(_weight(4, 8, 0)) is not None
    assert nm_linear.nm24_components(NM.from_dense(torch.randn(4, 10), n=2, m=4)) is None  # a padded group
    assert nm_linear.nm24_components(NM.from_dense(torch.randn(4, 8), n=4, m=8)) is None
    assert nm_linear.nm24_components(NM.from_dense(torch.randn(2, 4, 8), n=2, m=4)) is None
    w = _weight(4, 8, 0)
    assert nm_linear.nm24_components(w) is nm_linear.nm24_components(w)  # cached on the layout


# ---------------------------------------------------------------------------------------------- autograd
def test_the_custom_op_gradients_match_dense():
    torch.manual_seed(0)
    w = _weight(6, 16, 4, torch.float64)
    slots, values, bits, row_ptr = _parts(w)
    x = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    v = values.clone().requires_grad_(True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda x, v, b: nm24.nm24_linear(x, slots, v, bits, row_ptr, b, 6), (x, v, b))


@pytest.mark.usefixtures("needs_kernel")
def test_backward_through_f_linear_on_the_kernel_path(table, monkeypatch):
    table.set_fit(crossovers.PREFIX + nm24.PANEL_CROSSOVER, {"max_tokens": 12})
    dense = torch.randn(24, 32).to(BF)
    w = sparsa.to_sparse(dense, "nm", n=2, m=4)
    x = torch.randn(40, 32).to(BF).requires_grad_(True)
    gy = torch.randn(40, 24).to(BF)
    torch.nn.functional.linear(x, w).backward(gy)
    _close(x.grad, gy.double() @ w.sparse_layout.to_dense().double())


# ---------------------------------------------------------------------------------------------- bitmask
@SETTINGS
@given(R=st.integers(1, 9), G=st.integers(1, 12), seed=st.integers(0, 99))
def test_a_2_4_bitmask_pattern_has_the_n_m_slots_and_values(R, G, seed):
    dense = torch.randn(R, 4 * G, generator=torch.Generator().manual_seed(seed))
    w = Bitmask.from_dense(dense, mask=nm_mask(dense, 2, 4))
    slots = nm24.bitmask_slots(w.bits, 4 * G)
    nm = NM.from_dense(dense, n=2, m=4)
    assert torch.equal(slots, nm24.nm24_slots(nm.indices))
    assert torch.equal(nm24.nm24_dense_weight(slots, w.values), w.to_dense())


@pytest.mark.parametrize(
    "mask",
    [
        torch.tensor([[1, 1, 0, 0, 1, 0, 0, 0]]),  # a group keeping one
        torch.tensor([[1, 1, 1, 0, 1, 1, 0, 0]]),  # a group keeping three
        torch.tensor([[1, 1, 0, 0, 0, 0, 1, 1, 1, 0]]),  # in_features not a multiple of 4
    ],
)
def test_other_bitmask_patterns_have_no_slots(mask):
    w = Bitmask.from_dense(torch.randn(mask.shape), mask=mask.bool())
    assert nm24.bitmask_slots(w.bits, mask.shape[1]) is None
    assert bitmask_linear.bitmask_nm24_slots(w) is None


@pytest.mark.usefixtures("needs_kernel")
def test_f_linear_on_a_2_4_bitmask_weight_takes_the_kernel(table, monkeypatch):
    codes = _spy_kernel(monkeypatch)
    table.set_fit(crossovers.PREFIX + nm24.PANEL_CROSSOVER, {"max_tokens": 12})
    dense = torch.randn(40, 36).to(BF)
    w = sparsa.to_sparse(dense, "bitmask", mask=nm_mask(dense.float(), 2, 4))
    x = torch.randn(30, 36).to(BF)
    _close(torch.nn.functional.linear(x, w), _want(x, w.sparse_layout, None))
    assert codes == [0]
    assert bitmask_linear.bitmask_nm24_slots(w.sparse_layout) is bitmask_linear.bitmask_nm24_slots(w.sparse_layout)
