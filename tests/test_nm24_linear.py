"""The ``"nm24"`` strategy of ``sparsa::bitmask_linear``: the 2:4 kernel and its fallbacks against the
float64 dense product, and when the automatic choice takes it."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import sparsa
from sparsa import crossovers
from sparsa.kernels import bitmask as bm
from sparsa.kernels import nm24
from sparsa.layouts import NM, Bitmask, nm_mask

BF = torch.bfloat16
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture
def needs_kernel():
    if not bm.has_nm24_panel():
        pytest.skip("this CPU (or SPARSA_ISA) has no AVX512-BF16: the 2:4 kernel does not run")


@pytest.fixture
def table(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSA_COST_DIR", str(tmp_path))
    return sparsa.cost_model.default_cost_model()


def _weight(R, K, seed, dtype=BF):
    """A Bitmask weight with a 2:4 pattern."""
    dense = torch.randn(R, K, generator=torch.Generator().manual_seed(seed))
    return Bitmask.from_dense(dense.to(dtype), mask=nm_mask(dense, 2, 4))


def _run(x, w, b, strategy="nm24"):
    return bm.bitmask_linear_impl(x, w.bits, w.row_ptr, w.values, b, w.shape[0], strategy)


def _want(x, w, b):
    y = x.double() @ w.to_dense().double().T
    return y if b is None else y + b.double()


def _close(got, want, dtype=BF):
    assert got.dtype == dtype and got.shape == want.shape
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol * scale)


def _spy_kernel(monkeypatch):
    """The codes the native 2:4 kernel returned, one per call."""
    codes = []
    real_library = bm.native_library

    class Spy:
        def __init__(self, lib):
            self._lib = lib

        def __getattr__(self, name):
            real = getattr(self._lib, name)
            if name != "sparsa_nm24_panel_bf16":
                return real

            def call(*a):
                codes.append(real(*a))
                return codes[-1]

            return call

    def library():
        lib = real_library()  # None where the fallback runs (SPARSA_NO_NATIVE, no build)
        return None if lib is None else Spy(lib)

    monkeypatch.setattr(bm, "native_library", library)
    return codes


# ---------------------------------------------------------------------------------------------- slots
@SETTINGS
@given(R=st.integers(1, 9), G=st.integers(1, 12), seed=st.integers(0, 99))
def test_slots_from_bits_and_from_nm_indices_agree_and_rebuild_the_weight(R, G, seed):
    w = _weight(R, 4 * G, seed, torch.float32)
    slots = nm24.bitmask_slots(w.bits, 4 * G)
    assert slots.dtype == torch.uint8 and slots.shape == (R, G) and int(slots.max()) <= 5
    indices = NM.from_dense(w.to_dense(), n=2, m=4).indices.tolist()  # the N:M layout's pairs, group by group
    assert slots.tolist() == [[nm24.SLOT_PAIRS.index(tuple(p)) for p in row] for row in indices]
    assert torch.equal(nm24.nm24_dense_weight(slots, w.values), w.to_dense())


def test_every_pair_has_its_own_slot():
    assert sorted(nm24.SLOT_PAIRS) == [(a, b) for a in range(4) for b in range(a + 1, 4)]
    mask = torch.zeros(1, 24, dtype=torch.bool)
    for g, (a, b) in enumerate(nm24.SLOT_PAIRS):
        mask[0, 4 * g + a] = mask[0, 4 * g + b] = True
    w = Bitmask.from_dense(torch.ones(1, 24), mask=mask)
    assert nm24.bitmask_slots(w.bits, 24).tolist() == [[0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize(
    "mask",
    [
        [[1, 1, 0, 0, 1, 0, 0, 0]],  # a group keeping one
        [[1, 1, 1, 0, 1, 1, 0, 0]],  # a group keeping three
        [[1, 1, 0, 0, 0, 0, 1, 1, 1, 0]],  # in_features not a multiple of 4
    ],
)
def test_other_patterns_have_no_slots(mask):
    mask = torch.tensor(mask, dtype=torch.bool)
    w = Bitmask.from_dense(torch.randn(mask.shape), mask=mask)
    assert nm24.bitmask_slots(w.bits, mask.shape[1]) is None and not nm24.is_2_4(w.bits, mask.shape[1])


def test_the_pattern_is_checked_once_per_bits_tensor(monkeypatch):
    w = _weight(8, 16, 0)
    calls = []
    real = nm24.bitmask_slots
    monkeypatch.setattr(nm24, "bitmask_slots", lambda *a: calls.append(1) or real(*a))
    assert nm24.is_2_4(w.bits, 16) and nm24.is_2_4(w.bits, 16) and len(calls) == 1
    assert nm24.is_2_4(w.bits.clone(), 16) and len(calls) == 2  # another tensor: checked again
    w.bits.zero_()  # modified in place: checked again, no longer 2:4
    assert not nm24.is_2_4(w.bits, 16) and len(calls) == 3


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
    _close(_run(x, w, b), _want(x, w, b))
    assert codes == ([0] if G else [])  # K == 0: the bias alone, without a kernel call


@pytest.mark.usefixtures("needs_kernel")
@pytest.mark.parametrize("R, K, T", [(1000, 1536, 40), (129, 4864, 130), (8, 896, 2), (200, 12, 300)])
def test_kernel_on_model_shapes_and_row_tails(R, K, T):
    # many rows (super blocks split between threads), wide rows (many chunks), few rows (tokens split)
    w = _weight(R, K, 7)
    x = torch.randn(T, K).to(BF)
    _close(_run(x, w, None), _want(x, w, None))


@pytest.mark.usefixtures("needs_kernel")
def test_token_results_do_not_depend_on_the_batch_or_threads():
    # every token is one lane summing its groups in one order, in either panel width and on any thread
    w = _weight(90, 520, 3)
    x = torch.randn(45, 520).to(BF)
    whole = _run(x, w, None)
    for i in (0, 15, 16, 31, 44):
        assert torch.equal(_run(x[i : i + 9], w, None)[0], whole[i])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_run(x, w, None), whole)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.usefixtures("needs_kernel")
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_nan_or_inf_in_x_runs_another_strategy_like_dense(monkeypatch, bad):
    codes = _spy_kernel(monkeypatch)
    dense = torch.zeros(6, 40)
    dense[:, :2] = torch.randn(6, 2)  # every row keeps columns 0 and 1 (and stored zeros); 39 is dropped
    w = Bitmask.from_dense(dense.to(BF), mask=nm_mask(dense, 2, 4))
    x = torch.randn(20, 40).to(BF)
    x[4, 39] = bad
    y = _run(x, w, None)
    assert codes == [1]
    assert torch.isnan(y[4]).all()
    keep = torch.arange(20) != 4
    _close(y[keep], _want(x[keep], w, None))


@pytest.mark.parametrize("native", [True, False])
def test_without_the_kernel_or_a_2_4_pattern_the_strategy_runs_the_panel_one(monkeypatch, native):
    codes = _spy_kernel(monkeypatch)
    if native:
        monkeypatch.setenv("SPARSA_ISA", "avx2")  # below AVX-512: no VDPBF16PS
        assert not bm.has_nm24_panel()
    else:
        monkeypatch.setenv("SPARSA_NO_NATIVE", "1")
    for w in (_weight(30, 64, 2), Bitmask.from_dense(torch.randn(30, 64).to(BF), sparsity=0.5)):
        x = torch.randn(3, 40, 64).to(BF)
        _close(_run(x, w, None), _want(x, w, None))
    assert codes == []


def test_float32_and_other_patterns_never_call_it(monkeypatch):
    codes = _spy_kernel(monkeypatch)
    w = _weight(12, 32, 1, torch.float32)
    x = torch.randn(50, 32)
    _close(_run(x, w, None), _want(x, w, None), torch.float32)
    odd = Bitmask.from_dense(torch.randn(12, 36).to(BF), sparsity=0.5)
    xo = torch.randn(50, 36).to(BF)
    _close(_run(xo, odd, None), _want(xo, odd, None))
    assert codes == []


# ---------------------------------------------------------------------------------------------- choice
def test_the_crossover_decides_and_its_top_means_never(table, monkeypatch):
    grid = crossovers.CROSSOVERS[nm24.PANEL_CROSSOVER].grid
    assert crossovers.CROSSOVERS[nm24.PANEL_CROSSOVER].default == grid[-1]
    monkeypatch.setattr(crossovers, "_this_class", lambda: "some-other-cpu")
    assert nm24.panel_min_tokens() is None and not nm24.wants_panel(10**6, BF)
    assert crossovers.describe(nm24.PANEL_CROSSOVER, grid[-1]).endswith("never the 2:4 panel kernel")
    assert crossovers.describe(nm24.PANEL_CROSSOVER, 12).startswith("the bitmask strategies up to 12 tokens")
    table.set_fit(crossovers.PREFIX + nm24.PANEL_CROSSOVER, {"max_tokens": 12})
    assert nm24.panel_min_tokens() == 13
    assert [nm24.wants_panel(t, BF) for t in (12, 13, 4096)] == [False, True, True]
    assert not nm24.wants_panel(4096, torch.float32)


@pytest.mark.usefixtures("needs_kernel")
@pytest.mark.parametrize("layout", ["bitmask", "nm"])
@pytest.mark.parametrize("tokens, runs", [(4, False), (40, True)])
def test_f_linear_on_a_2_4_weight_takes_the_kernel_above_the_crossover(table, monkeypatch, layout, tokens, runs):
    codes = _spy_kernel(monkeypatch)
    table.set_fit(crossovers.PREFIX + nm24.PANEL_CROSSOVER, {"max_tokens": 12})
    dense = torch.randn(48, 64)
    params = {"mask": nm_mask(dense, 2, 4)} if layout == "bitmask" else {"n": 2, "m": 4}
    w = sparsa.to_sparse(dense.to(BF), layout, **params)
    x = torch.randn(2, tokens // 2, 64).to(BF)
    b = torch.randn(48).to(BF)
    _close(torch.nn.functional.linear(x, w, b), _want(x, w.sparse_layout, b))
    assert codes == ([0] if runs else [])


@pytest.mark.usefixtures("needs_kernel")
def test_a_compiled_model_takes_it_too(table, monkeypatch):
    # the strategy is chosen when the op runs, on the real components: a traced graph needs no slots
    codes = _spy_kernel(monkeypatch)
    table.set_fit(crossovers.PREFIX + nm24.PANEL_CROSSOVER, {"max_tokens": 12})
    lin = torch.nn.Linear(64, 24, bias=False).to(BF)
    dense = lin.weight.detach().float()
    lin.weight = torch.nn.Parameter(
        sparsa.to_sparse(dense.to(BF), "bitmask", mask=nm_mask(dense, 2, 4)), requires_grad=False
    )
    x = torch.randn(30, 64).to(BF)
    with torch.no_grad():
        want = _want(x, lin.weight.sparse_layout, None)
        got = torch.compile(lin)(x)
    _close(got, want)
    assert 0 in codes


@pytest.mark.usefixtures("needs_kernel")
def test_backward_through_f_linear_on_the_kernel_path(table, monkeypatch):
    codes = _spy_kernel(monkeypatch)
    table.set_fit(crossovers.PREFIX + nm24.PANEL_CROSSOVER, {"max_tokens": 12})
    dense = torch.randn(24, 32)
    w = sparsa.to_sparse(dense.to(BF), "nm", n=2, m=4)
    x = torch.randn(40, 32).to(BF).requires_grad_(True)
    gy = torch.randn(40, 24).to(BF)
    torch.nn.functional.linear(x, w).backward(gy)
    assert codes == [0]
    _close(x.grad, gy.double() @ w.sparse_layout.to_dense().double())


@pytest.mark.usefixtures("needs_kernel")
def test_a_batched_decode_call_the_stream_loop_would_take_runs_it(table, monkeypatch):
    # above the stream loop's own tokens a weight too dense for the batch panel streams (batch_stream_bf16);
    # a 2:4 one above the nm24 crossover runs the 2:4 kernel instead, eager decode path or not
    codes = _spy_kernel(monkeypatch)
    table.set_fit(crossovers.PREFIX + "bitmask.stream_bf16", {"max_tokens": 12})
    table.set_fit(crossovers.PREFIX + "bitmask.batch_stream_bf16", {"max_tokens": 16})
    table.set_fit(crossovers.PREFIX + nm24.PANEL_CROSSOVER, {"max_tokens": 12})
    dense = torch.randn(40, 64)
    w = sparsa.to_sparse(dense.to(BF), "bitmask", mask=nm_mask(dense, 2, 4))
    other = sparsa.to_sparse(dense.to(BF), "bitmask", sparsity=0.5)
    assert bm.choose_strategy(16, BF, 0.5) == "stream"
    for tokens, runs in ((12, False), (16, True)):
        x = torch.randn(tokens, 64).to(BF)
        with torch.no_grad():
            _close(torch.nn.functional.linear(x, w), _want(x, w.sparse_layout, None))
            _close(torch.nn.functional.linear(x, other), _want(x, other.sparse_layout, None))
        assert codes == ([0] if runs else [])


@pytest.mark.usefixtures("needs_kernel")
def test_auto_strategy_says_what_the_op_runs(table):
    table.set_fit(crossovers.PREFIX + nm24.PANEL_CROSSOVER, {"max_tokens": 12})
    table.set_fit(crossovers.PREFIX + "bitmask.stream_bf16", {"max_tokens": 12})
    w = _weight(40, 64, 5)
    other = Bitmask.from_dense(torch.randn(40, 64).to(BF), sparsity=0.5)
    assert bm.auto_strategy(12, BF, w.bits, w.values, 40, 64) == "stream"
    assert bm.auto_strategy(13, BF, w.bits, w.values, 40, 64) == "nm24"
    assert bm.auto_strategy(600, BF, other.bits, other.values, 40, 64) == bm.choose_strategy(600, BF, 0.5)
    assert bm.auto_strategy(600, torch.float32, w.bits, w.values.float(), 40, 64) != "nm24"
    with pytest.raises(ValueError, match="dtype"):
        bm.auto_strategy(600, torch.float16, w.bits, w.values, 40, 64)
