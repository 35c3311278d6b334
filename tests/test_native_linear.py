"""RowGroup / SlicedELL layouts and their native linear kernels, against the dense reference."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st

import sparsa
from sparsa.kernels import row_group as rg_kernels
from sparsa.kernels import sliced_ell as se_kernels
from sparsa.layouts import RowGroup, SlicedELL, row_group_mask
from sparsa.layouts.row_group import GROUP_SIZES

PATHS = ["native", "fallback"]


@pytest.fixture
def path(request, monkeypatch):
    if request.param == "fallback":
        monkeypatch.setenv("SPARSA_NO_NATIVE", "1")
        assert rg_kernels.native_library() is None and se_kernels.native_library() is None
    else:
        monkeypatch.delenv("SPARSA_NO_NATIVE", raising=False)
        assert rg_kernels.native_library() is not None, "native row_group kernel failed to build"
        assert se_kernels.native_library() is not None, "native sliced_ell kernel failed to build"
    return request.param


@pytest.fixture
def threads():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def _close(y, ref):
    scale = max(1.0, float(ref.abs().max())) if ref.numel() else 1.0
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * scale)


def _input(shape_lead, K, noncontig, gen):
    if noncontig:  # a transposed view: same logical values, strided storage
        return torch.randn(K, *shape_lead, generator=gen).movedim(0, -1)
    return torch.randn(*shape_lead, K, generator=gen)


def _layout(kind, w, sparsity, group):
    if kind == "row_group":
        return sparsa.to_sparse(w, "row_group", sparsity=sparsity, group=group)
    return sparsa.to_sparse(w, "sliced_ell", sparsity=sparsity)


# ---------------------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("kind", ["row_group", "sliced_ell"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    T=st.integers(1, 40),
    R=st.integers(1, 70),
    K=st.integers(1, 90),
    group=st.sampled_from(GROUP_SIZES),
    sparsity=st.floats(0.0, 0.97),
    bias=st.booleans(),
    three_d=st.booleans(),
    noncontig=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_forward_matches_dense(path, kind, T, R, K, group, sparsity, bias, three_d, noncontig, seed):
    gen = torch.Generator().manual_seed(seed)
    w = _layout(kind, torch.randn(R, K, generator=gen), sparsity, group)
    lead = (2, -(-T // 2)) if three_d else (T,)
    x = _input(lead, K, noncontig, gen)
    b = torch.randn(R, generator=gen) if bias else None
    y = F.linear(x, w, b)
    assert y.shape == (*lead, R) and y.dtype == torch.float32
    _close(y, F.linear(x, w.to_dense(), b))
    assert sparsa.fallback_counts() == {}


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("group", GROUP_SIZES)
@pytest.mark.parametrize("T", [1, 2, 5, 7, 13, 31, 33, 70])
def test_row_group_token_remainders(path, group, T):
    gen = torch.Generator().manual_seed(T * 100 + group)
    w = torch.randn(3 * group + 1, 37, generator=gen)  # last group partial
    rg = RowGroup.from_dense(w, group=group, sparsity=0.6)
    x, b = torch.randn(T, 37, generator=gen), torch.randn(w.shape[0], generator=gen)
    _close(rg_kernels.row_group_linear(x, rg.columns, rg.values, b, w.shape[0]), F.linear(x, rg.to_dense(), b))


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("nthreads", [1, 2])
@pytest.mark.parametrize("kind", ["row_group", "sliced_ell"])
def test_large_in_features_and_threads(path, nthreads, kind, threads):
    # K > 1536 exercises the column blocking of the row-group kernel; 2 threads the parallel split
    torch.set_num_threads(nthreads)
    gen = torch.Generator().manual_seed(nthreads)
    w = _layout(kind, torch.randn(67, 1700, generator=gen), 0.8, 16)
    for T in (1, 3, 45):
        x, b = torch.randn(T, 1700, generator=gen), torch.randn(67, generator=gen)
        _close(F.linear(x, w, b), F.linear(x, w.to_dense(), b))


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("group", GROUP_SIZES)
@pytest.mark.parametrize("permute", [False, True])
def test_row_group_native_isa_paths_large_k(isa, group, permute, threads, monkeypatch):
    # both tile sets of the native kernel (AVX-512 when the CPU has it, else both runs take AVX2), several
    # column blocks (K=2500), partial token panels and a partial last group, 1 and 2 threads
    if isa == "avx2":
        monkeypatch.setenv("SPARSA_NO_AVX512", "1")
    else:
        monkeypatch.delenv("SPARSA_NO_AVX512", raising=False)
    monkeypatch.delenv("SPARSA_NO_NATIVE", raising=False)
    assert rg_kernels.native_library() is not None
    gen = torch.Generator().manual_seed(group + 7 * permute)
    w = torch.randn(3 * group + 5, 2500, generator=gen)
    rg = RowGroup.from_dense(w, group=group, sparsity=0.7, permute=permute)
    b = torch.randn(w.shape[0], generator=gen)
    for nthreads in (1, 2):
        torch.set_num_threads(nthreads)
        for T in (1, 9, 50):
            x = torch.randn(T, 2500, generator=gen)
            y = rg_kernels.row_group_linear_impl(x, rg.columns, rg.values, b, w.shape[0], rg.row_perm)
            _close(y, F.linear(x, rg.to_dense(), b))


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_empty_tokens(path):
    w = sparsa.to_sparse(torch.randn(8, 5), "row_group", sparsity=0.5, group=4)
    assert F.linear(torch.randn(0, 5), w).shape == (0, 8)
    e = sparsa.to_sparse(torch.randn(8, 5), "sliced_ell", sparsity=0.5)
    assert F.linear(torch.randn(3, 0, 5), e).shape == (3, 0, 8)


# ---------------------------------------------------------------------------------------------- backward
@pytest.mark.parametrize(
    "kind,sparsity", [("row_group", 0.5), ("row_group", 0.9), ("sliced_ell", 0.5), ("sliced_ell", 0.98)]
)
def test_gradcheck_float64(kind, sparsity):
    gen = torch.Generator().manual_seed(0)
    wd = torch.randn(9, 13, generator=gen, dtype=torch.float64)
    mask = (
        row_group_mask(wd, sparsity, 4) if kind == "row_group" else SlicedELL.from_dense(wd, sparsity=sparsity).mask()
    )
    params = {"group": 4} if kind == "row_group" else {}
    x = torch.randn(2, 2, 13, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(9, generator=gen, dtype=torch.float64, requires_grad=True)
    wd.requires_grad_()

    def fn(x, wd, b):
        return F.linear(x, sparsa.to_sparse(wd, kind, mask=mask, **params), b)

    assert torch.autograd.gradcheck(fn, (x, wd, b), fast_mode=True)
    assert sparsa.fallback_counts() == {}


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize(
    "kind,sparsity",
    [("row_group", 0.5), ("row_group", 0.92), ("sliced_ell", 0.6), ("sliced_ell", 0.93), ("sliced_ell", 0.99)],
)
@pytest.mark.parametrize("needs", ["all", "x", "w"])
def test_backward_matches_dense_fp32(path, kind, sparsity, needs):
    gen = torch.Generator().manual_seed(1)
    wd = torch.randn(40, 64, generator=gen).requires_grad_(needs in ("all", "w"))
    w = _layout(kind, wd, sparsity, 8)
    x = torch.randn(3, 11, 64, generator=gen).requires_grad_(needs in ("all", "x"))
    b = torch.randn(40, generator=gen).requires_grad_(needs == "all")
    g = torch.randn(3, 11, 40, generator=gen)
    F.linear(x, w, b).backward(g)
    wr = w.to_dense().detach().requires_grad_()
    xr, br = x.detach().requires_grad_(), b.detach().requires_grad_()
    F.linear(xr, wr, br).backward(g)
    if x.requires_grad:
        _close(x.grad, xr.grad)
    if wd.requires_grad:
        _close(wd.grad, wr.grad * w.pattern())
    if b.requires_grad:
        _close(b.grad, br.grad)


def test_backward_only_computes_what_is_needed():
    w = sparsa.to_sparse(torch.randn(8, 6), "row_group", sparsity=0.5, group=4)

    class Ctx:
        def save_for_backward(self, *t):
            self.saved_tensors = t

    ctx = Ctx()
    x = torch.randn(3, 6)
    y = sparsa.ops.native_linear.RowGroupLinear.forward(ctx, x, w._layout, None)
    ctx.needs_input_grad = (True, False, False)
    gx, gw, gb = sparsa.ops.native_linear.RowGroupLinear.backward(ctx, torch.ones_like(y))
    assert gw is None and gb is None and gx.shape == x.shape


# ---------------------------------------------------------------------------------------------- compile
@pytest.mark.parametrize("kind", ["row_group", "sliced_ell"])
def test_torch_compile_eager_backend(kind):
    torch._dynamo.reset()
    w = _layout(kind, torch.randn(24, 16), 0.75, 8)
    b = torch.randn(24)

    def fn(x):
        return F.linear(x, w, b).relu()

    x = torch.randn(5, 16)
    _close(torch.compile(fn, backend="eager")(x), F.linear(x, w.to_dense(), b).relu())


def test_custom_ops_have_fake_impls():
    from torch._subclasses.fake_tensor import FakeTensorMode

    rg = RowGroup.from_dense(torch.randn(20, 12), group=8, sparsity=0.5)
    e = SlicedELL.from_dense(torch.randn(20, 12), sparsity=0.5)
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(2, 3, 12)
        assert torch.ops.sparsa.row_group_linear(x, rg.columns, rg.values, None, 20).shape == (2, 3, 20)
        assert torch.ops.sparsa.sliced_ell_linear(x, e.slice_ptr, e.columns, e.values, None, 20).shape == (2, 3, 20)


# ---------------------------------------------------------------------------------------------- layouts
@settings(max_examples=30, deadline=None)
@given(
    R=st.integers(1, 40),
    K=st.integers(1, 40),
    group=st.sampled_from(GROUP_SIZES),
    sparsity=st.floats(0, 0.95),
    seed=st.integers(0, 2**16),
)
def test_row_group_layout_roundtrip(R, K, group, sparsity, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(R, K, generator=gen)
    rg = RowGroup.from_dense(w, group=group, sparsity=sparsity)
    rg.validate()
    m = rg.mask()
    assert torch.equal(m, row_group_mask(w, sparsity, group))
    assert torch.equal(rg.to_dense(), w * m)
    assert rg.nnz == int(m.sum()) == rg.kept * R
    again = RowGroup.from_dense(w, mask=m, group=group)
    assert torch.equal(again.columns, rg.columns) and torch.equal(again.values, rg.values)
    back = RowGroup.from_components(rg.components(), rg.shape, **rg.params())
    assert torch.equal(back.to_dense(), rg.to_dense())
    w2 = torch.randn(R, K, generator=gen)
    assert torch.equal(rg.refill(w2).to_dense(), w2 * m)


def test_row_group_mask_with_uneven_groups_pads_with_zeros():
    w = torch.randn(8, 6)
    mask = torch.zeros(8, 6, dtype=torch.bool)
    mask[:4, [0, 2, 5]] = True  # group 0 keeps 3 columns
    mask[4:, [1]] = True  # group 1 keeps 1: padded to 3 with zero values
    rg = RowGroup.from_dense(w, mask=mask, group=4)
    assert rg.kept == 3
    assert torch.equal(rg.to_dense(), w * mask)
    assert rg.columns[1].tolist() == [0, 1, 2]


def test_row_group_chooses_columns_by_group_norm():
    w = torch.zeros(4, 5)
    w[:, 3] = 1.0
    w[0, 1] = 1.5  # one big entry loses to a column that is large over the whole group
    rg = RowGroup.from_dense(w, group=4, sparsity=0.8)
    assert rg.columns.tolist() == [[3]]


def test_row_group_errors():
    w = torch.randn(8, 6)
    with pytest.raises(ValueError, match="sparsity"):
        RowGroup.from_dense(w)
    with pytest.raises(ValueError, match="group"):
        RowGroup.from_dense(w, group=5, sparsity=0.5)
    with pytest.raises(TypeError, match="group"):
        RowGroup.from_dense(w, group=4.0, sparsity=0.5)
    with pytest.raises(ValueError, match="sparsity"):
        RowGroup.from_dense(w, sparsity=1.0)
    bad = torch.zeros(8, 6, dtype=torch.bool)
    bad[0, 0] = True
    with pytest.raises(ValueError, match="group-shared"):
        RowGroup.from_dense(w, mask=bad, group=4)
    with pytest.raises(ValueError, match="mask"):
        RowGroup.from_dense(w, mask=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="2-D"):
        RowGroup.from_dense(torch.randn(2, 3, 4), sparsity=0.5)
    with pytest.raises(TypeError):
        RowGroup.from_dense(w.long(), sparsity=0.5)
    rg = RowGroup.from_dense(w, group=4, sparsity=0.5)
    with pytest.raises(ValueError, match="increasing"):
        RowGroup(rg.columns.flip(1).contiguous(), rg.values, (8, 6))
    with pytest.raises(ValueError, match="columns must lie"):
        RowGroup(rg.columns + 6, rg.values, (8, 6))
    with pytest.raises(ValueError, match="int32"):
        RowGroup(rg.columns.long(), rg.values, (8, 6))
    with pytest.raises(ValueError, match="expected columns"):
        RowGroup(rg.columns, rg.values, (16, 6))
    with pytest.raises(ValueError, match="last dimension"):
        F.linear(torch.randn(2, 7), sparsa.SparseTensor(rg))


@settings(max_examples=30, deadline=None)
@given(R=st.integers(1, 40), K=st.integers(1, 40), sparsity=st.floats(0, 0.99), seed=st.integers(0, 2**16))
def test_sliced_ell_layout_roundtrip(R, K, sparsity, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(R, K, generator=gen)
    e = SlicedELL.from_dense(w, sparsity=sparsity)
    e.validate()
    m = e.mask()
    assert e.nnz == int(m.sum()) == int(round(R * K * (1 - sparsity)))
    assert torch.equal(e.to_dense(), w * m)
    assert torch.equal(SlicedELL.from_dense(w * m).mask(), (w * m) != 0)
    back = SlicedELL.from_components(e.components(), e.shape, **e.params())
    assert torch.equal(back.to_dense(), e.to_dense())
    w2 = torch.randn(R, K, generator=gen)
    assert torch.equal(e.refill(w2).to_dense(), w2 * m)


def test_sliced_ell_keeps_explicit_zeros_of_the_mask():
    w = torch.zeros(3, 4)
    mask = torch.tensor([[1, 0, 0, 1], [0, 0, 0, 0], [0, 1, 0, 0]], dtype=torch.bool)
    e = SlicedELL.from_dense(w, mask=mask)
    assert e.nnz == 3 and torch.equal(e.mask(), mask)


def test_sliced_ell_errors():
    w = torch.randn(5, 6)
    e = SlicedELL.from_dense(w, sparsity=0.5)
    with pytest.raises(ValueError, match="slice_ptr"):
        SlicedELL(e.slice_ptr[:-1], e.columns, e.values, e.row_nnz, (5, 6))
    with pytest.raises(ValueError, match="columns must lie"):
        SlicedELL(e.slice_ptr, e.columns + 6, e.values, e.row_nnz, (5, 6))
    with pytest.raises(ValueError, match="row_nnz"):
        SlicedELL(e.slice_ptr, e.columns, e.values, e.row_nnz + 10, (5, 6))
    with pytest.raises(ValueError, match="values"):
        SlicedELL(e.slice_ptr, e.columns, e.values[:-1], e.row_nnz, (5, 6))
    with pytest.raises(ValueError, match="mask"):
        SlicedELL.from_dense(w, mask=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="not both"):
        SlicedELL.from_dense(w, mask=w != 0, sparsity=0.5)
    with pytest.raises(ValueError, match="2-D"):
        SlicedELL.from_dense(torch.randn(6))
