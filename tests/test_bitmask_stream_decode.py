"""``bitmask.stream_decode``: the eager decode path of ``F.linear`` on a Bitmask weight.

It must give exactly what the kernel op gives for the calls it takes, and take no call that a tracer,
dispatch mode or autograd has to see, or that another strategy should run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import sparsa
from sparsa import cpu
from sparsa.kernels import bitmask as bm
from sparsa.layouts import Bitmask

BF = torch.bfloat16


@pytest.fixture(autouse=True)
def native(monkeypatch):
    monkeypatch.delenv("SPARSA_NO_NATIVE", raising=False)
    monkeypatch.delenv("SPARSA_ISA", raising=False)
    if cpu.ISA_LEVELS.index(cpu.hardware_isa()) < cpu.ISA_LEVELS.index("avx2") or bm.native_library() is None:
        pytest.skip("no native bitmask kernel on this CPU: stream_decode declines every call (tested below)")


def _weight(R, K, dtype, density=0.4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return Bitmask.from_dense(
        torch.randn(R, K, generator=gen).to(dtype), mask=torch.rand(R, K, generator=gen) < density
    )


def _args(w, bias=None):
    return w.bits, w.row_ptr, w.values, bias, w.shape[0]


@pytest.mark.parametrize("shape", [(1, 203), (3, 203), (1, 1, 203), (2, 1, 203)])
@pytest.mark.parametrize(
    "dtype,bias_dtype",
    [(torch.float32, None), (torch.float32, torch.float32), (BF, None), (BF, BF), (BF, torch.float32)],
)
def test_same_bits_as_the_kernel_op(shape, dtype, bias_dtype):
    w = _weight(67, 203, dtype)
    bias = None if bias_dtype is None else torch.randn(67).to(bias_dtype)
    x = torch.randn(shape).to(dtype)
    got = bm.stream_decode(x, *_args(w, bias))
    assert got is not None and got.shape == (*shape[:-1], 67) and got.dtype == dtype
    assert torch.equal(got, bm.bitmask_linear_impl(x, *_args(w, bias), strategy="stream"))


@settings(max_examples=25, deadline=None)
@given(
    R=st.integers(1, 40),
    K=st.integers(1, 150),
    T=st.integers(1, 3),
    density=st.floats(0.0, 1.0),
    bf16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_against_float64(R, K, T, density, bf16, seed):
    dtype = BF if bf16 else torch.float32
    w = _weight(R, K, dtype, density, seed)
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    got = bm.stream_decode(x, *_args(w))
    assert got is not None
    want = x.double() @ w.to_dense().double().T
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * max(1.0, float(want.abs().max())))


def test_declines_what_it_must_not_take(monkeypatch):
    w = _weight(16, 40, torch.float32)
    x = torch.randn(1, 40)
    assert bm.stream_decode(x, *_args(w)) is not None
    # autograd must record the op (direct calls under grad mode)
    assert bm.stream_decode(x.clone().requires_grad_(True), *_args(w)) is None
    assert bm.stream_decode(x, w.bits, w.row_ptr, w.values.clone().requires_grad_(True), None, 16) is None
    assert bm.stream_decode(x, *_args(w, torch.zeros(16, requires_grad=True))) is None
    # dtypes without a native kernel, a layout the kernel cannot read in place, nothing to compute
    assert bm.stream_decode(x.double(), *_args(_weight(16, 40, torch.float64))) is None
    assert bm.stream_decode(torch.randn(2, 80)[:, ::2], *_args(w)) is None
    assert bm.stream_decode(torch.randn(0, 40), *_args(w)) is None
    # more tokens than the stream strategy takes here
    many = bm.stream_max_tokens(torch.float32) + 1
    assert bm.stream_decode(torch.randn(many, 40), *_args(w)) is None
    # a tensor subclass (its own __torch_function__ / __torch_dispatch__ must see the call)
    with torch.no_grad():
        assert bm.stream_decode(torch.nn.Parameter(x, requires_grad=False), *_args(w)) is None
    # native kernels switched off
    monkeypatch.setenv("SPARSA_NO_NATIVE", "1")
    assert bm.stream_decode(x, *_args(w)) is None


def test_a_dispatch_mode_sees_the_kernel_op():
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    w = sparsa.to_sparse(torch.randn(16, 40), "bitmask", sparsity=0.5)
    x = torch.randn(1, 40)
    with torch.no_grad(), Record():
        y = F.linear(x, w)
    assert any("bitmask_linear_kernel" in s for s in seen), seen
    torch.testing.assert_close(y, x @ w.to_dense().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout,params", [("bitmask", {"sparsity": 0.5}), ("nm", {"n": 2, "m": 4})])
def test_f_linear_takes_it_for_a_decode_call(monkeypatch, layout, params):
    """An eager decode call of ``F.linear`` never reaches the kernel op's implementation; a prefill call does
    (Bitmask weights, and N:M ones, which run the same kernels)."""
    w = sparsa.to_sparse(torch.randn(16, 40).to(BF), layout, **params)
    calls = []
    real = bm.bitmask_linear_impl

    def spy(*a, **k):
        calls.append(a[0].shape)
        return real(*a, **k)

    monkeypatch.setattr(bm.bitmask_linear_kernel, "impl", spy)
    x = torch.randn(1, 1, 40).to(BF)
    with torch.no_grad():
        y = F.linear(x, w)
    assert calls == [] and y.shape == (1, 1, 16)
    torch.testing.assert_close(y.double(), x.double() @ w.to_dense().double().T, rtol=2e-2, atol=2e-2)
    with torch.no_grad():
        F.linear(torch.randn(64, 40).to(BF), w)
    assert calls == [torch.Size([64, 40])]


@pytest.mark.parametrize("shape", [(3, 0), (2, 1, 0), (0, 5)])
def test_empty_inputs_give_the_bias(shape):
    K = shape[-1]
    w = _weight(4, K, torch.float32)
    bias = torch.randn(4)
    assert bm.stream_decode(torch.randn(shape), *_args(w, bias)) is None
    got = bm.bitmask_linear_impl(torch.randn(shape), *_args(w, bias))
    torch.testing.assert_close(got, torch.zeros(*shape[:-1], 4) + bias)


@pytest.mark.parametrize("dtype", [torch.float32, BF])
def test_a_strided_bias(dtype):
    """A bias view that is not contiguous is copied, and the copy outlives the kernel call."""
    w = _weight(48, 64, dtype)
    bias = torch.randn(96).to(dtype)[::2]
    x = torch.randn(1, 64).to(dtype)
    want = x.double() @ w.to_dense().double().T + bias.double()
    for _ in range(20):  # a freed copy would be overwritten by the allocations in between
        got = bm.stream_decode(x, *_args(w, bias))
        torch.randn(96).to(dtype)
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, BF])
@pytest.mark.parametrize("density", [0.1, 0.3, 0.5, 0.9])
def test_takes_exactly_the_calls_the_op_would_stream(monkeypatch, dtype, density):
    """Above the stream loop's token limit the density decides (batched bf16 decoding streams a weight too
    dense for the panel kernel): the decode path follows the op's choice at every token count. The
    crossovers are set to the figures measured on amd-avx512 (the tests' CPU class has none)."""
    real_token_crossover = bm.token_crossover
    monkeypatch.setattr(bm, "stream_max_tokens", lambda dt: 12 if dt == BF else 6)
    monkeypatch.setattr(bm, "panel_max_density", lambda dt, tokens=None: 0.4)
    monkeypatch.setattr(bm, "has_panel_bf16", lambda: True)
    monkeypatch.setattr(bm, "has_panel_f32", lambda: True)
    monkeypatch.setattr(
        bm, "token_crossover", lambda n, cm=None: 16 if n == bm.BATCH_STREAM_CROSSOVER else real_token_crossover(n, cm)
    )
    w = _weight(32, 96, dtype, density)
    dens = w.values.numel() / (32 * 96)
    for tokens in range(1, 33):
        x = torch.randn(tokens, 96).to(dtype)
        took = bm.stream_decode(x, *_args(w)) is not None
        assert took == (bm.choose_strategy(tokens, dtype, dens) == "stream"), (tokens, dens)
