"""sparsa.kernels.adaptive: compaction and the three conv GEMMs vs dense PyTorch, native and fallback."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st

from sparsa.kernels import adaptive as K, loader

BACKENDS = ["native", "fallback"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    if request.param == "fallback":
        monkeypatch.setenv("SPARSA_NO_NATIVE", "1")
    else:
        monkeypatch.delenv("SPARSA_NO_NATIVE", raising=False)
        assert K.native_available(), "native adaptive kernels failed to build"
    return request.param


def _act(N, C, H, W, sparsity, channels_last, seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(N, C, H, W, generator=g)
    if sparsity > 0:
        z = z - torch.quantile(z.flatten(), sparsity)
    if channels_last:
        z = z.contiguous(memory_format=torch.channels_last)
    return z


conv_cases = st.tuples(
    st.integers(1, 3),
    st.integers(1, 70),
    st.integers(1, 7),
    st.integers(1, 7),  # N C H W
    st.sampled_from([8, 16, 24, 72]),
    st.sampled_from([1, 2, 3]),  # O k
    st.sampled_from([1, 2]),
    st.integers(0, 2),
    st.sampled_from([1, 2]),  # stride pad dil
    st.sampled_from([0.0, 0.5, 0.9]),
    st.booleans(),
    st.sampled_from([8, 16, 64]),
    st.integers(0, 99),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=conv_cases)
def test_compact_and_conv_ops_match_dense(backend, case):
    N, C, H, W, O, k, s, p, d, sp, cl, slc, seed = case
    d = d if k > 1 else 1  # same conv; oneDNN segfaults on some 1x1 dilated strided cases (adaptive._conv_args)
    if H + 2 * p < d * (k - 1) + 1 or W + 2 * p < d * (k - 1) + 1:
        return
    x = _act(N, C, H, W, sp, cl, seed)
    w = torch.randn(O, C, k, k, generator=torch.Generator().manual_seed(seed + 1))
    b = torch.randn(O)
    geo = K.geometry(x.shape, w.shape, (s, s), (p, p), (d, d), slc)
    cnt, idx, val = K.compact(x, slc)
    a = x.relu()
    assert int(cnt.sum()) == int((a != 0).sum())
    assert torch.equal(K.densify(cnt, idx, val, geo), a)
    wt = w.permute(2, 3, 1, 0).contiguous()
    ref = F.conv2d(a, w, b, stride=s, padding=p, dilation=d)
    y = K.conv_fwd(cnt, idx, val, wt, b, geo)
    torch.testing.assert_close(y, ref.permute(0, 2, 3, 1), atol=1e-4, rtol=1e-4)
    dy = torch.randn(ref.shape).permute(0, 2, 3, 1).contiguous()
    dyn = dy.permute(0, 3, 1, 2)
    dw = K.conv_wgrad(cnt, idx, val, dy, geo)
    rdw = torch.nn.grad.conv2d_weight(a, w.shape, dyn, stride=s, padding=p, dilation=d)
    torch.testing.assert_close(dw, rdw.permute(2, 3, 1, 0), atol=1e-3, rtol=1e-4)
    dx = K.conv_igrad(cnt, idx, val, dy, wt, geo, cl)
    rdx = torch.nn.grad.conv2d_input(x.shape, w, dyn, stride=s, padding=p, dilation=d) * (x > 0)
    torch.testing.assert_close(dx, rdx, atol=1e-4, rtol=1e-4)
    assert dx.is_contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)


def test_compact_layout_is_sorted_per_slice(backend):
    x = _act(2, 20, 3, 3, 0.5, False, 0)
    cnt, idx, val = K.compact(x, 8)
    C, S = 20, 3
    for q in range(2 * 3 * 3):
        n, rem = divmod(q, 9)
        h, w = divmod(rem, 3)
        for s in range(S):
            c = int(cnt[q * S + s])
            ids = idx[q * C + s * 8 : q * C + s * 8 + c].tolist()
            want = [ch for ch in range(s * 8, min(C, s * 8 + 8)) if x[n, ch, h, w] > 0]
            assert ids == want
            assert torch.equal(val[q * C + s * 8 : q * C + s * 8 + c], x[n, want, h, w])


def test_matrix_view_strides(backend):
    # a [P, K] matrix seen as [1, K, P, 1] (what relu_linear does)
    x = torch.randn(9, 33)
    cnt, idx, val = K.compact(x.t().unsqueeze(0).unsqueeze(-1), 16)
    geo = [1, 33, 9, 1, 8, 1, 1, 9, 1, 1, 1, 0, 0, 1, 1, 16]
    assert torch.equal(K.densify(cnt, idx, val, geo)[0, :, :, 0].t(), x.relu())


def test_empty_and_all_zero_inputs(backend):
    x = -torch.rand(2, 8, 4, 4)  # all negative: relu is all zero
    w = torch.randn(16, 8, 3, 3)
    geo = K.geometry(x.shape, w.shape, (1, 1), (1, 1), (1, 1), 64)
    cnt, idx, val = K.compact(x, 64)
    assert int(cnt.sum()) == 0
    b = torch.randn(16)
    y = K.conv_fwd(cnt, idx, val, w.permute(2, 3, 1, 0).contiguous(), b, geo)
    torch.testing.assert_close(y, b.expand_as(y))
    dy = torch.randn(2, 4, 4, 16)
    assert torch.count_nonzero(K.conv_wgrad(cnt, idx, val, dy, geo)) == 0
    assert torch.count_nonzero(K.conv_igrad(cnt, idx, val, dy, w.permute(2, 3, 1, 0).contiguous(), geo, False)) == 0


def test_geometry_rejects_mismatched_channels():
    with pytest.raises(ValueError, match="input channels"):
        K.geometry((1, 3, 4, 4), (8, 4, 3, 3), (1, 1), (1, 1), (1, 1))


def test_fake_impls_trace_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 16, 5, 5)
        cnt, idx, val = K.compact(x, 8)
        geo = K.geometry(x.shape, (24, 16, 3, 3), (2, 2), (1, 1), (1, 1), 8)
        y = K.conv_fwd(cnt, idx, val, torch.empty(3, 3, 16, 24), None, geo)
        assert tuple(y.shape) == (2, 3, 3, 24)
        assert tuple(K.conv_wgrad(cnt, idx, val, y, geo).shape) == (3, 3, 16, 24)
        assert tuple(K.conv_igrad(cnt, idx, val, y, torch.empty(3, 3, 16, 24), geo, True).shape) == (2, 16, 5, 5)


s1_cases = st.tuples(
    st.integers(1, 3),
    st.integers(1, 70),
    st.integers(1, 9),
    st.integers(1, 9),  # N C H W
    st.sampled_from([8, 24, 72]),
    st.sampled_from([(1, 1), (3, 3), (1, 3), (2, 2)]),  # O (KH, KW)
    st.integers(0, 2),
    st.sampled_from([1, 2]),
    st.sampled_from([0.0, 0.6, 0.95]),  # pad dil sparsity
    st.booleans(),
    st.sampled_from([8, 64]),
    st.integers(0, 99),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=s1_cases)
def test_conv_bwd_stride1_matches_dense(backend, case):
    # stride 1 runs the per-channel backward kernels (csrc/adaptive_bwd_s1.cpp) with a padded dY
    N, C, H, W, O, (kh, kw), p, d, sp, cl, slc, seed = case
    if H + 2 * p < d * (kh - 1) + 1 or W + 2 * p < d * (kw - 1) + 1:
        return
    x = _act(N, C, H, W, sp, cl, seed)
    w = torch.randn(O, C, kh, kw, generator=torch.Generator().manual_seed(seed + 1))
    geo = K.geometry(x.shape, w.shape, (1, 1), (p, p), (d, d), slc)
    cnt, idx, val = K.compact(x, slc)
    a = x.relu()
    wt = w.permute(2, 3, 1, 0).contiguous()
    ref = F.conv2d(a, w, stride=1, padding=p, dilation=d)
    torch.testing.assert_close(K.conv_fwd(cnt, idx, val, wt, None, geo), ref.permute(0, 2, 3, 1), atol=1e-4, rtol=1e-4)
    dyn = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 2))
    dy = dyn.permute(0, 2, 3, 1).contiguous()
    dx, dwt = K.conv_bwd(cnt, idx, val, dy, wt, geo, cl)
    rdw = torch.nn.grad.conv2d_weight(a, w.shape, dyn, stride=1, padding=p, dilation=d)
    rdx = torch.nn.grad.conv2d_input(x.shape, w, dyn, stride=1, padding=p, dilation=d) * (x > 0)
    torch.testing.assert_close(dwt, rdw.permute(2, 3, 1, 0), atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(dx, rdx, atol=1e-4, rtol=1e-4)
    assert dx.is_contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)


packed_cases = st.tuples(
    st.integers(1, 3),
    st.integers(1, 70),
    st.integers(1, 9),
    st.integers(1, 9),  # N C H W
    st.sampled_from([8, 24, 72, 128]),
    st.sampled_from([(1, 1), (3, 3), (1, 3), (2, 2)]),  # O (KH, KW)
    st.integers(0, 2),
    st.sampled_from([1, 2]),
    st.sampled_from([0.0, 0.6, 0.95]),  # pad dil sparsity
    st.booleans(),
    st.booleans(),
    st.sampled_from([8, 128]),
    st.integers(0, 99),
)  # cl, weight cl, slice


@settings(max_examples=30, deadline=None)
@given(case=packed_cases)
def test_packed_weight_kernels_match_dense(case):
    # the training-step path of relu_conv2d: weights packed once (any memory format), the forward
    # from the pack, both stride-1 gradients with dY padding and the [O, C, KH, KW] layout in-kernel
    N, C, H, W, O, (kh, kw), p, d, sp, cl, wcl, slc, seed = case
    if H + 2 * p < d * (kh - 1) + 1 or W + 2 * p < d * (kw - 1) + 1:
        return
    if not loader.native_enabled():
        pytest.skip("SPARSA_NO_NATIVE is set; the packed path is native-only")
    assert K.native_available(), "native adaptive kernels failed to build"
    x = _act(N, C, H, W, sp, cl, seed)
    w = torch.randn(O, C, kh, kw, generator=torch.Generator().manual_seed(seed + 1))
    if wcl:
        w = w.contiguous(memory_format=torch.channels_last)
    b = torch.randn(O)
    geo = K.geometry(x.shape, w.shape, (1, 1), (p, p), (d, d), slc)
    cnt, idx, val = K.compact(x, slc)
    a = x.relu()
    wf, wc = K.packed_weight(w)
    assert K.packed_weight(w)[0] is wf  # cached while the weight is unchanged
    ref = F.conv2d(a, w, b, stride=1, padding=p, dilation=d)
    y = K.conv_fwd_packed(cnt, idx, val, wf, b, geo, 1)
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
    dyn = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 2))
    dy = dyn.permute(0, 2, 3, 1).contiguous()
    rdw = torch.nn.grad.conv2d_weight(a, w.shape, dyn, stride=1, padding=p, dilation=d)
    rdx = torch.nn.grad.conv2d_input(x.shape, w, dyn, stride=1, padding=p, dilation=d) * (x > 0)
    for need_dx, need_dw in ((True, True), (True, False), (False, True)):
        dx, dw = K.conv_bwd_packed(cnt, idx, val, dy, wc, geo, cl, need_dx, need_dw, w.stride())
        if need_dx:
            torch.testing.assert_close(dx, rdx, atol=1e-4, rtol=1e-4)
            assert dx.is_contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)
        else:
            assert dx is None
        if need_dw:
            torch.testing.assert_close(dw, rdw, atol=1e-3, rtol=1e-4)
            assert dw.stride() == w.stride()
        else:
            assert dw is None
    with torch.no_grad():
        w.mul_(2.0)  # a new version: re-packed
    wf2, wc2 = K.packed_weight(w)
    assert wf2 is not wf
    torch.testing.assert_close(
        K.conv_fwd_packed(cnt, idx, val, wf2, None, geo, 0),
        F.conv2d(a, w, None, stride=1, padding=p, dilation=d).permute(0, 2, 3, 1),
        atol=1e-4,
        rtol=1e-4,
    )


@pytest.mark.parametrize(
    "shape,O,k,d,threads",
    [
        ((2, 40, 16, 16), 64, 3, 1, 2),  # several tiles; the block-major input gradient; a partial channel chunk
        ((3, 24, 17, 13), 96, 3, 2, 3),  # dilation, odd sizes, three threads
        ((16, 64, 4, 4), 128, 3, 1, 2),  # one tile over all images (plain-layout input gradient)
        ((2, 21, 9, 11), 40, 1, 1, 2),  # 1x1: 64-wide weight-gradient blocks, a partial last block
    ],
)
def test_packed_backward_paths_match_dense(shape, O, k, d, threads):
    # the paths of the stride-1 backward chosen by geometry: input gradient over the block-major dY
    # or the plain padded dY; weight gradient written straight into [O, C, KH, KW] by the tasks
    # (contiguous weight) or through the [KH, KW, C, O] scratch (channels_last weight)
    if not loader.native_enabled():
        pytest.skip("SPARSA_NO_NATIVE is set; the packed path is native-only")
    N, C, H, W = shape
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for sp, wcl in ((0.75, False), (0.9, True), (1.0, False)):
            x = _act(N, C, H, W, sp, True, 7)
            w = torch.randn(O, C, k, k, generator=torch.Generator().manual_seed(8))
            if wcl:
                w = w.contiguous(memory_format=torch.channels_last)
            p = d * (k // 2)
            geo = K.geometry(x.shape, w.shape, (1, 1), (p, p), (d, d), 128)
            cnt, idx, val = K.compact(x, 128)
            a = x.relu()
            _, wc = K.packed_weight(w)
            dyn = torch.randn(N, O, H, W, generator=torch.Generator().manual_seed(9))
            dy = dyn.permute(0, 2, 3, 1).contiguous()
            rdw = torch.nn.grad.conv2d_weight(a, w.shape, dyn, stride=1, padding=p, dilation=d)
            rdx = torch.nn.grad.conv2d_input(x.shape, w, dyn, stride=1, padding=p, dilation=d) * (x > 0)
            dx, dw = K.conv_bwd_packed(cnt, idx, val, dy, wc, geo, True, True, True, w.stride())
            torch.testing.assert_close(dx, rdx, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(dw, rdw, atol=1e-3, rtol=1e-4)
            assert dw.stride() == w.stride()
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize(
    "C,O,sp",
    [
        (96, 64, 0.1),
        (96, 64, 0.8),
        (40, 48, 0.3),
        (24, 16, 0.0),
        (72, 32, 0.5),
        (16, 128, 0.6),
        (32, 8, 0.2),
        (40, 24, 0.4),
        (200, 80, 0.2),
    ],
)
def test_forward_isa_paths_match_dense(monkeypatch, isa, C, O, sp):
    # AVX-512 lists for 16-wide output blocks (one or two accumulator sets: lists >= 32 and shorter),
    # the AVX2 lists for the rest and whenever SPARSA_NO_AVX512 is set
    if not loader.native_enabled():
        pytest.skip("SPARSA_NO_NATIVE is set; the packed path is native-only")
    assert K.native_available(), "native adaptive kernels failed to build"
    monkeypatch.setenv("SPARSA_NO_AVX512", "1" if isa == "avx2" else "0")
    x = _act(2, C, 7, 9, sp, True, C + O)
    w = torch.randn(O, C, 3, 3, generator=torch.Generator().manual_seed(O))
    b = torch.randn(O)
    for slc in (128, 32):
        geo = K.geometry(x.shape, w.shape, (1, 1), (1, 1), (1, 1), slc)
        cnt, idx, val = K.compact(x, slc)
        wf, _ = K.packed_weight(w)
        prev = torch.get_num_threads()
        try:
            for threads in (1, 2):
                torch.set_num_threads(threads)
                y = K.conv_fwd_packed(cnt, idx, val, wf, b, geo, 1)
                # sums of up to 9 * 200 products of magnitude ~1: absolute rounding ~1e-4
                torch.testing.assert_close(y, F.conv2d(x.relu(), w, b, padding=1), atol=1e-3, rtol=1e-4)
        finally:
            torch.set_num_threads(prev)
