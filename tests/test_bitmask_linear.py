"""The Bitmask layout and ``sparsa::bitmask_linear`` (decode/prefill kernels) against dense references.

Every kernel path this CPU has runs: the native ``stream`` strategy's row loops (AVX2 8-column, the
16-column loop on AVX2 halves, AVX-512 where the CPU has it, and the bf16 dot-product loop where it has
AVX512-BF16 and VBMI2), the ``expand`` strategy and the pure-PyTorch fallback; fp32 and bf16 (checked
against float64 with a bf16 tolerance).
"""

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import sparsa
from sparsa import cost_model, cpu, crossovers
from sparsa.kernels import bitmask as bm
from sparsa.layouts import Bitmask
from sparsa.layouts.bitmask import pack_bits, unpack_bits

BF = torch.bfloat16
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(
    params=[
        "stream",
        "stream_pair16",
        "stream_avx512",
        "stream_dpbf16",
        "expand",
        "panel",
        "panel_f32",
        "amx",
        "amx_emulated",
        "fused",
        "fallback",
    ]
)
def path(request, monkeypatch):
    """A native strategy and row loop, or the pure-PyTorch reference. ``stream_dpbf16`` runs the
    ``auto`` loop where the CPU has AVX512-BF16 and VBMI2: bfloat16 takes the dot-product loop there,
    float32 the AVX-512 one. ``panel`` runs the panel kernels (bfloat16 where the CPU has AVX512-BF16 and
    VBMI2, float32 with AVX2); ``panel_f32`` runs them under ``SPARSA_ISA=avx2`` (float32 panel, bfloat16
    operands expand), so the float32 panel kernel is tested on every AVX2 CPU. ``amx`` runs the AMX tiles
    where the CPU has them; ``amx_emulated`` the same kernel on software tiles (any CPU). Both take bfloat16;
    float32 operands expand. ``fused`` runs the float32 fused kernel where the CPU has AVX-512 (bfloat16
    operands expand)."""
    monkeypatch.delenv("SPARSA_NO_AVX512", raising=False)
    monkeypatch.delenv("SPARSA_ISA", raising=False)
    if request.param == "stream_avx512":
        if not bm.has_avx512():
            pytest.skip("this CPU has no AVX-512F: its 16-column loop runs as stream_pair16 (AVX2 halves)")
        monkeypatch.setattr(bm, "STREAM_PATH", "avx512")
    elif request.param == "stream_dpbf16":
        if not bm.has_dpbf16():
            pytest.skip("this CPU has no AVX512-BF16 + VBMI2: bfloat16 runs the avx512 or avx2 loop")
        monkeypatch.setattr(bm, "STREAM_PATH", "auto")
    elif request.param == "panel":
        if not bm.has_panel_bf16():
            pytest.skip("this CPU has no AVX512-BF16 + VBMI2: the bf16 panel kernel does not run")
    elif request.param == "stream_pair16":
        monkeypatch.setattr(bm, "STREAM_PATH", "pair16")
    elif request.param == "amx" and bm.native_library() is not None and not bm.has_amx():
        pytest.skip(f"the bitmask AMX tiles do not run here: {bm.amx_status()}")
    elif request.param == "fused" and bm.native_library() is not None and not bm.has_fused_f32():
        pytest.skip("this CPU (or SPARSA_ISA) has no AVX-512F: the float32 fused kernel does not run")
    elif request.param == "amx_emulated":
        emulated = bm._amx_tiles.emulated_library()
        assert emulated is not None, "the software-tile build of the bitmask AMX kernel failed"
        run = bm._amx_tiles.run
        monkeypatch.setattr(bm._amx_tiles, "run", lambda lib, *a: run(emulated, *a))
    if request.param == "fallback":
        monkeypatch.setenv("SPARSA_NO_NATIVE", "1")
        assert bm.native_library() is None
        return request.param
    monkeypatch.delenv("SPARSA_NO_NATIVE", raising=False)
    if cpu.ISA_LEVELS.index(cpu.hardware_isa()) < cpu.ISA_LEVELS.index("avx2"):
        pytest.skip("this CPU has no avx2/fma: only the fallback runs")
    if request.param in ("stream", "expand", "panel_f32"):
        monkeypatch.setenv("SPARSA_ISA", "avx2")
    assert bm.native_library() is not None, "native bitmask kernel failed to build"

    def no_reference(*a, **k):
        raise AssertionError("the reference ran although the native kernel should have")

    monkeypatch.setattr(bm, "bitmask_linear_reference", no_reference)
    monkeypatch.setattr(bm, "choose_strategy", lambda tokens, *a, **k: request.param.split("_")[0])
    return request.param


def _ref(x, w, bias):
    y = x.double() @ w.to_dense().double().T
    return y if bias is None else y + bias.double()


def _close(got, want, dtype):
    assert got.dtype == dtype and got.shape == want.shape
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol * scale)


# ---------------------------------------------------------------------------------------------- layout
@SETTINGS
@given(R=st.integers(0, 19), K=st.integers(0, 45), density=st.floats(0, 1))
def test_bits_round_trip(R, K, density):
    mask = torch.rand(R, K) < density
    bits = pack_bits(mask)
    assert bits.dtype == torch.uint8 and bits.shape == (R, -(-K // 8))
    assert torch.equal(unpack_bits(bits, K), mask)


def test_from_dense_sparsity_is_per_row_and_bytes_shrink():
    w = torch.randn(256, 512)
    b = Bitmask.from_dense(w, sparsity=0.5)
    assert torch.equal(b.row_ptr.diff(), torch.full((256,), 256))
    kept = w.abs() >= w.abs().kthvalue(257, dim=1, keepdim=True).values
    assert torch.equal(b.mask(), kept)
    assert b.nbytes / (w.numel() * 4) < 0.54  # 0.5 values + 1/32 bits (+ row_ptr)
    bb = Bitmask.from_dense(w.to(BF), sparsity=0.5)
    assert bb.nbytes / (w.numel() * 2) < 0.58  # 0.5 values + 1/16 bits + row_ptr


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda c: c.update(bits=c["bits"].to(torch.int32)), "bits must be uint8"),
        (lambda c: c.update(row_ptr=c["row_ptr"][:-1]), "row_ptr must be int64 of shape"),
        (lambda c: c.update(values=c["values"][:-1]), "end at len"),
        (lambda c: c["bits"].__setitem__((0, -1), 255), "past column"),
        (lambda c: c["bits"].__setitem__((0, 0), c["bits"][0, 0] ^ 1), "set bits of each row"),
    ],
)
def test_validate_names_the_bad_component(change, message):
    w = Bitmask.from_dense(torch.randn(4, 13), sparsity=0.5)
    comps = {k: v.clone() for k, v in w.components().items()}
    change(comps)
    with pytest.raises(ValueError, match=message):
        Bitmask.from_components(comps, (4, 13))


def test_bad_arguments():
    with pytest.raises(ValueError, match="2-D"):
        Bitmask.from_dense(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="not both"):
        Bitmask.from_dense(torch.randn(2, 3), mask=torch.ones(2, 3, dtype=torch.bool), sparsity=0.5)
    with pytest.raises(TypeError, match="floating-point"):
        Bitmask.from_dense(torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="strategy"):
        bm.bitmask_linear_impl(torch.randn(1, 3), *_components(Bitmask.from_dense(torch.randn(2, 3))), None, 2, "fast")


def _components(w):
    return w.bits, w.row_ptr, w.values


def test_an_unknown_or_missing_row_loop_is_named(monkeypatch):
    if bm.native_library() is None:
        pytest.skip("no native kernel here: the row loops are not built")
    monkeypatch.delenv("SPARSA_NO_NATIVE", raising=False)
    w = Bitmask.from_dense(torch.randn(4, 24), sparsity=0.5)
    monkeypatch.setattr(bm, "STREAM_PATH", "avx1024")
    with pytest.raises(ValueError, match="STREAM_PATH must be one of"):
        bm.bitmask_linear_impl(torch.randn(1, 24), *_components(w), None, 4, "stream")
    monkeypatch.setenv("SPARSA_ISA", "avx2")  # the AVX-512 loop is off whatever the CPU
    monkeypatch.setattr(bm, "STREAM_PATH", "avx512")
    with pytest.raises(RuntimeError, match="STREAM_PATH='avx512' is not available"):
        bm.bitmask_linear_impl(torch.randn(1, 24), *_components(w), None, 4, "stream")


def test_the_bf16_dot_product_loop_is_bfloat16_only(monkeypatch):
    if not bm.has_dpbf16():
        pytest.skip("this CPU has no AVX512-BF16 + VBMI2: the dot-product loop is not built for it")
    monkeypatch.delenv("SPARSA_ISA", raising=False)
    w = Bitmask.from_dense(torch.randn(40, 200), sparsity=0.5)
    monkeypatch.setattr(bm, "STREAM_PATH", "dpbf16")
    with pytest.raises(RuntimeError, match="takes bfloat16 operands only"):
        bm.bitmask_linear_impl(torch.randn(2, 200), *_components(w), None, 40, "stream")
    wb = Bitmask.from_dense(torch.randn(40, 200).to(BF), sparsity=0.5)
    x = torch.randn(2, 200).to(BF)
    forced = bm.bitmask_linear_impl(x, *_components(wb), None, 40, "stream")
    monkeypatch.setattr(bm, "STREAM_PATH", "auto")  # auto picks the same loop for bfloat16: same bits
    assert torch.equal(bm.bitmask_linear_impl(x, *_components(wb), None, 40, "stream"), forced)
    monkeypatch.setenv("SPARSA_ISA", "avx2")  # lowered below avx512, the loop is off
    monkeypatch.setattr(bm, "STREAM_PATH", "dpbf16")
    with pytest.raises(RuntimeError, match="STREAM_PATH='dpbf16' is not available"):
        bm.bitmask_linear_impl(x, *_components(wb), None, 40, "stream")


@pytest.mark.parametrize("whole_bytes", [0, 1 << 30])
def test_bf16_expand_by_blocks_or_whole(monkeypatch, whole_bytes):
    # with bf16 GEMM hardware a small weight is expanded whole (one F.linear), a large one by row blocks;
    # both against float64 (elsewhere the expand strategy widens to float32 blocks either way)
    if bm.native_library() is None:
        pytest.skip("no native kernel here")
    monkeypatch.delenv("SPARSA_ISA", raising=False)
    monkeypatch.setattr(bm, "_WHOLE_BYTES", whole_bytes)
    monkeypatch.setattr(bm, "_BLOCK_BYTES", 40 * 203 * 2)  # several row blocks
    w = Bitmask.from_dense(torch.randn(150, 203).to(BF), sparsity=0.6)
    x = torch.randn(2, 20, 203).to(BF)
    b = torch.randn(150).to(BF)
    _close(bm.bitmask_linear_impl(x, *_components(w), b, 150, "expand"), _ref(x, w, b), BF)


@pytest.mark.parametrize("dtype,bf16_gemm", [(torch.float32, False), (BF, False), (BF, True)])
@pytest.mark.parametrize("tokens", [12, 40])
def test_expand_whole_from_many_tokens(monkeypatch, tmp_path, dtype, bf16_gemm, tokens):
    # a float32 GEMM (fp32 operands, or bf16 ones widened where bf16 GEMMs are slow) takes the whole
    # expanded weight above the bitmask.row_blocks_f32 crossover, row blocks up to it; a bf16 GEMM always
    # the whole one
    if bm.native_library() is None:
        pytest.skip("no native kernel here")
    monkeypatch.setenv("SPARSA_COST_DIR", str(tmp_path))
    cost_model.default_cost_model().set_fit(crossovers.PREFIX + bm.ROW_BLOCKS_CROSSOVER, {"max_tokens": 31})
    assert bm.row_blocks_max_tokens() == 31
    monkeypatch.setattr(bm, "_bf16_gemm_hardware", lambda: bf16_gemm)
    monkeypatch.setattr(bm, "_BLOCK_BYTES", 40 * 203 * 4)
    whole = []
    real = bm._scratch
    monkeypatch.setattr(bm, "_scratch", lambda n, dt: whole.append(dt) or real(n, dt))
    w = Bitmask.from_dense(torch.randn(150, 203).to(dtype), sparsity=0.6)
    x = torch.randn(tokens, 203).to(dtype)
    b = torch.randn(150).to(dtype)
    _close(bm.bitmask_linear_impl(x, *_components(w), b, 150, "expand"), _ref(x, w, b), dtype)
    gemm = BF if bf16_gemm else torch.float32
    assert whole == ([gemm] if bf16_gemm or tokens >= 32 else [])


# ---------------------------------------------------------------------------------------------- kernels
@SETTINGS
@given(
    R=st.integers(1, 40),
    K=st.integers(1, 150),  # the 16-column loops take 64 columns a step from K = 57
    T=st.integers(1, 21),
    density=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
    dtype=st.sampled_from([torch.float32, BF]),
    bias=st.sampled_from([None, "same", "f32"]),
    seed=st.integers(0, 99),
)
def test_matches_float64_reference(path, R, K, T, density, dtype, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(R, K, generator=gen)
    mask = torch.rand(R, K, generator=gen) < density
    w = Bitmask.from_dense(dense.to(dtype), mask=mask)
    x = torch.randn(T, K, generator=gen).to(dtype)
    b = None if bias is None else torch.randn(R, generator=gen).to(dtype if bias == "same" else torch.float32)
    y = bm.bitmask_linear_impl(x, *_components(w), b, R)
    _close(y, _ref(x, w, b), dtype)


@pytest.mark.parametrize("T", [3, 4, 5, 8])
@pytest.mark.parametrize("R", [1, 6, 7])
def test_dpbf16_stream_row_pairs_match_float64(monkeypatch, T, R):
    # from 4 tokens the bf16 loop takes two rows a pass; an odd last row, K past the last 64 columns
    if bm.native_library() is None or not bm.has_dpbf16():
        pytest.skip("this CPU has no AVX512-BF16 + VBMI2: the bf16 stream loop does not run")
    monkeypatch.setattr(bm, "STREAM_PATH", "auto")
    gen = torch.Generator().manual_seed(T * 10 + R)
    w = Bitmask.from_dense(torch.randn(R, 203, generator=gen).to(BF), mask=torch.rand(R, 203, generator=gen) < 0.4)
    x = torch.randn(T, 203, generator=gen).to(BF)
    b = torch.randn(R, generator=gen).to(BF)
    _close(bm.bitmask_linear_impl(x, *_components(w), b, R, "stream"), _ref(x, w, b), BF)


def test_leading_dims_and_llm_shapes(path):
    # K not a multiple of 8, the last row ends at the array end, several token chunks
    w = Bitmask.from_dense(torch.randn(96, 203), sparsity=0.6)
    x = torch.randn(2, 3, 203)
    _close(bm.bitmask_linear_impl(x, *_components(w), None, 96), _ref(x, w, None), torch.float32)


def test_inf_in_input_reaches_every_row_like_dense(path):
    w = Bitmask.from_dense(torch.randn(5, 16), mask=torch.eye(5, 16, dtype=torch.bool))
    x = torch.randn(1, 16)
    x[0, 15] = float("inf")  # column 15 is kept by no row
    y = bm.bitmask_linear_impl(x, *_components(w), None, 5)
    assert torch.isnan(y).all() and torch.isnan(torch.nn.functional.linear(x, w.to_dense())).all()


def test_threads_do_not_change_the_result(path):
    w = Bitmask.from_dense(torch.randn(301, 130), sparsity=0.7)
    x = torch.randn(3, 130)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = bm.bitmask_linear_impl(x, *_components(w), None, 301)
        torch.set_num_threads(2)
        two = bm.bitmask_linear_impl(x, *_components(w), None, 301)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)


# ---------------------------------------------------------------------------------------------- panel
@pytest.fixture
def needs_panel():
    if not bm.has_panel_bf16():
        pytest.skip("this CPU (or SPARSA_ISA) has no AVX512-BF16 + VBMI2: the bf16 panel kernel does not run")


def _spy_strategies(monkeypatch):
    """Which strategy functions ran, in order."""
    ran = []
    for name in ("_stream", "_expand", "_panel", "_amx", "_fused"):
        real = getattr(bm, name)

        def spy(*a, _real=real, _name=name, **k):
            ran.append(_name[1:])
            return _real(*a, **k)

        monkeypatch.setattr(bm, name, spy)
    return ran


def _bf16_weight(R, K, density, seed, odd_rows=False):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(R, K, generator=gen) < density
    if odd_rows and R > 2:
        mask[0] = False  # an empty row
        mask[1] = False
        mask[1, K - 1] = True  # one kept column, the last: an odd count pairs with the zero row
    return Bitmask.from_dense(torch.randn(R, K, generator=gen).to(BF), mask=mask)


@pytest.mark.usefixtures("needs_panel")
@pytest.mark.parametrize(
    "T,R,K,density",
    [
        (128, 64, 96, 0.5),  # one chunk, whole panels
        (37, 33, 1536, 0.5),  # column chunks (K > 512 at density >= 0.4), odd R, a part panel
        (40, 67, 2100, 0.3),  # chunks from K >= 2048, K past the last whole 64 columns
        (70, 130, 600, 0.2),  # no chunks (sparse), more than one block of rows
        (9, 5, 7, 0.9),  # K under one mask word
        (33, 3, 1, 1.0),
        (16, 67, 1536, 0.5),  # one 16-token panel (batched decoding), column chunks
        (12, 130, 2100, 0.3),  # a part 16-token panel, chunks from K >= 2048, two blocks of rows
    ],
)
@pytest.mark.parametrize("bias", [None, "bf16", "f32"])
def test_panel_matches_float64(monkeypatch, T, R, K, density, bias):
    ran = _spy_strategies(monkeypatch)
    w = _bf16_weight(R, K, density, seed=T + R + K, odd_rows=True)
    x = torch.randn(T, K).to(BF)
    b = None if bias is None else torch.randn(R).to(BF if bias == "bf16" else torch.float32)
    y = bm.bitmask_linear_impl(x, *_components(w), b, R, "panel")
    assert ran == ["panel"]  # no fallback to expand
    _close(y, _ref(x, w, b), BF)


@pytest.mark.usefixtures("needs_panel")
@settings(max_examples=20, deadline=None)
@given(
    R=st.integers(1, 70),
    K=st.integers(1, 2300),  # chunked from K > 512 at density >= 0.4 and from K >= 2048
    T=st.integers(9, 70),
    density=st.sampled_from([0.02, 0.3, 0.45, 0.6, 1.0]),
    seed=st.integers(0, 999),
)
def test_panel_property_against_float64(R, K, T, density, seed):
    w = _bf16_weight(R, K, density, seed)
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(seed)).to(BF)
    _close(bm.bitmask_linear_impl(x, *_components(w), None, R, "panel"), _ref(x, w, None), BF)


@pytest.mark.usefixtures("needs_panel")
def test_panel_token_results_do_not_depend_on_the_batch():
    # each token is one lane of a panel with a fixed pair order, so it is bit-exact alone or in a batch
    w = _bf16_weight(70, 1100, 0.45, seed=3, odd_rows=True)
    x = torch.randn(45, 1100).to(BF)
    whole = bm.bitmask_linear_impl(x, *_components(w), None, 70, "panel")
    for i in (0, 31, 32, 44):
        one = bm.bitmask_linear_impl(x[i : i + 9], *_components(w), None, 70, "panel")
        assert torch.equal(one[0], whole[i])


@pytest.mark.usefixtures("needs_panel")
def test_panel_nan_or_inf_in_x_runs_expand_like_dense(monkeypatch):
    ran = _spy_strategies(monkeypatch)
    w = Bitmask.from_dense(torch.randn(6, 40).to(BF), mask=torch.eye(6, 40, dtype=torch.bool))
    x = torch.randn(12, 40).to(BF)
    x[4, 39] = float("inf")  # column 39 is kept by no row: only the dense product spreads it
    y = bm.bitmask_linear_impl(x, *_components(w), None, 6, "panel")
    assert ran == ["panel", "expand"]
    assert torch.isnan(y[4]).all()
    keep = torch.arange(12) != 4
    _close(y[keep], _ref(x[keep], w, None), BF)


@pytest.mark.usefixtures("needs_panel")
def test_panel_with_columns_past_16_bits_runs_expand(monkeypatch):
    ran = _spy_strategies(monkeypatch)
    K = 65536
    w = _bf16_weight(3, K, 0.01, seed=1)
    x = torch.randn(9, K).to(BF)
    y = bm.bitmask_linear_impl(x, *_components(w), None, 3, "panel")
    assert ran == ["panel", "expand"]
    _close(y, _ref(x, w, None), BF)


@pytest.mark.parametrize("panel_crossover", [0.55, 0.0])
def test_auto_strategy_by_tokens_dtype_and_density(monkeypatch, tmp_path, panel_crossover):
    # stream up to the stream crossover; above, panel up to the crossover in the cost table, else expand:
    # the batch crossovers up to BATCH_MAX_TOKENS (here the opposite of the prefill ones), the prefill ones above
    if bm.native_library() is None:
        pytest.skip("no native kernel here")
    monkeypatch.setenv("SPARSA_COST_DIR", str(tmp_path))
    batch_crossover = 0.55 - panel_crossover
    for name in bm.PANEL_CROSSOVERS.values():
        cost_model.default_cost_model().set_fit(crossovers.PREFIX + name, {"max_density": panel_crossover})
    for name in bm.BATCH_PANEL_CROSSOVERS.values():
        cost_model.default_cost_model().set_fit(crossovers.PREFIX + name, {"max_density": batch_crossover})
    for name in bm.STREAM_CROSSOVERS.values():
        cost_model.default_cost_model().set_fit(crossovers.PREFIX + name, {"max_tokens": 8})
    assert bm.panel_max_density(BF) == bm.panel_max_density(torch.float32) == panel_crossover
    assert bm.panel_max_density(BF, bm.BATCH_MAX_TOKENS) == batch_crossover
    assert bm.stream_max_tokens(BF) == bm.stream_max_tokens(torch.float32) == 8
    assert bm.panel_max_density(torch.float32, 9) == batch_crossover
    assert bm.panel_max_density(BF, bm.BATCH_MAX_TOKENS + 1) == panel_crossover
    ran = _spy_strategies(monkeypatch)
    sparse, dense = _bf16_weight(20, 64, 0.5, seed=0), _bf16_weight(20, 64, 0.6, seed=0)
    x = torch.randn(bm.BATCH_MAX_TOKENS + 8, 64).to(BF)
    bm.bitmask_linear_impl(x[:8], *_components(sparse), None, 20)
    bm.bitmask_linear_impl(x, *_components(sparse), None, 20)
    bm.bitmask_linear_impl(x, *_components(dense), None, 20)
    bm.bitmask_linear_impl(x[:16], *_components(sparse), None, 20)
    w32 = Bitmask.from_dense(torch.randn(20, 64), sparsity=0.5)
    bm.bitmask_linear_impl(x.float(), *_components(w32), None, 20)
    dense32 = Bitmask.from_dense(torch.randn(20, 64), sparsity=0.4)
    bm.bitmask_linear_impl(x.float(), *_components(dense32), None, 20)
    bm.bitmask_linear_impl(x[:16].float(), *_components(w32), None, 20)
    dense16 = "amx" if bm.has_amx() else "expand"  # bf16's dense side: the AMX tiles where they run
    dense32 = "fused" if bm.has_fused_f32() else "expand"  # f32's: the fused kernel where it runs (40 tokens)
    many = "panel" if bm.has_panel_bf16() and panel_crossover else dense16
    many32 = "panel" if bm.has_panel_f32() and panel_crossover else dense32
    few = "panel" if bm.has_panel_bf16() and batch_crossover else dense16
    few32 = "panel" if bm.has_panel_f32() and batch_crossover else dense32
    assert ran == ["stream", many, dense16, few, many32, dense32, few32]


def test_panel_crossovers_by_cpu_class(monkeypatch, tmp_path):
    # measured on amd-avx512; elsewhere the bf16 panel waits for a refit (a dense bf16 GEMM may be AMX)
    monkeypatch.setenv("SPARSA_COST_DIR", str(tmp_path))
    monkeypatch.setattr(crossovers, "_this_class", lambda: "amd-avx512")
    assert bm.panel_max_density(BF) == 0.5 and bm.panel_max_density(torch.float32) == 0.55
    monkeypatch.setattr(crossovers, "_this_class", lambda: "unmeasured-class")
    assert bm.panel_max_density(BF) == 0.0 and 0 < bm.panel_max_density(torch.float32) < 0.55
    assert bm.choose_strategy(128, BF, 0.1) == ("amx" if bm.has_amx() else "expand")
    assert bm.panel_max_density(torch.float16) == 0.0


def test_panel_strategy_without_the_kernel_runs_expand(monkeypatch):
    if bm.native_library() is None:
        pytest.skip("no native kernel here")
    monkeypatch.setenv("SPARSA_ISA", "avx2")
    assert not bm.has_panel_bf16()
    ran = _spy_strategies(monkeypatch)
    w = _bf16_weight(10, 50, 0.5, seed=2)
    x = torch.randn(20, 50).to(BF)
    y = bm.bitmask_linear_impl(x, *_components(w), None, 10, "panel")
    assert ran == ["panel", "expand"]
    _close(y, _ref(x, w, None), BF)


# ------------------------------------------------------------------------------------------ panel f32
@pytest.fixture
def needs_panel_f32():
    if bm.native_library() is None or not bm.has_panel_f32():
        pytest.skip("no AVX2 build of the bitmask kernels here: the float32 panel kernel does not run")


def _f32_weight(R, K, density, seed):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(R, K, generator=gen) < density
    if R > 2:
        mask[0] = False  # an empty row
        mask[1] = False
        mask[1, K - 1] = True  # one kept column, the last
    return Bitmask.from_dense(torch.randn(R, K, generator=gen), mask=mask)


@pytest.mark.usefixtures("needs_panel_f32")
@pytest.mark.parametrize(
    "T,R,K,density",
    [
        (128, 64, 96, 0.5),  # one chunk, whole panels
        (37, 33, 1537, 0.3),  # column chunks (K > 512), K not a multiple of 8, odd R, a part panel
        (70, 130, 600, 0.2),  # chunks, more than one block of rows
        (9, 5, 7, 0.9),  # K under one mask byte
        (33, 3, 1, 1.0),
        (5, 67, 1537, 0.3),  # one 8-token panel: 8 rows at a time, a short last group
        (16, 70, 600, 0.5),  # one 16-token panel
        (41, 33, 700, 0.4),  # a 32-token panel, then an 8-token one
    ],
)
@pytest.mark.parametrize("bias", [None, "f32"])
def test_panel_f32_matches_float64(monkeypatch, T, R, K, density, bias):
    ran = _spy_strategies(monkeypatch)
    w = _f32_weight(R, K, density, seed=T + R + K)
    x = torch.randn(T, K)
    b = None if bias is None else torch.randn(R)
    y = bm.bitmask_linear_impl(x, *_components(w), b, R, "panel")
    assert ran == ["panel"]  # no fallback to expand
    _close(y, _ref(x, w, b), torch.float32)


@pytest.mark.usefixtures("needs_panel_f32")
@SETTINGS
@given(
    R=st.integers(1, 140), K=st.integers(1, 1300), T=st.integers(1, 70), density=st.floats(0, 1), seed=st.integers(0, 9)
)
def test_panel_f32_property_against_float64(R, K, T, density, seed):
    gen = torch.Generator().manual_seed(seed)
    w = Bitmask.from_dense(torch.randn(R, K, generator=gen), mask=torch.rand(R, K, generator=gen) < density)
    x = torch.randn(T, K, generator=gen)
    _close(bm.bitmask_linear_impl(x, *_components(w), None, R, "panel"), _ref(x, w, None), torch.float32)


@pytest.mark.usefixtures("needs_panel_f32")
def test_panel_f32_token_results_do_not_depend_on_the_batch():
    w = _f32_weight(70, 900, 0.3, seed=5)
    x = torch.randn(75, 900)
    whole = bm.bitmask_linear_impl(x, *_components(w), None, 70, "panel")
    # every panel width (8, 16 and 32 tokens) sums a token's products in the same order
    for i, n in ((0, 9), (31, 9), (40, 9), (3, 5), (66, 8), (10, 33)):
        one = bm.bitmask_linear_impl(x[i : i + n], *_components(w), None, 70, "panel")
        assert torch.equal(one, whole[i : i + n])


@pytest.mark.usefixtures("needs_panel_f32")
@pytest.mark.parametrize("T,R,K,density", [(40, 70, 1537, 0.1), (33, 9, 21, 0.05), (64, 17, 600, 0.9), (20, 3, 7, 0.3)])
def test_panel_f32_gives_the_same_bits_on_8_and_16_lanes(monkeypatch, T, R, K, density):
    # the 16-lane path lists kept columns by compressing 16 at a time, the 8-lane one by mask bytes (empty
    # ones included): both lists, and so both sums, must be the same, chunked or not, with K's last bits
    if bm.native_library() is None or cpu.hardware_isa() not in ("avx512", "amx"):
        pytest.skip("no AVX-512 here: only the 8-lane panel runs")
    w = _f32_weight(R, K, density, seed=K)
    x = torch.randn(T, K)
    monkeypatch.delenv("SPARSA_ISA", raising=False)
    wide = bm.bitmask_linear_impl(x, *_components(w), None, R, "panel")
    monkeypatch.setenv("SPARSA_ISA", "avx2")
    assert torch.equal(bm.bitmask_linear_impl(x, *_components(w), None, R, "panel"), wide)
    _close(wide, _ref(x, w, None), torch.float32)


@pytest.mark.usefixtures("needs_panel_f32")
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_panel_f32_nan_or_inf_in_x_runs_expand_like_dense(monkeypatch, bad):
    ran = _spy_strategies(monkeypatch)
    w = Bitmask.from_dense(torch.randn(6, 40), mask=torch.eye(6, 40, dtype=torch.bool))
    x = torch.randn(20, 40)
    x[3, 39] = bad  # column 39 is kept by no row
    y = bm.bitmask_linear_impl(x, *_components(w), None, 6, "panel")
    assert ran == ["panel", "expand"]
    assert torch.isnan(y[3]).all() and torch.isnan(torch.nn.functional.linear(x, w.to_dense())[3]).all()


# ---------------------------------------------------------------------------------------------- fused
@pytest.fixture
def needs_fused():
    if bm.native_library() is None or not bm.has_fused_f32():
        pytest.skip("this CPU (or SPARSA_ISA) has no AVX-512F: the float32 fused kernel does not run")


@pytest.mark.usefixtures("needs_fused")
@pytest.mark.parametrize(
    "T,R,K,density",
    [
        (128, 48, 128, 0.5),  # whole panels, one 4-tile block, one column chunk
        (33, 61, 300, 0.5),  # a 1-token panel, a part tile, chunks and a 44-column tail
        (70, 150, 1000, 0.3),  # several blocks per thread, K past the last whole 16 columns
        (5, 13, 17, 1.0),  # dense rows, a 1-column tail
        (40, 25, 64, 0.0),  # no kept weight: the bias (or zero)
    ],
)
@pytest.mark.parametrize("bias", [None, "f32"])
@pytest.mark.parametrize("activation", ["none", "gelu"])
def test_fused_matches_float64(T, R, K, density, bias, activation):
    w = _f32_weight(R, K, density, seed=T + R + K)
    x = torch.randn(T, K)
    b = None if bias is None else torch.randn(R)
    y = bm.bitmask_linear_impl(x, *_components(w), b, R, "fused", activation=activation)
    ref = _ref(x, w, b)
    if activation == "gelu":
        ref = torch.nn.functional.gelu(ref)
    _close(y, ref, torch.float32)


@pytest.mark.usefixtures("needs_fused")
@SETTINGS
@given(
    R=st.integers(1, 60), K=st.integers(1, 300), T=st.integers(1, 70), density=st.floats(0, 1), seed=st.integers(0, 99)
)
def test_fused_property_against_float64(R, K, T, density, seed):
    gen = torch.Generator().manual_seed(seed)
    w = Bitmask.from_dense(torch.randn(R, K, generator=gen), mask=torch.rand(R, K, generator=gen) < density)
    x = torch.randn(T, K, generator=gen)
    _close(bm.bitmask_linear_impl(x, *_components(w), None, R, "fused"), _ref(x, w, None), torch.float32)


@pytest.mark.usefixtures("needs_fused")
def test_fused_token_and_row_results_do_not_depend_on_the_batch_or_threads():
    # each output sums its row's columns in one order, whatever the panel a token is in or the thread
    w = _f32_weight(100, 700, 0.5, seed=3)
    x = torch.randn(75, 700)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = bm.bitmask_linear_impl(x, *_components(w), None, 100, "fused")
        torch.set_num_threads(2)
        two = bm.bitmask_linear_impl(x, *_components(w), None, 100, "fused")
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)
    for lo, hi in ((0, 1), (3, 40), (40, 75)):
        assert torch.equal(bm.bitmask_linear_impl(x[lo:hi], *_components(w), None, 100, "fused"), one[lo:hi])


def test_fused_without_the_kernel_or_in_bf16_runs_expand(monkeypatch):
    if bm.native_library() is None:
        pytest.skip("no native kernel here")
    ran = _spy_strategies(monkeypatch)
    w = _bf16_weight(10, 50, 0.5, seed=4)
    x = torch.randn(40, 50).to(BF)
    _close(bm.bitmask_linear_impl(x, *_components(w), None, 10, "fused"), _ref(x, w, None), BF)
    monkeypatch.setenv("SPARSA_ISA", "avx2")
    assert not bm.has_fused_f32()
    w32 = _f32_weight(10, 50, 0.5, seed=4)
    _close(
        bm.bitmask_linear_impl(x.float(), *_components(w32), None, 10, "fused"),
        _ref(x.float(), w32, None),
        torch.float32,
    )
    assert ran == ["fused", "expand", "fused", "expand"]
    assert bm.dense_strategy(128, torch.float32) == "expand"


def test_dense_strategy_by_dtype_tokens_and_crossover(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSA_COST_DIR", str(tmp_path))
    cost_model.default_cost_model().set_fit(crossovers.PREFIX + bm.FUSED_CROSSOVER, {"max_tokens": 96})
    assert bm.fused_max_tokens() == 96
    fused = "fused" if bm.has_fused_f32() else "expand"
    assert [bm.dense_strategy(t, torch.float32) for t in (33, 96, 97)] == [fused, fused, "expand"]
    assert bm.dense_strategy(64, BF) == ("amx" if bm.has_amx() else "expand")
    assert bm.choose_strategy(64, torch.float32, 0.99) == fused  # too dense for the panel: the dense side


# ---------------------------------------------------------------------------------------------- op
@pytest.mark.parametrize(
    "dtype,bias", [(torch.float32, None), (torch.float32, torch.float32), (BF, BF), (BF, torch.float32)]
)
@pytest.mark.parametrize("tokens", [3, 12, 40])  # stream; expand, fused or panel
def test_opcheck(dtype, bias, tokens):
    w = Bitmask.from_dense(torch.randn(9, 21).to(dtype), sparsity=0.5)
    x = torch.randn(tokens, 21, dtype=dtype, requires_grad=True)
    v = w.values.clone().requires_grad_(True)
    b = None if bias is None else torch.randn(9, dtype=bias, requires_grad=True)
    torch.library.opcheck(torch.ops.sparsa.bitmask_linear.default, (x, w.bits, w.row_ptr, v, b, 9))


@pytest.mark.parametrize("strategy", ["stream", "expand", "panel", "amx", "nm24", "fused", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, BF])
def test_gelu_activation_matches_gelu_of_the_product(strategy, dtype):
    # in the panel and AMX kernels' epilogue (on the fp32 sums, before rounding), after the other strategies
    # and wherever a kernel falls back: GELU of the reference product either way
    w = Bitmask.from_dense(torch.randn(40, 96).to(dtype), sparsity=0.5)
    x = torch.randn(2, 19, 96).to(dtype)
    b = torch.randn(40).to(dtype)
    y = bm.bitmask_linear_impl(x, *_components(w), b, 40, strategy, activation="gelu")
    ref = torch.nn.functional.gelu(x.double() @ w.to_dense().double().T + b.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert y.shape == (2, 19, 40) and y.dtype == dtype
    assert (y.double() - ref).abs().max() <= tol * ref.abs().max()
    with pytest.raises(ValueError, match="activation must be one of"):
        bm.bitmask_linear_impl(x, *_components(w), b, 40, strategy, activation="relu")


def test_gelu_activation_opcheck_and_gradcheck():
    w = Bitmask.from_dense(torch.randn(9, 21), sparsity=0.5)
    x = torch.randn(12, 21, requires_grad=True)
    v = w.values.clone().requires_grad_(True)
    b = torch.randn(9, requires_grad=True)
    torch.library.opcheck(torch.ops.sparsa.bitmask_linear.default, (x, w.bits, w.row_ptr, v, b, 9, "gelu"))
    w64 = Bitmask.from_dense(torch.randn(7, 19, dtype=torch.float64), sparsity=0.5)
    x64 = torch.randn(4, 19, dtype=torch.float64, requires_grad=True)
    v64 = w64.values.clone().requires_grad_(True)
    b64 = torch.randn(7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, v, b: bm.bitmask_linear(x, w64.bits, w64.row_ptr, v, b, 7, "gelu"), (x64, v64, b64)
    )


def test_gradcheck():
    w = Bitmask.from_dense(torch.randn(7, 19, dtype=torch.float64), sparsity=0.5)
    x = torch.randn(4, 19, dtype=torch.float64, requires_grad=True)
    v = w.values.clone().requires_grad_(True)
    b = torch.randn(7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, v, b: bm.bitmask_linear(x, w.bits, w.row_ptr, v, b, 7), (x, v, b))


def test_compile_traces_the_op():
    w = sparsa.to_sparse(torch.randn(12, 24), "bitmask", sparsity=0.5)
    x = torch.randn(2, 24)
    fn = torch.compile(lambda x: torch.nn.functional.linear(x, w).relu(), backend="eager", fullgraph=True)
    torch.testing.assert_close(fn(x), (x @ w.to_dense().T).relu(), rtol=1e-4, atol=1e-4)


def test_linear_module_forward_backward_through_dispatcher():
    torch.manual_seed(0)
    lin = torch.nn.Linear(24, 10)
    dense = torch.nn.Linear(24, 10)
    sparsa.sparsify(lin, [sparsa.Rule(sparsifier=sparsa.sparsifiers.Magnitude(0.5, per="row"), layout="bitmask")])
    assert lin.weight.layout_name == "bitmask"
    with torch.no_grad():
        dense.weight.copy_(lin.weight.to_dense())
        dense.bias.copy_(lin.bias)
    sparsa.reset_fallback_counts()
    x = torch.randn(5, 24, requires_grad=True)
    xd = x.detach().clone().requires_grad_(True)
    y, yd = lin(x), dense(xd)
    torch.testing.assert_close(y, yd, rtol=1e-4, atol=1e-5)
    y.square().sum().backward()
    yd.square().sum().backward()
    assert sparsa.fallback_counts() == {}
    torch.testing.assert_close(x.grad, xd.grad, rtol=1e-4, atol=1e-5)
    mask = lin.weight.mask() if hasattr(lin.weight, "mask") else lin.weight._layout.mask()
    gw = lin.weight.grad.to_dense() if hasattr(lin.weight.grad, "to_dense") else lin.weight.grad
    torch.testing.assert_close(gw, dense.weight.grad * mask, rtol=1e-4, atol=1e-5)


def test_bf16_model_conversion_keeps_layout():
    lin = torch.nn.Linear(16, 8)
    sparsa.sparsify(lin, [sparsa.Rule(sparsifier=sparsa.sparsifiers.Magnitude(0.5, per="row"), layout="bitmask")])
    lin.to(BF)
    assert lin.weight.layout_name == "bitmask" and lin.weight.dtype == BF
    x = torch.randn(2, 16, dtype=BF)
    _close(lin(x), _ref(x, lin.weight._layout, lin.bias), BF)


_GUARDED_CALL = r"""
import ctypes, mmap, sys, torch
from sparsa.kernels import bitmask as bm
from sparsa.layouts import Bitmask

where, path, strategy, dtype = sys.argv[1], sys.argv[2], sys.argv[3], getattr(torch, sys.argv[4])
bm.STREAM_PATH = path
page = mmap.PAGESIZE
buf = mmap.mmap(-1, 4 * page)
base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
libc = ctypes.CDLL(None)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
assert libc.mprotect(base, page, 0) == 0 and libc.mprotect(base + 3 * page, page, 0) == 0  # PROT_NONE
torch.manual_seed(0)
w = Bitmask.from_dense(torch.randn(37, 83).to(dtype), sparsity=0.6)
n, item = w.values.numel(), w.values.element_size()
offset = page if where == "front" else 3 * page - n * item  # values touch the guard page before / after
values = torch.frombuffer(buf, dtype=dtype, count=n, offset=offset)
values.copy_(w.values)
x = torch.randn(3, 83).to(dtype)
y = bm.bitmask_linear_impl(x, w.bits, w.row_ptr, values, None, 37, strategy)
ref = x.double() @ w.to_dense().double().T
assert torch.allclose(y.double(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max())), "wrong result"
print("ok")
"""


@pytest.mark.parametrize("where", ["front", "back"])
@pytest.mark.parametrize(
    "path,strategy,dtype",
    [
        ("avx2", "stream", "float32"),
        ("pair16", "stream", "float32"),
        ("avx2", "stream", "bfloat16"),
        ("avx2", "expand", "float32"),
        ("avx512", "stream", "float32"),
        ("dpbf16", "stream", "bfloat16"),
        ("dpbf16", "panel", "bfloat16"),
        ("avx2", "panel", "float32"),
        ("avx512", "fused", "float32"),
    ],
)
def test_kernels_read_nothing_outside_the_values_array(tmp_path, where, path, strategy, dtype):
    # the fp32 row loop loads from up to 4 values before a group's first one and up to 8 past its last:
    # with an unreadable page right before (after) the array, any read outside it kills the process
    if bm.native_library() is None:
        pytest.skip("no native kernel here")
    if path == "avx512" and not bm.has_avx512():
        pytest.skip("this CPU has no AVX-512F: its 16-column loop runs as pair16 (AVX2 halves)")
    if path == "dpbf16" and not bm.has_dpbf16():
        pytest.skip("this CPU has no AVX512-BF16 + VBMI2: the bf16 dot-product loop does not run")
    if strategy == "fused" and not bm.has_fused_f32():
        pytest.skip("this CPU has no AVX-512F: the float32 fused kernel does not run")
    if strategy == "panel" and dtype == "bfloat16" and not bm.has_panel_bf16():
        pytest.skip("this CPU has no AVX512-BF16 + VBMI2: the bf16 panel kernel does not run")
    script = tmp_path / "guarded.py"
    script.write_text(_GUARDED_CALL)
    env = {k: v for k, v in os.environ.items() if k not in ("SPARSA_NO_NATIVE", "SPARSA_ISA")}
    run = subprocess.run(
        [sys.executable, str(script), where, path, strategy, dtype], capture_output=True, text=True, env=env
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", (run.returncode, run.stderr[-2000:])


@pytest.mark.parametrize("dtype", [torch.float32, BF])
def test_auto_strategy_treats_a_pruned_weight_at_its_nominal_density(dtype):
    # 70% of 1536 columns keeps 461 per row (0.30013): the choice must be the one for 0.3, as the
    # density crossovers are measured and stored at grid points
    w = Bitmask.from_dense(torch.randn(64, 1536).to(dtype), sparsity=0.7)
    assert w.values.numel() / (64 * 1536) > 0.3
    for tokens in (16, 128):
        assert bm.auto_strategy(tokens, dtype, w.bits, w.values, 64, 1536) == bm.choose_strategy(tokens, dtype, 0.3)
