"""The SlicedELL kernel's K-chunked path against a float64 dense reference, fp32 and bf16, native and fallback.

A weight wide and dense enough (``sparsa_sliced_ell_n_chunks``) is walked in chunks of 256 input columns,
so a 32-token panel's chunk stays in L1. ``chunk_bounds`` finds, once per weight, where each row's slots
cross into the next chunk (binary search, exact for sorted rows); the kernel clamps those bounds, so any
bounds still take every slot once, in slot order. The cases here stress what that could get wrong: padding
entries (column 0 after larger columns) with nonzero values, rows whose columns are shuffled or repeated,
rows with no entries, an odd number of rows, token counts that are not multiples of 8, bias and the GELU
epilogue, stale or garbage bounds, and every way the kernel splits the work between threads.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparsa import cpu
from sparsa.kernels import sliced_ell as se
from sparsa.layouts import SlicedELL

BF = torch.bfloat16


@pytest.fixture(params=["native", "fallback"])
def path(request, monkeypatch):
    if request.param == "fallback":
        monkeypatch.setenv("SPARSA_NO_NATIVE", "1")
        assert se.native_library() is None
        return request.param
    monkeypatch.delenv("SPARSA_NO_NATIVE", raising=False)
    if cpu.ISA_LEVELS.index(cpu.hardware_isa()) < cpu.ISA_LEVELS.index("avx2"):
        pytest.skip("this CPU has no avx2/fma: only the fallback runs")
    assert se.native_library() is not None, "native sliced_ell kernel failed to build"
    return request.param


def _layout(R, K, sparsity, gen, shuffle=False, repeat=False, empty_rows=(), dtype=torch.float32):
    """slice_ptr, columns, values (padding entries get nonzero values; optionally each row's slots in a
    random order, or a column repeated) and the dense float64 weight the op computes with."""
    w = torch.randn(R, K, generator=gen, dtype=torch.float64)
    for r in empty_rows:
        w[r] = 0
    lay = SlicedELL.from_dense(w, sparsity=sparsity)
    cols, vals = lay.columns.clone(), torch.randn(lay.values.numel(), generator=gen, dtype=torch.float64)
    sp = lay.slice_ptr.tolist()
    for s in range(len(sp) - 1):
        for h in range(2):
            idx = torch.arange(sp[s] + h, sp[s + 1], 2)
            if shuffle and idx.numel() > 1:
                cols[idx] = cols[idx][torch.randperm(idx.numel(), generator=gen)]
            if repeat and idx.numel() > 2:
                cols[idx[-1]] = cols[idx[0]]
    vals = vals.to(dtype).double()  # exact in the kernel's dtype
    lengths = torch.tensor(sp).diff()
    slice_of = torch.arange(len(sp) - 1).repeat_interleave(lengths)  # entry e of slice s feeds row 2s + e % 2
    rows = 2 * slice_of + (torch.arange(sp[-1]) - torch.tensor(sp[:-1]).repeat_interleave(lengths)) % 2
    dense = torch.zeros(2 * (len(sp) - 1), K, dtype=torch.float64)
    dense.index_put_((rows, cols.long()), vals, accumulate=True)
    return lay.slice_ptr, cols, vals.to(dtype), dense[:R]


def _check(y, ref, scale, dtype):
    tol = 1e-5 if dtype == torch.float32 else 2.0**-7
    err = (y.double() - ref).abs()
    bad = err > tol * (ref.abs() + scale) + 1e-6
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} wrong; max |y - ref| {float(err.max()):.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, BF], ids=["f32", "bf16"])
@pytest.mark.parametrize("T,R,K", [(33, 7, 1100), (64, 130, 2100), (5, 9, 4500), (1, 3, 1500)])
@pytest.mark.parametrize("act", ["none", "gelu"])
def test_chunked_matches_float64(path, dtype, T, R, K, act):
    gen = torch.Generator().manual_seed(T + R + K)
    sp, cols, vals, wd = _layout(R, K, 0.8, gen, shuffle=True, repeat=True, empty_rows=(1,), dtype=dtype)
    x = torch.randn(T, K, generator=gen).to(dtype)
    b = torch.randn(R, generator=gen)
    y = se.sliced_ell_linear(x, sp, cols, vals, b, R, act)
    assert y.dtype == dtype and y.shape == (T, R)
    pre = x.double() @ wd.T + b.double()
    ref = F.gelu(pre) if act == "gelu" else pre
    _check(y, ref, (x.double().abs() @ wd.abs().T + b.double().abs()), dtype)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    T=st.integers(1, 70),
    R=st.integers(1, 24),
    K=st.integers(1025, 3000),
    sparsity=st.sampled_from([0.0, 0.75, 0.97]),
    shuffle=st.booleans(),
    seed=st.integers(0, 999),
)
def test_chunked_property_fp32(path, T, R, K, sparsity, shuffle, seed):
    gen = torch.Generator().manual_seed(seed)
    sp, cols, vals, wd = _layout(R, K, sparsity, gen, shuffle=shuffle)
    x = torch.randn(T, K, generator=gen)
    y = se.sliced_ell_linear(x, sp, cols, vals, None, R)
    _check(y, x.double() @ wd.T, x.double().abs() @ wd.abs().T, torch.float32)


def test_chunked_equals_unchunked_order(path):
    """Sorted rows: the chunked walk adds each row's products in slot order, as one pass would, so fp32
    results equal the fallback's dense float32 product up to summation order only."""
    gen = torch.Generator().manual_seed(7)
    lay = SlicedELL.from_dense(torch.randn(64, 3072, generator=gen), sparsity=0.75)
    x = torch.randn(128, 3072, generator=gen)
    y = se.sliced_ell_linear(x, lay.slice_ptr, lay.columns, lay.values, None, 64)
    torch.testing.assert_close(y, x @ lay.to_dense().T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("T", [1, 40, 100, 300])
@pytest.mark.parametrize("sparsity", [0.85, 0.95])
def test_thread_splits_match(path, threads, T, sparsity):
    """Every way the kernel splits work: one thread; one task per panel (many tokens); and few panels
    split by panels or by rows. The AVX-512 rows take 64-token panels for rows of 128 slots or more (85%
    of 1300 columns: 195), 32-token ones for sparser rows (95%: 65)."""
    gen = torch.Generator().manual_seed(T * 10 + threads)
    sp, cols, vals, wd = _layout(41, 1300, sparsity, gen, shuffle=True)
    x = torch.randn(T, 1300, generator=gen)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = se.sliced_ell_linear(x, sp, cols, vals, None, 41)
    finally:
        torch.set_num_threads(old)
    _check(y, x.double() @ wd.T, x.double().abs() @ wd.abs().T, torch.float32)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, BF], ids=["f32", "bf16"])
@pytest.mark.parametrize("act", ["none", "gelu"])
def test_one_token_path_split_across_threads(path, threads, dtype, act):
    """One token takes the scalar decode path, split by row blocks once the weight has enough entries
    (here ~150k over 517 rows, an odd count: the last slice has one real row)."""
    gen = torch.Generator().manual_seed(threads)
    sp, cols, vals, wd = _layout(517, 1200, 0.75, gen, shuffle=True, dtype=dtype)
    x = torch.randn(1, 1200, generator=gen).to(dtype)
    b = torch.randn(517, generator=gen)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = se.sliced_ell_linear(x, sp, cols, vals, b, 517, act)
    finally:
        torch.set_num_threads(old)
    ref = x.double() @ wd.T + b.double()
    if act == "gelu":
        ref = torch.nn.functional.gelu(ref)
    _check(y, ref, x.double().abs() @ wd.abs().T + b.double().abs(), dtype)


def _native_or_skip():
    if cpu.ISA_LEVELS.index(cpu.hardware_isa()) < cpu.ISA_LEVELS.index("avx2"):
        pytest.skip("this CPU has no avx2/fma: only the fallback runs")
    lib = se.native_library()
    assert lib is not None, "native sliced_ell kernel failed to build"
    return lib


def test_chunk_bounds_are_where_rows_cross_into_the_next_chunk():
    lib = _native_or_skip()
    w = torch.zeros(3, 600)
    w[0, [3, 255, 256, 300, 511, 512, 599]] = 1.0  # chunks [0, 256), [256, 512), [512, 600)
    w[1, [600 - 1 - i for i in range(0, 200, 2)]] = 2.0  # 100 slots, all in the last two chunks
    w[2, :150] = 3.0  # 150 slots (the slice's longest row: 150 slots per row >= 40 per chunk)
    lay = SlicedELL.from_dense(w)
    bounds = se.chunk_bounds(lib, lay.slice_ptr, lay.columns, 600)
    assert bounds is not None and bounds.shape == (2, 2, 2) and bounds.dtype == torch.int32
    # slice 0 = rows 0 and 1: row 0 has 2 slots in chunk 0, 3 in chunk 1; row 1 none below 400
    assert bounds[0, :, 0].tolist() == [2, 5]
    assert bounds[0, :, 1].tolist() == [0, 56]  # columns 400..510 step 2 -> 56 slots below 512
    assert bounds[1, :, 0].tolist() == [150, 150]
    assert se.chunk_bounds(lib, lay.slice_ptr, lay.columns, 600) is bounds  # cached per weight


def test_no_chunks_for_narrow_or_very_sparse_weights():
    lib = _native_or_skip()
    narrow = SlicedELL.from_dense(torch.randn(8, 256))  # one chunk holds every column
    assert se.chunk_bounds(lib, narrow.slice_ptr, narrow.columns, 256) is None
    sparse = SlicedELL.from_dense(torch.randn(8, 3000), sparsity=0.95)  # 150 slots over 12 chunks
    assert se.chunk_bounds(lib, sparse.slice_ptr, sparse.columns, 3000) is None


@pytest.mark.parametrize("dtype", [torch.float32, BF], ids=["f32", "bf16"])
@pytest.mark.parametrize("T", [2, 40, 100, 300])
def test_chunked_equals_one_pass_bitwise(dtype, T):
    """Each row adds its products in slot order whether K is chunked or not, so both give the same bits."""
    lib = _native_or_skip()
    gen = torch.Generator().manual_seed(T)
    lay = SlicedELL.from_dense(torch.randn(70, 1000, generator=gen), sparsity=0.7).to(dtype)
    x = torch.randn(T, 1000, generator=gen).to(dtype)
    assert se.chunk_bounds(lib, lay.slice_ptr, lay.columns, 1000) is not None
    args = (lib, "bf16" if dtype == BF else "f32", x, lay.slice_ptr, lay.columns, lay.values, None, 70, 0)
    assert torch.equal(se._native_forward(*args, chunked=True), se._native_forward(*args, chunked=False))


@pytest.mark.parametrize("kind", ["random", "stale", "extreme"])
def test_any_bounds_give_the_right_result(kind):
    """The kernel clamps every bound into the row's slots, so wrong bounds (columns changed in place after
    they were cached, or garbage) cost speed only: the result is the same bits as without chunks."""
    lib = _native_or_skip()
    gen = torch.Generator().manual_seed(1)
    lay = SlicedELL.from_dense(torch.randn(33, 1100, generator=gen), sparsity=0.6)
    x = torch.randn(50, 1100, generator=gen)
    good = se.chunk_bounds(lib, lay.slice_ptr, lay.columns, 1100)
    assert good is not None
    if kind == "random":
        bad = torch.randint(0, 1000, good.shape, generator=gen, dtype=torch.int32)
    elif kind == "stale":
        bad = good.flip(1).contiguous()  # decreasing bounds
    else:
        bad = torch.full(good.shape, -(2**31), dtype=torch.int32)
        bad[..., 1] = 2**31 - 1
    se._CHUNK_BOUNDS[lay.columns] = (lay.slice_ptr, 1100, bad)
    try:
        args = (lib, "f32", x, lay.slice_ptr, lay.columns, lay.values, None, 33, 0)
        assert torch.equal(se._native_forward(*args), se._native_forward(*args, chunked=False))
    finally:
        del se._CHUNK_BOUNDS[lay.columns]


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("R, T", [(1, 70), (2, 70), (5, 70), (260, 70), (260, 40), (1100, 70)])
def test_few_panels_split_by_slices_or_panels(path, threads, R, T):
    """Few panels (under 4 per thread). Small weights (R <= 260 at 70 tokens): each thread transposes and
    takes its own panels. Large ones (R = 1100: 2.3 MB of weights, over 4x the three panels' 270 KB) or
    fewer panels than threads (40 tokens, 3 threads): each thread takes a range of slices, some of them
    empty when there are fewer slices than threads."""
    gen = torch.Generator().manual_seed(R * 10 + threads)
    sp, cols, vals, wd = _layout(R, 700, 0.5, gen, shuffle=R == 5)
    x = torch.randn(T, 700, generator=gen)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = se.sliced_ell_linear(x, sp, cols, vals, None, R)
    finally:
        torch.set_num_threads(old)
    _check(y, x.double() @ wd.T, x.double().abs() @ wd.abs().T, torch.float32)
