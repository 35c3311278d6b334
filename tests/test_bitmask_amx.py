"""The ``"amx"`` strategy of ``sparsa::bitmask_linear``: the AMX kernel on the Bitmask components, against
float64 references. The kernel runs on AMX tiles where the CPU has them and on software tiles (a test
build) everywhere, so the row expansion, the X pack, tails and bias are checked on every CPU."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from sparsa.kernels import bitmask as bm, bitmask_amx as ba
from sparsa.layouts import Bitmask

BF = torch.bfloat16
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(params=["amx", "emulated"])
def lib(request, monkeypatch):
    """The library whose kernel runs: the real one on AMX tiles (where they run), or the software-tile build."""
    monkeypatch.delenv("SPARSA_ISA", raising=False)
    monkeypatch.delenv("SPARSA_NO_NATIVE", raising=False)
    if request.param == "amx":
        real = bm.native_library()
        if real is None or not real.sparsa_bitmask_has_amx():
            pytest.skip(f"the bitmask AMX tiles do not run here: {bm.amx_status()}")
        return real
    emulated = ba.emulated_library()
    assert emulated is not None, "the software-tile build of the bitmask AMX kernel failed"
    return emulated


def _weight(R, K, density, seed):
    gen = torch.Generator().manual_seed(seed)
    return Bitmask.from_dense(torch.randn(R, K, generator=gen).to(BF), mask=torch.rand(R, K, generator=gen) < density)


def _run(lib, x, w, bias, R):
    y = ba.run(lib, x, w.bits, w.row_ptr, w.values, bias, R)
    assert y is not None, "the kernel declined a call it takes"
    return y


def _check(y, x, w, bias):
    want = x.double() @ w.to_dense().double().T + (0 if bias is None else bias.double())
    assert y.dtype == BF and y.shape == want.shape
    scale = max(1.0, float(want.abs().max()))
    torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2 * scale)


@SETTINGS
@given(
    T=st.integers(1, 70),  # one to three 32-token blocks, the last one partial
    R=st.integers(1, 50),  # one or two 32-output items, partial blocks of 16, a block past the weight
    K=st.integers(1, 100),  # whole and partial 32-column chunks
    density=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
    bias=st.booleans(),
    seed=st.integers(0, 99),
)
def test_matches_float64(lib, T, R, K, density, bias, seed):
    w = _weight(R, K, density, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, K, generator=gen).to(BF)
    b = torch.randn(R, generator=gen) if bias else None
    _check(_run(lib, x, w, b, R), x, w, b)


@pytest.mark.parametrize(
    "T,R,K",
    [
        (300, 70, 3100),  # two K panels of 49 chunks, one token chunk of 10 blocks
        (100, 70, 3100),  # two K panels, 4 blocks: the next item expanded between the products
        (400, 40, 4100),  # three K panels, two token chunks (7 and 6 blocks): partial sums rewritten
        (1000, 40, 96),  # one panel, one chunk of 32 blocks
        (32, 45, 6000),  # one block over all of K (no panels): two items' A tiles past the overlap's budget
        (32, 45, 700),  # one block, the next item overlapped
    ],
)
def test_token_chunks_and_wide_weights(lib, T, R, K):
    w = _weight(R, K, 0.25, seed=T)
    x = torch.randn(T, K).to(BF)
    b = torch.randn(R)
    _check(_run(lib, x, w, b, R), x, w, b)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_in_x_reaches_every_output_like_dense(lib, bad):
    # 35 tokens: two blocks, items shared out one at a time (the one-block calls: test_one_block_calls)
    w = Bitmask.from_dense(torch.randn(40, 64).to(BF), mask=torch.eye(40, 64, dtype=torch.bool))
    x = torch.randn(35, 64).to(BF)
    x[33, 63] = bad  # column 63 is kept by no row: only a product over every column spreads it
    y = _run(lib, x, w, None, 40)
    dense = torch.nn.functional.linear(x.float(), w.to_dense().float())
    assert torch.isnan(y[33]).all() and torch.isnan(dense[33]).all()
    assert not torch.isnan(y[:33]).any() and not torch.isnan(y[34:]).any()


@pytest.mark.parametrize("T,K", [(100, 130), (300, 3100), (100, 3100), (400, 4100), (5, 130), (32, 700)])
def test_threads_do_not_change_the_result(lib, T, K):
    # one token chunk packed together, two packed apart; K panels (items move between threads from panel to
    # panel), overlapped or not; one 32-token block (each thread a run of items)
    w = _weight(200, K, 0.3, seed=3)
    x = torch.randn(T, K).to(BF)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(lib, x, w, None, 200)
        torch.set_num_threads(2)
        two = _run(lib, x, w, None, 200)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)


@pytest.mark.parametrize("T", [1, 16, 17, 32])
@pytest.mark.parametrize("R", [20, 33, 200])  # fewer items than threads, a partial item, runs of several
def test_one_block_calls(lib, T, R):
    # a call of at most 32 tokens gives each thread a contiguous run of items (batched decoding)
    w = _weight(R, 300, 0.5, seed=T + R)
    x = torch.randn(T, 300).to(BF)
    b = torch.randn(R)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        y = _run(lib, x, w, b, R)
    finally:
        torch.set_num_threads(old)
    _check(y, x, w, b)


def test_reads_the_components_as_they_are_now(lib):
    # nothing is kept beside the weight: an in-place update and an inference-mode weight are read as they are
    w = _weight(40, 70, 0.5, seed=2)
    x = torch.randn(50, 70).to(BF)
    before = _run(lib, x, w, None, 40)
    w.values.mul_(2)
    torch.testing.assert_close(_run(lib, x, w, None, 40).double(), 2 * before.double(), rtol=1e-2, atol=1e-2)
    with torch.inference_mode():
        wi = _weight(40, 70, 0.5, seed=3)
        _check(_run(lib, x, wi, None, 40), x, wi, None)


def test_the_strategy_runs_expand_where_it_cannot_run(monkeypatch):
    if bm.native_library() is None:
        pytest.skip("no native kernel here")
    monkeypatch.setenv("SPARSA_ISA", "avx512")  # below AMX: the tiles are off
    assert not bm.has_amx()
    w = _weight(24, 50, 0.5, seed=4)
    x = torch.randn(40, 50).to(BF)
    assert ba.run(bm.native_library(), x, w.bits, w.row_ptr, w.values, None, 24) is None
    _check(bm.bitmask_linear_impl(x, w.bits, w.row_ptr, w.values, None, 24, "amx"), x, w, None)
    y32 = bm.bitmask_linear_impl(x.float(), w.bits, w.row_ptr, w.values.float(), None, 24, "amx")
    assert y32.dtype == torch.float32  # float32 operands expand


def test_status_says_why_in_words():
    assert bm.amx_status() in set(ba.AMX_STATUS.values()) | {"the native kernels are not built here"}
    assert (bm.amx_status() == ba.AMX_STATUS[0]) == bm.has_amx()


def test_gelu_epilogue_matches_gelu_of_the_product_and_the_other_tiles(lib):
    # GELU on the fp32 sums plus bias, before the bf16 rounding (the software tiles' scalar GELU runs the
    # vector one's operations; their sums may differ in the last bits, so no bit comparison)
    w = _weight(70, 200, 0.3, seed=3)
    x = torch.randn(45, 200).to(BF)
    b = torch.randn(70)
    y = ba.run(lib, x, w.bits, w.row_ptr, w.values, b, 70, act=1)
    assert y is not None
    want = torch.nn.functional.gelu(x.double() @ w.to_dense().double().T + b.double())
    torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    plain = ba.run(lib, x, w.bits, w.row_ptr, w.values, b, 70)
    assert (y.double() - torch.nn.functional.gelu(plain.double())).abs().max() <= 2e-2 * float(want.abs().max())
