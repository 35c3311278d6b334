"""``F.linear`` with an N:M weight on the CPU runs the Bitmask kernels on the layout's own values."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import sparsa
from sparsa.kernels import bitmask as bm
from sparsa.layouts import NM
from sparsa.ops import nm_linear

BF = torch.bfloat16
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _close(got, want, dtype):
    assert got.dtype == dtype and got.shape == want.shape
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol * scale)


@pytest.fixture
def no_dense_weight(monkeypatch):
    """Fails the test if the forward materialises the N:M weight."""

    def boom(self):
        raise AssertionError("the N:M weight was materialised in the forward")

    monkeypatch.setattr(NM, "to_dense", boom)


@SETTINGS
@given(
    nm=st.sampled_from([(2, 4), (1, 4), (4, 8), (2, 3)]),
    R=st.integers(1, 24),
    K=st.integers(1, 70),
    T=st.sampled_from([1, 3, 9, 40]),  # stream, and expand or (bf16) panel
    dtype=st.sampled_from([torch.float32, BF]),
    bias=st.booleans(),
    seed=st.integers(0, 99),
)
def test_forward_matches_float64(nm, R, K, T, dtype, bias, seed):
    n, m = nm
    gen = torch.Generator().manual_seed(seed)
    w = sparsa.to_sparse(torch.randn(R, K, generator=gen).to(dtype), "nm", n=n, m=m)
    x = torch.randn(T, K, generator=gen).to(dtype)
    b = torch.randn(R, generator=gen).to(dtype) if bias else None
    dense = w.sparse_layout.to_dense().double()
    want = x.double() @ dense.T + (0 if b is None else b.double())
    _close(torch.nn.functional.linear(x, w, b), want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, BF])
@pytest.mark.parametrize("tokens", [1, 6, 48])
def test_runs_the_bitmask_kernels_not_the_dense_weight(monkeypatch, no_dense_weight, dtype, tokens):
    if bm.native_library() is None:
        pytest.skip("no native kernel here")
    ran = []
    for name in ("_stream", "_expand", "_panel", "_amx", "_fused"):

        def spy(lib, kind, x2, *a, _real=getattr(bm, name), **k):
            ran.append(x2.numel() // x2.shape[-1])  # tokens (the stream strategy takes x of any rank)
            return _real(lib, kind, x2, *a, **k)

        monkeypatch.setattr(bm, name, spy)
    torch.manual_seed(0)
    dense = torch.randn(40, 64).to(dtype)
    layout = NM.from_dense(dense, n=2, m=4)
    w = sparsa.to_sparse(dense, "nm", n=2, m=4)
    x = torch.randn(2, tokens // 2 or 1, 64).to(dtype)
    want = x.double() @ layout._scatter(layout.values).double().T
    _close(torch.nn.functional.linear(x, w), want, dtype)
    assert ran[:1] == [x.shape[0] * x.shape[1]]  # (the panel strategy may hand over to expand)


def test_components_share_values_and_cache_the_bits():
    w = NM.from_dense(torch.randn(6, 16), n=2, m=4)
    bits, row_ptr, values = nm_linear.nm_bitmask_components(w)
    assert values.data_ptr() == w.values.data_ptr()
    assert torch.equal(row_ptr, torch.arange(7) * 8)
    again = nm_linear.nm_bitmask_components(w)
    assert again[0] is bits and again[1] is row_ptr
    from sparsa.layouts.bitmask import unpack_bits

    assert torch.equal(unpack_bits(bits, 16), w.mask())


def test_padded_last_group_drops_the_padding():
    # K = 6 with m = 4: the last group has two real positions; 2:4 keeps them both (no padding stored),
    # 3:4 must store one padding position per row, which the bit rows cannot hold
    for n, per_row in ((2, 4), (3, 5)):
        w = NM.from_dense(torch.randn(5, 6), n=n, m=4)
        bits, row_ptr, values = nm_linear.nm_bitmask_components(w)
        assert torch.equal(row_ptr, torch.arange(6) * per_row) and values.numel() == 5 * per_row
        x = torch.randn(3, 6)
        _close(
            bm.bitmask_linear_impl(x, bits, row_ptr, values, None, 5),
            x.double() @ w.to_dense().double().T,
            torch.float32,
        )


def test_in_place_value_update_reaches_the_output():
    torch.manual_seed(1)
    w = sparsa.to_sparse(torch.randn(8, 32), "nm", n=2, m=4)
    x = torch.randn(12, 32)
    before = torch.nn.functional.linear(x, w)
    with torch.no_grad():
        w.sparse_layout.values.mul_(2)
    _close(torch.nn.functional.linear(x, w), 2 * before, torch.float32)


def test_backward_matches_dense_on_the_pattern():
    torch.manual_seed(2)
    lin = torch.nn.Linear(32, 12)
    sparsa.sparsify(lin, [sparsa.Rule(sparsifier=sparsa.sparsifiers.NM(2, 4), layout="nm")])
    assert lin.weight.layout_name == "nm"
    dense = lin.weight.sparse_layout.to_dense().clone().requires_grad_(True)
    bias = lin.bias.detach().clone().requires_grad_(True)
    x = torch.randn(7, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    g = torch.randn(7, 12)
    lin(x).backward(g)
    torch.nn.functional.linear(x2, dense, bias).backward(g)
    _close(x.grad, x2.grad, torch.float32)
    _close(lin.bias.grad, bias.grad, torch.float32)
    gw = lin.weight.grad
    gw = gw.to_dense() if isinstance(gw, sparsa.SparseTensor) else gw
    mask = lin.weight.sparse_layout.mask()
    _close(gw * mask, dense.grad * mask, torch.float32)


def test_a_weight_that_is_not_2d_is_named():
    w = NM.from_dense(torch.randn(2, 3, 8), n=2, m=4)
    with pytest.raises(ValueError, match="2-D"):
        nm_linear.nm_bitmask_components(w)


def test_flatten_carries_the_cached_bit_rows():
    # torch.compile unwraps the weight with __tensor_flatten__: the bit rows travel beside the components,
    # and the layout rebuilt from them holds them in its cache
    w = sparsa.to_sparse(torch.randn(24, 16), "nm", n=2, m=4)
    names, ctx = w.__tensor_flatten__()
    assert "_d_bitmask_bits" in names and "_d_bitmask_row_ptr" in names
    back = type(w).__tensor_unflatten__({n: getattr(w, n) for n in names}, ctx, w.shape, w.stride())
    assert back.sparse_layout.bitmask_rows()[0] is w.sparse_layout.bitmask_rows()[0]
    with pytest.raises(TypeError, match="bitmask_bits"):
        back.sparse_layout.adopt_derived({"bits": torch.zeros(1)})
    # a 3-D N:M tensor has no bit rows: nothing derived, and the flatten still round-trips
    w3 = sparsa.to_sparse(torch.randn(2, 3, 8), "nm", n=2, m=4)
    names3, ctx3 = w3.__tensor_flatten__()
    assert not any(n.startswith("_d_") for n in names3)
    back3 = type(w3).__tensor_unflatten__({n: getattr(w3, n) for n in names3}, ctx3, w3.shape, w3.stride())
    assert torch.equal(back3.to_dense(), w3.to_dense())


def test_compiled_linear_does_not_rebuild_the_bit_rows():
    # before the bit rows were flattened, every compiled call rebuilt them from the indices (a scatter
    # in the graph) and ran 15-20x slower than eager
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs = []

    def backend(gm, inputs):
        def keep(g, _):
            graphs.append(g)
            return g.forward

        return aot_module_simplified(gm, inputs, fw_compiler=keep)

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 48))
    sparsa.sparsify(m, [sparsa.Rule(sparsifier=sparsa.sparsifiers.NM(2, 4), layout="nm")])
    x = torch.randn(5, 32)
    with torch.no_grad():
        want = m(x)
        got = torch.compile(m, backend=backend, fullgraph=True)(x)
    torch.testing.assert_close(got, want)
    code = "\n".join(g.code for g in graphs)
    assert "bitmask_linear" in code and "scatter" not in code and "arange" not in code, code
