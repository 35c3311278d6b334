"""sparsa::row_group_mlp_kernel: act(x W1^T + b1) W2^T + b2 with RowGroup weights, fused on AMX tiles."""

import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsa.kernels import row_group as rg
from sparsa.kernels import row_group_mlp as rgm
from sparsa.layouts import RowGroup


def _weights(K, R1, R2, sparsity, group=16, permute=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w1 = RowGroup.from_dense(torch.randn(R1, K, generator=gen), group=group, sparsity=sparsity, permute=permute)
    w2 = RowGroup.from_dense(torch.randn(R2, R1, generator=gen), group=group, sparsity=sparsity, permute=permute)
    return w1, w2, torch.randn(R1, generator=gen), torch.randn(R2, generator=gen)


def _args(x, w1, w2, b1, b2, dtype):
    return (
        x.to(dtype),
        w1.columns,
        w1.values.to(dtype),
        None if b1 is None else b1.to(dtype),
        w1.shape[0],
        w1.row_perm,
        w2.columns,
        w2.values.to(dtype),
        None if b2 is None else b2.to(dtype),
        w2.shape[0],
        w2.row_perm,
    )


def _reference(args, activation="gelu"):
    """float64 products of the (already rounded) operands; the hidden activation rounded to x's dtype as the
    two-product path rounds it."""
    x, c1, v1, b1, r1, p1, c2, v2, b2, r2, p2 = args
    w1 = RowGroup(c1, v1, (r1, x.shape[-1]), p1, validate=False).to_dense().double()
    w2 = RowGroup(c2, v2, (r2, r1), p2, validate=False).to_dense().double()
    h = x.double() @ w1.T + (0 if b1 is None else b1.double())
    h = (F.gelu(h) if activation == "gelu" else h).to(x.dtype).double()
    return h @ w2.T + (0 if b2 is None else b2.double())


def _close(y, want, dtype):
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    scale = float(want.abs().max()) + 1e-6
    assert y.dtype == dtype and y.shape == want.shape
    assert float((y.double() - want).abs().max()) <= tol * scale


@pytest.fixture
def threads():
    old = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(old)


class TestAgainstDense:
    """The op against the float64 product of its operands, on every path this machine runs."""

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("T", [1, 5, 16, 33, 77, 128])
    @pytest.mark.parametrize("activation", ["gelu", "none"])
    def test_shapes_and_token_counts(self, dtype, T, activation, threads):
        threads(2)
        w1, w2, b1, b2 = _weights(96, 200, 72, 0.75)  # 200 hidden rows: a partial last group
        x = torch.randn(T, 96, generator=torch.Generator().manual_seed(T))
        args = _args(x, w1, w2, b1, b2, dtype)
        _close(rgm.row_group_mlp_kernel(*args, activation), _reference(args, activation), dtype)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_leading_dimensions_and_no_bias(self, dtype):
        w1, w2, _, _ = _weights(64, 128, 48, 0.5)
        x = torch.randn(3, 20, 64)
        args = _args(x, w1, w2, None, None, dtype)
        y = rgm.row_group_mlp_kernel(*args)
        assert y.shape == (3, 20, 48)
        _close(y.reshape(60, 48), _reference(args).reshape(60, 48), dtype)

    @pytest.mark.parametrize("group", [4, 8, 32])
    def test_other_group_sizes_take_the_two_products(self, group):
        w1, w2, b1, b2 = _weights(64, 96, 40, 0.5, group=group)
        args = _args(torch.randn(64, 64), w1, w2, b1, b2, torch.bfloat16)
        assert rgm.native_mlp(*args, 1) is None
        _close(rgm.row_group_mlp_kernel(*args), _reference(args), torch.bfloat16)

    def test_permuted_rows_take_the_two_products(self):
        w1, w2, b1, b2 = _weights(64, 96, 48, 0.5, permute=True)
        assert not rgm._is_identity(w1.row_perm)
        args = _args(torch.randn(64, 64), w1, w2, b1, b2, torch.bfloat16)
        assert rgm.native_mlp(*args, 1) is None
        _close(rgm.row_group_mlp_kernel(*args), _reference(args), torch.bfloat16)

    def test_pure_pytorch_fallback(self, monkeypatch):
        monkeypatch.setenv("SPARSA_NO_NATIVE", "1")
        w1, w2, b1, b2 = _weights(48, 64, 32, 0.5)
        for dtype in (torch.float32, torch.bfloat16):
            args = _args(torch.randn(40, 48), w1, w2, b1, b2, dtype)
            assert rgm.native_mlp(*args, 1) is None
            _close(rgm.row_group_mlp_kernel(*args), _reference(args), dtype)

    @settings(max_examples=25, deadline=None)
    @given(
        K=st.integers(1, 70),
        R1=st.integers(1, 70),
        R2=st.integers(1, 40),
        T=st.integers(1, 70),
        sparsity=st.sampled_from([0.25, 0.5, 0.75, 0.9]),
        bf16=st.booleans(),
    )
    def test_property(self, K, R1, R2, T, sparsity, bf16):
        dtype = torch.bfloat16 if bf16 else torch.float32
        w1, w2, b1, b2 = _weights(K, R1, R2, sparsity, seed=K * 7 + R1)
        args = _args(torch.randn(T, K, generator=torch.Generator().manual_seed(T)), w1, w2, b1, b2, dtype)
        _close(rgm.row_group_mlp_kernel(*args), _reference(args), dtype)


def _tile_libs():
    """(name, library) for the fused path's AMX kernel here and its software-tile build, each where it runs."""
    out = []
    if rg.has_amx():
        out.append(("amx", rg.native_library()))
    emu = rg.emulated_amx_library()
    if emu is not None and emu.sparsa_row_group_has_amx():
        out.append(("amx_emulated", emu))
    return out


@pytest.mark.parametrize("tiles", ["amx", "amx_emulated"])
def test_fused_tiles_equal_the_two_products_bit_for_bit(tiles, monkeypatch, threads):
    # the fused path rounds the hidden activation once, as the first product stores it: the same bits as two
    # row_group_linear calls on the same tiles, for partial panels and groups, with and without biases
    monkeypatch.delenv("SPARSA_ISA", raising=False)
    libs = dict(_tile_libs())
    if tiles not in libs:
        why = rg.amx_status() if tiles == "amx" else "the software tiles run inside the AVX-512 kernels"
        pytest.skip(f"{tiles} does not run here: {why}")
    lib = libs[tiles]
    for K, R1, R2, sparsity in ((96, 200, 72, 0.75), (301, 64, 48, 0.5), (64, 96, 16, 0.9)):
        w1, w2, b1, b2 = _weights(K, R1, R2, sparsity, seed=K)
        for T, n in ((16, 1), (45, 1), (64, 2), (128, 2), (200, 2)):
            threads(n)
            for bias in (True, False):
                args = _args(torch.randn(T, K), w1, w2, b1 if bias else None, b2 if bias else None, torch.bfloat16)
                y = rgm.native_mlp(*args, 1, lib=lib)
                assert y is not None, (K, T, n)
                h = rg._native_forward(lib, "bf16", args[0], args[1], args[2], args[3], R1, args[5], 1)
                want = rg._native_forward(lib, "bf16", h, args[6], args[7], args[8], R2, args[10], 0)
                assert torch.equal(y, want), (K, R1, R2, T, n, bias)


def test_fused_path_needs_balanced_panels_and_16_tokens(threads):
    if not rg.has_amx():
        isa = os.environ.get("SPARSA_ISA")
        pytest.skip(f"the AMX tiles do not run here: {rg.amx_status() if isa is None else f'SPARSA_ISA={isa}'}")
    w1, w2, b1, b2 = _weights(64, 96, 32, 0.5)
    threads(2)
    for T, runs in ((8, False), (15, False), (64, True), (96, False), (128, True), (200, True)):
        args = _args(torch.randn(T, 64), w1, w2, b1, b2, torch.bfloat16)
        assert (rgm.native_mlp(*args, 1) is not None) == runs, T


def test_sparsa_isa_below_amx_takes_the_two_products(monkeypatch):
    if rg.native_library() is None:
        pytest.skip("no native kernel here")
    monkeypatch.setenv("SPARSA_ISA", "avx512")
    w1, w2, b1, b2 = _weights(64, 96, 32, 0.5)
    args = _args(torch.randn(64, 64), w1, w2, b1, b2, torch.bfloat16)
    assert rgm.native_mlp(*args, 1) is None
    _close(rgm.row_group_mlp_kernel(*args), _reference(args), torch.bfloat16)


class TestBadInput:
    def setup_method(self):
        self.w1, self.w2, self.b1, self.b2 = _weights(32, 64, 16, 0.5)
        self.args = list(_args(torch.randn(4, 32), self.w1, self.w2, self.b1, self.b2, torch.float32))

    def test_hidden_width_mismatch_names_columns2(self):
        self.args[4] = 40  # out1 smaller than the columns the second weight reads
        with pytest.raises(ValueError, match="columns2 index hidden column"):
            rgm.row_group_mlp_kernel(*self.args)

    def test_out_features_beyond_the_row_slots(self):
        self.args[9] = 999
        with pytest.raises(ValueError, match="out2=999"):
            rgm.row_group_mlp_kernel(*self.args)

    def test_unknown_activation(self):
        with pytest.raises(ValueError, match="activation must be one of"):
            rgm.row_group_mlp_kernel(*self.args, "relu")

    def test_values_must_be_three_dimensional(self):
        self.args[2] = self.args[2].reshape(-1)
        with pytest.raises(ValueError, match="values1 must be"):
            rgm.row_group_mlp_kernel(*self.args)


def test_opcheck():
    w1, w2, b1, b2 = _weights(32, 64, 16, 0.5)
    for dtype in (torch.float32, torch.bfloat16):
        args = _args(torch.randn(40, 32), w1, w2, b1, b2, dtype)
        torch.library.opcheck(torch.ops.sparsa.row_group_mlp_kernel.default, (*args, "gelu"))
