"""The bitmask-operand ("union") kernels and relu_conv2d's union path vs dense PyTorch, native and fallback."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st

from sparsa.adaptive import conv_union, relu_conv2d
from sparsa.kernels import adaptive_union as U

needs_native = pytest.mark.skipif(not U.union_native(), reason="union kernels need AVX-512 and the native build")


@pytest.fixture(params=["native", "fallback"])
def native(request):
    if request.param == "native" and not U.union_native():
        pytest.skip("union kernels need AVX-512 and the native build")
    return request.param == "native"


@pytest.fixture(params=[1, 2])
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


def _act(shape, sparsity, channels_last, seed, clustered=True):
    g = torch.Generator().manual_seed(seed)
    N, C, H, W = shape
    z = torch.randn(N, C, H, W, generator=g)
    if clustered:  # neighbouring pixels share part of their pattern, as real ReLU inputs do
        z = z + torch.randn(N, C, 1, 1, generator=g)
    if sparsity > 0:
        z = z - torch.quantile(z.flatten(), sparsity)
    return z.contiguous(memory_format=torch.channels_last) if channels_last else z


def _bits(mask: torch.Tensor, C: int) -> torch.Tensor:
    """[P, C] bool from the int64 mask words."""
    P, NW = mask.shape
    shifts = torch.arange(64, dtype=torch.int64)
    bits = ((mask.unsqueeze(-1) >> shifts) & 1).bool().reshape(P, NW * 64)
    return bits[:, :C]


# ------------------------------------------------------------------------------------------ operand
@pytest.mark.parametrize("C", [1, 3, 16, 17, 64, 65, 130])
@pytest.mark.parametrize("channels_last", [False, True])
def test_operand_relu_values_mask_and_count(native, C, channels_last):
    x = _act((2, C, 3, 5), 0.5, channels_last, C)
    x[0, 0, 0, 0] = float("nan")
    op = U.union_operand(x, native=native)
    want = torch.where(x > 0, x, torch.zeros(()))
    assert torch.equal(op.nchw(), want)
    assert op.values.is_contiguous() and op.values.shape == (2, 3, 5, C)
    assert op.nnz == int((x > 0).sum())
    if native:
        assert torch.equal(_bits(op.mask, C), (x > 0).permute(0, 2, 3, 1).reshape(-1, C))
        # bits past C stay clear (the kernels OR whole words)
        if C % 64:
            assert int((op.mask[:, -1] >> (C % 64)).abs().sum()) == 0


@pytest.mark.parametrize("channels_last", [False, True])
def test_operand_signed_keeps_negatives_nan_and_inf(native, channels_last):
    x = _act((1, 20, 4, 4), 0.6, channels_last, 3)
    x = torch.where(x < 0, -x, x * 0)  # nonnegative with zeros
    x[0, 1, 1, 1] = -2.0
    x[0, 2, 2, 2] = float("nan")
    x[0, 3, 3, 3] = float("-inf")
    x[0, 4, 0, 0] = -0.0
    op = U.union_operand(x, relu=False, native=native)
    keep = x != 0
    keep[0, 2, 2, 2] = True
    assert op.nnz == int(keep.sum())
    assert torch.equal(
        torch.nan_to_num(op.nchw(), nan=7.0), torch.nan_to_num(torch.where(keep, x, torch.zeros(())), nan=7.0)
    )
    if native:
        assert torch.equal(_bits(op.mask, 20), keep.permute(0, 2, 3, 1).reshape(-1, 20))
        if channels_last:  # dY in channels-last is read in place
            assert op.values.data_ptr() == x.data_ptr()


def test_pixel_group_must_be_1_2_or_4():
    x = _act((1, 16, 4, 4), 0.5, True, 1)
    w = torch.randn(16, 16, 3, 3)
    geo = U.geometry(x.shape, w.shape, (1, 1), (1, 1), (1, 1))
    with pytest.raises(ValueError, match="group must be 1, 2 or 4"):
        U.union_conv_fwd(U.union_operand(x), w, None, geo, group=3)


def test_operand_rejects_bad_input():
    with pytest.raises(ValueError, match="4-D"):
        U.union_operand(torch.randn(3, 4))
    with pytest.raises(ValueError, match="float32"):
        U.union_operand(torch.randn(1, 2, 3, 3, dtype=torch.float64))


# ------------------------------------------------------------------------------------------ kernels
cases = st.tuples(
    st.integers(1, 3),
    st.sampled_from([16, 32, 48, 64, 80, 128, 136]),
    st.integers(1, 9),
    st.integers(1, 9),  # N C H W
    st.sampled_from([16, 32, 48, 64, 96, 128, 40]),
    st.sampled_from([1, 2, 3]),  # O k
    st.sampled_from([1, 2]),
    st.integers(0, 2),
    st.sampled_from([1, 2]),  # stride pad dil
    st.sampled_from([0.0, 0.5, 0.8, 0.97]),
    st.booleans(),
    st.booleans(),
    st.integers(0, 99),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases)
def test_union_convs_match_dense(native, threads, case):
    N, C, H, W, O, k, s, p, d, sp, cl, wcl, seed = case
    d = d if k > 1 else 1  # same conv; oneDNN segfaults on some 1x1 dilated strided cases (adaptive._conv_args)
    if H + 2 * p < d * (k - 1) + 1 or W + 2 * p < d * (k - 1) + 1:
        return
    x = _act((N, C, H, W), sp, cl, seed)
    w = torch.randn(O, C, k, k, generator=torch.Generator().manual_seed(seed + 1))
    if wcl:
        w = w.contiguous(memory_format=torch.channels_last)
    b = torch.randn(O)
    geo = U.geometry(x.shape, w.shape, (s, s), (p, p), (d, d))
    op = U.union_operand(x, native=native)
    a = x.relu()
    ref = F.conv2d(a, w, b, stride=s, padding=p, dilation=d)
    y = U.union_conv_fwd(op, w, b, geo)
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
    assert y.is_contiguous(memory_format=torch.channels_last)
    for group in (1, 2):
        torch.testing.assert_close(U.union_conv_fwd(op, w, b, geo, group=group), ref, atol=1e-4, rtol=1e-4)
    dy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 2))
    keep_dy = torch.rand(ref.shape, generator=torch.Generator().manual_seed(seed + 3)) < 0.5
    dy = torch.where(keep_dy, dy, torch.zeros(()))
    dy = dy.contiguous(memory_format=torch.channels_last)
    rdw = torch.nn.grad.conv2d_weight(a, w.shape, dy, stride=s, padding=p, dilation=d)
    dw = U.union_conv_wgrad(op, dy.permute(0, 2, 3, 1), geo, w.stride())
    torch.testing.assert_close(dw, rdw, atol=1e-3, rtol=1e-4)
    assert dw.stride() == w.stride()
    dwl = U.union_conv_wgrad(op, dy.permute(0, 2, 3, 1), geo, w.stride(), lists=True)
    torch.testing.assert_close(dwl, rdw, atol=1e-3, rtol=1e-4)
    assert dwl.stride() == w.stride()
    # the input gradient at relu(x)'s nonzeros (any stride)
    rdx = torch.nn.grad.conv2d_input(x.shape, w, dy, stride=s, padding=p, dilation=d) * (x > 0)
    for lists in (False, True):  # 4-pixel unions, per-channel pixel lists
        dxx = U.union_conv_igrad_x(op, dy.permute(0, 2, 3, 1), geo, weight=w, lists=lists)
        torch.testing.assert_close(dxx, rdx, atol=1e-4, rtol=1e-4)
        assert dxx.is_contiguous(memory_format=torch.channels_last)
    if s != 1:
        return
    gop = U.union_operand(dy, relu=False, native=native)
    rdx = torch.nn.grad.conv2d_input(x.shape, w, dy, stride=s, padding=p, dilation=d) * (x > 0)
    dx = U.union_conv_igrad(gop, w, op, geo)
    torch.testing.assert_close(dx, rdx, atol=1e-4, rtol=1e-4)
    for group in (1, 2):
        torch.testing.assert_close(U.union_conv_igrad(gop, w, op, geo, group=group), rdx, atol=1e-4, rtol=1e-4)
    if p <= d * (k - 1):
        dw2 = U.union_conv_wgrad_dy(gop, op.values, geo, w.stride())
        torch.testing.assert_close(dw2, rdw, atol=1e-3, rtol=1e-4)
        assert dw2.stride() == w.stride()
    else:
        with pytest.raises(ValueError, match="padding"):
            U.union_conv_wgrad_dy(gop, op.values, geo, w.stride())


@needs_native
@pytest.mark.parametrize("layout", ["oihw", "ohwi", "odd"])
def test_weight_gradient_layouts(layout, threads):
    x = _act((2, 32, 6, 7), 0.6, True, 5)
    w = torch.randn(48, 32, 3, 3)
    if layout == "ohwi":
        w = w.contiguous(memory_format=torch.channels_last)
    elif layout == "odd":  # a dense but unusual permutation: the kernels' rows go through a generic copy
        w = torch.randn(3, 3, 48, 32).permute(2, 3, 0, 1)
    geo = U.geometry(x.shape, w.shape, (1, 1), (1, 1), (1, 1))
    op = U.union_operand(x)
    dy = torch.randn(2, 48, 6, 7).contiguous(memory_format=torch.channels_last)
    rdw = torch.nn.grad.conv2d_weight(x.relu(), w.shape, dy, padding=1)
    for dw in (
        U.union_conv_wgrad(op, dy.permute(0, 2, 3, 1), geo, w.stride()),
        U.union_conv_wgrad(op, dy.permute(0, 2, 3, 1), geo, w.stride(), lists=True),
        U.union_conv_wgrad_dy(U.union_operand(dy, relu=False), op.values, geo, w.stride()),
        U.union_conv_wgrad_dy(U.union_operand(dy, relu=False), op.values, geo, w.stride(), lists=True),
    ):
        torch.testing.assert_close(dw, rdw, atol=1e-3, rtol=1e-4)
        assert dw.stride() == w.stride()


def _maxpool_dy(N, O, H, W, keep, gen):
    """dY behind a 2x2 max-pool and a ReLU: one pixel of each window, kept with probability ``keep``."""
    h, w = -(-H // 2), -(-W // 2)
    g = torch.randn(N, O, h, w, generator=gen) * (torch.rand(N, O, h, w, generator=gen) < keep)
    at = torch.randint(0, 4, (N, O, h, w), generator=gen)
    full = torch.zeros(N, O, h, w, 4).scatter_(4, at.unsqueeze(-1), g.unsqueeze(-1))
    return full.view(N, O, h, w, 2, 2).permute(0, 1, 2, 4, 3, 5).reshape(N, O, 2 * h, 2 * w)[:, :, :H, :W]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["oihw", "ohwi", "odd"])
@pytest.mark.parametrize(
    "N,C,H,W,O,k,pad,dil",
    [
        (2, 32, 8, 8, 48, 3, 1, 1),
        (3, 16, 6, 10, 32, 3, 1, 1),
        (2, 16, 7, 7, 16, 3, 0, 1),
        (2, 32, 9, 9, 16, 3, 2, 2),
        (2, 16, 6, 6, 32, 2, 1, 1),
        (2, 48, 6, 6, 16, 1, 0, 1),
        (1, 512, 2, 2, 64, 3, 1, 1),
    ],
)
def test_weight_gradient_over_dy_lists(native, threads, dtype, layout, N, C, H, W, O, k, pad, dil):
    # the list kernel on the flipped conv: dY's per-channel lists, relu(x)'s rows, dW written swapped and flipped
    gen = torch.Generator().manual_seed(C * O + k + pad)
    x = _act((N, C, H, W), 0.5, True, C + O).to(dtype)
    w = torch.randn(O, C, k, k)
    if layout == "ohwi":
        w = w.contiguous(memory_format=torch.channels_last)
    elif layout == "odd":
        w = torch.randn(k, k, O, C).permute(2, 3, 0, 1)
    geo = U.geometry(x.shape, w.shape, (1, 1), (pad, pad), (dil, dil))
    dy = _maxpool_dy(N, O, geo.Ho, geo.Wo, 0.6, gen).to(dtype).contiguous(memory_format=torch.channels_last)
    kw = {"dtype": dtype} if dtype == torch.bfloat16 else {}
    op = U.union_operand(x, native=native, **kw)
    gop = U.union_operand(dy, relu=False, native=native, **kw)
    dw = U.union_conv_wgrad_dy(gop, op.values, geo, w.stride(), lists=True)
    assert dw.dtype == torch.float32 and dw.stride() == w.stride()
    xr = x.double().relu()
    ref = torch.nn.grad.conv2d_weight(xr, w.shape, dy.double(), padding=pad, dilation=dil)
    scale = torch.nn.grad.conv2d_weight(xr, w.shape, dy.double().abs(), padding=pad, dilation=dil)
    err = (dw.double() - ref).abs()
    assert (err <= 1e-5 * scale + 1e-6).all(), float((err / (scale + 1e-30)).max())  # fp32 sums of exact products


def test_weight_gradient_over_dy_lists_checks_dtypes():
    if not U.union_native():
        pytest.skip("union kernels need AVX-512 and the native build")
    from sparsa.kernels import adaptive_union_ops as ops

    x = _act((1, 16, 4, 4), 0.5, True, 1)
    geo = U.geometry(x.shape, (16, 16, 3, 3), (1, 1), (1, 1), (1, 1))
    gop = U.union_operand(x, relu=False)
    with pytest.raises(TypeError, match="both be float32 or both bfloat16"):
        ops.union_conv_wgrad_dy_lists(gop.values, gop.mask, x.permute(0, 2, 3, 1).bfloat16(), geo, None)


@needs_native
@pytest.mark.parametrize("layout", ["oihw", "ohwi", "odd"])
@pytest.mark.parametrize("C,nthreads", [(16, 2), (32, 3), (48, 3), (96, 2), (512, 2)])
def test_weight_gradient_lists_store_into_any_layout(layout, C, nthreads):
    # the list kernel transposes each thread's staging block straight into dW: channel ranges cut at 16-channel
    # runs (or not, with few channels), 8x8 tiles plus scalar remainders, a generic scalar store for odd layouts
    assert U.union_supported(C, 32)
    old = torch.get_num_threads()
    torch.set_num_threads(nthreads)
    try:
        x = _act((2, C, 4, 5), 0.8, True, C)
        w = torch.randn(32, C, 3, 3)
        if layout == "ohwi":
            w = w.contiguous(memory_format=torch.channels_last)
        elif layout == "odd":
            w = torch.randn(3, 3, 32, C).permute(2, 3, 0, 1)
        geo = U.geometry(x.shape, w.shape, (1, 1), (1, 1), (1, 1))
        dy = torch.randn(2, 32, 4, 5)
        for scale in (1.0, -3.0):  # a missed store keeps what the freed memory held (e.g. the first call's dW)
            rdw = torch.nn.grad.conv2d_weight(x.relu(), w.shape, dy * scale, padding=1)
            poison = torch.full((w.numel(),), float("nan"))
            del poison
            dw = U.union_conv_wgrad(
                U.union_operand(x), (dy * scale).permute(0, 2, 3, 1).contiguous(), geo, w.stride(), lists=True
            )
            torch.testing.assert_close(dw, rdw, atol=1e-3, rtol=1e-4)
            assert dw.stride() == w.stride()
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize(
    "k,stride,pad,dil,O", [(5, 1, 2, 1, 48), (7, 2, 3, 1, 16), (5, 1, 4, 2, 80), (11, 3, 5, 1, 32), (1, 2, 0, 1, 144)]
)
def test_weight_gradient_lists_any_kernel_size(native, threads, k, stride, pad, dil, O):
    # the per-channel list kernel runs kernel offsets in runs of up to 9 and output blocks of 16-64 channels
    x = _act((2, 24, 13, 11), 0.7, True, k)
    w = torch.randn(O, 24, k, k)
    geo = U.geometry(x.shape, w.shape, (stride, stride), (pad, pad), (dil, dil))
    op = U.union_operand(x, native=native)
    dy = torch.randn(F.conv2d(x, w, stride=stride, padding=pad, dilation=dil).shape)
    rdw = torch.nn.grad.conv2d_weight(x.relu(), w.shape, dy, stride=stride, padding=pad, dilation=dil)
    dw = U.union_conv_wgrad(op, dy.permute(0, 2, 3, 1).contiguous(), geo, w.stride(), lists=True)
    torch.testing.assert_close(dw, rdw, atol=1e-3, rtol=1e-4)


@needs_native
def test_wc_from_forward_pack_equals_the_list_pack():
    from sparsa.kernels import adaptive as K

    for w in (torch.randn(48, 32, 3, 3), torch.randn(128, 16, 3, 3).contiguous(memory_format=torch.channels_last)):
        O, C, KH, KW = w.shape
        wf = U.union_packs(w, flipped=False)[0]
        assert torch.equal(U.union_wc(wf, O, C, KH, KW), K.packed_weight(w)[1])


@needs_native
def test_input_gradient_keeps_nan_only_where_relu_active():
    x = _act((1, 16, 5, 5), 0.5, True, 9)
    w = torch.randn(16, 16, 3, 3)
    geo = U.geometry(x.shape, w.shape, (1, 1), (1, 1), (1, 1))
    dy = torch.zeros(1, 16, 5, 5).contiguous(memory_format=torch.channels_last)
    dy[0, 3, 2, 2] = float("nan")
    dx = U.union_conv_igrad(U.union_operand(dy, relu=False), w, U.union_operand(x), geo)
    near = torch.zeros(1, 16, 5, 5, dtype=torch.bool)
    near[:, :, 1:4, 1:4] = True
    assert torch.equal(torch.isnan(dx), near & (x > 0))
    assert (dx[~(near & (x > 0))] == 0).all()


@needs_native
def test_unsupported_channel_blocks_fall_back():
    # O = 40: forward block 40 is not a multiple of 16; the wrappers then run the dense fallback
    assert not U.union_supported(32, 40) and not U.union_supported(40, 32) and U.union_supported(32, 48)
    x = _act((1, 32, 4, 4), 0.5, True, 1)
    w = torch.randn(40, 32, 3, 3)
    geo = U.geometry(x.shape, w.shape, (1, 1), (1, 1), (1, 1))
    y = U.union_conv_fwd(U.union_operand(x), w, None, geo)
    torch.testing.assert_close(y, F.conv2d(x.relu(), w, padding=1), atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------ autograd path
@needs_native
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_relu_conv2d_union_path_gradients(stride, channels_last, bias, threads):
    x0 = _act((2, 32, 7, 6), 0.6, channels_last, stride)
    w0 = torch.randn(64, 32, 3, 3) * 0.1
    b0 = torch.randn(64) if bias else None
    before = conv_union.union_paths.copy()
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    b = b0.clone().requires_grad_() if bias else None
    y = relu_conv2d(x, w, b, stride=stride, padding=1)
    xr, wr = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    br = b0.clone().requires_grad_() if bias else None
    ref = F.conv2d(xr.relu(), wr, br, stride=stride, padding=1)
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
    gy = torch.randn(ref.shape) * (torch.rand(ref.shape) < 0.3)
    y.backward(gy)
    ref.backward(gy)
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(w.grad, wr.grad, atol=1e-3, rtol=1e-4)
    if bias:
        torch.testing.assert_close(b.grad, br.grad, atol=1e-4, rtol=1e-4)
    assert x.grad.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    ran = conv_union.union_paths - before
    assert ran[("dx_dy" if stride == 1 else "dx_x")] == 1
    assert ran["dw_x"] + ran["dw_dy"] + ran["dw_lists"] + ran["dw_dy_lists"] == 1


def test_input_gradient_side_rules():
    side = conv_union._dx_side
    assert side(0.5, 0.13, 64, 64, True) == "dy"  # behind a max-pool: dY much sparser
    assert side(0.5, 1.0, 64, 64, True) == "x"  # dense dY (BatchNorm): relu(x)'s side
    assert side(0.25, 0.49, 256, 256, True) == "x"
    assert side(0.9, None, 64, 64, False) == "dense"  # strided and nearly dense: dense, masked
    assert side(0.3, None, 64, 64, False) == "x"
    assert conv_union._dx_x_certain(0.1, 128, 128) and not conv_union._dx_x_certain(0.3, 128, 128)


@needs_native
@pytest.mark.parametrize("zeros,side", [(0.7, "dx_x"), (0.0, "dx_dense")])
def test_strided_input_gradient_side(zeros, side):
    x = _act((2, 32, 8, 8), zeros, True, 5)
    if zeros == 0.0:
        x = x.abs() + 0.1  # no zeros at all
    x = x.clone().requires_grad_()
    w = torch.randn(32, 32, 3, 3, requires_grad=True)
    y = relu_conv2d(x, w, None, stride=2, padding=1)
    gy = torch.randn(y.shape)
    before = conv_union.union_paths.copy()
    y.backward(gy)
    assert (conv_union.union_paths - before)[side] == 1
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.nn.functional.conv2d(xr.relu(), wr, None, stride=2, padding=1).backward(gy)
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-4, rtol=1e-4)


@needs_native
@pytest.mark.parametrize(
    "x_zeros,dy_density,side,C",
    [
        (0.3, 0.05, "dw_dy_lists", 32),
        (0.3, 0.05, "dw_dy", 32),
        (0.5, 1.0, "dw_x", 32),
        (0.995, 1.0, "dw_lists", 128),
        (0.9, 1.0, "dw_lists", 32),
    ],
)
def test_weight_gradient_side_follows_the_densities(monkeypatch, x_zeros, dy_density, side, C):
    if side == "dw_dy":  # the union kernel over dY's mask, where its list kernel is priced out
        fits = dict(conv_union._fits.table())
        fits["conv_union.dw.dy_lists"] = {"base": 9.0, "per_dg": 0.0}
        monkeypatch.setattr(conv_union._fits, "table", lambda cost_model=None: fits)
    w0 = torch.randn(32, C, 3, 3)
    x = _act((2, C, 6, 6), x_zeros, True, 4)
    w = w0.clone().requires_grad_()
    y = relu_conv2d(x, w, None, padding=1)
    gy = (torch.randn(y.shape) * (torch.rand(y.shape) < dy_density)).contiguous(memory_format=torch.channels_last)
    before = conv_union.union_paths.copy()
    y.backward(gy)
    assert (conv_union.union_paths - before)[side] == 1
    wr = w0.clone().requires_grad_()
    F.conv2d(x.relu(), wr, None, padding=1).backward(gy)
    torch.testing.assert_close(w.grad, wr.grad, atol=1e-3, rtol=1e-4)


@needs_native
@pytest.mark.parametrize("channels_last", [False, True])
def test_weight_changed_in_place_after_forward_uses_forward_weights(channels_last):
    # a sparse dY picks the dY side. OIHW: the flipped pack saved by the forward; channels-last (read in place):
    # the relu(x) side from the forward pack
    x0 = _act((1, 16, 5, 5), 0.5, True, 2)
    w = torch.nn.Parameter(torch.randn(16, 16, 3, 3))
    if channels_last:
        w.data = w.data.contiguous(memory_format=torch.channels_last)
    w0 = w.detach().clone()
    x = x0.clone().requires_grad_()
    y = relu_conv2d(x, w, None, padding=1)
    with torch.no_grad():
        w.add_(1.0)  # an optimizer step between forward and backward
    gy = torch.randn(y.shape) * (torch.rand(y.shape, generator=torch.Generator().manual_seed(3)) < 0.15)
    before = conv_union.union_paths.copy()
    y.backward(gy)
    assert (conv_union.union_paths - before)["dx_x" if channels_last else "dx_dy"] == 1
    xr = x0.clone().requires_grad_()
    F.conv2d(xr.relu(), w0, None, padding=1).backward(gy)
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-4, rtol=1e-4)


@needs_native
@pytest.mark.parametrize("zeros,clustered,group", [(0.5, True, "fwd_g4"), (0.9, False, "fwd_g2")])
def test_forward_pixel_group_follows_zero_clustering(zeros, clustered, group):
    # scattered zeros make 4-pixel unions wasteful: the forward then runs 2-pixel groups
    x = torch.randn(2, 64, 8, 8).abs() + 0.1
    if clustered:  # whole channels zero: every 4-pixel union holds exactly the nonzero channels
        x = x * (torch.rand(2, 64, 1, 1) > zeros)
    else:
        x = x * (torch.rand(2, 64, 8, 8) > zeros)
    w = torch.randn(32, 64, 3, 3)
    before = conv_union.union_paths.copy()
    y = relu_conv2d(x, w, None, padding=1)
    assert (conv_union.union_paths - before)[group] == 1
    torch.testing.assert_close(y, F.conv2d(x.relu(), w, padding=1), atol=1e-4, rtol=1e-4)


@needs_native
def test_sparse_input_list_gradient_uses_forward_weights():
    # relu(x) this sparse: the forward skips the flipped pack and backward's list kernel reads the forward pack
    x0 = _act((2, 32, 6, 6), 0.97, True, 3)
    w = torch.nn.Parameter(torch.randn(32, 32, 3, 3))
    w0 = w.detach().clone()
    x = x0.clone().requires_grad_()
    y = relu_conv2d(x, w, None, padding=1)
    with torch.no_grad():
        w.mul_(-2.0)  # an optimizer step between forward and backward
    gy = torch.randn(y.shape)
    before = conv_union.union_paths.copy()
    y.backward(gy)
    assert (conv_union.union_paths - before)["dx_x"] == 1
    xr, wr = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    F.conv2d(xr.relu(), wr, None, padding=1).backward(gy)
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(w.grad, wr.grad, atol=1e-3, rtol=1e-4)


@needs_native
def test_only_weight_needs_grad():
    x = _act((2, 16, 5, 5), 0.5, True, 7)
    w = torch.randn(16, 16, 3, 3, requires_grad=True)
    relu_conv2d(x, w, None, padding=1).sum().backward()
    wr = w.detach().clone().requires_grad_()
    F.conv2d(x.relu(), wr, None, padding=1).sum().backward()
    torch.testing.assert_close(w.grad, wr.grad, atol=1e-3, rtol=1e-4)


def test_kernel_setting_list_and_bad_value(monkeypatch):
    x = _act((1, 16, 4, 4), 0.5, True, 1)
    w = torch.randn(16, 16, 3, 3)
    monkeypatch.setattr(conv_union, "KERNELS", "list")
    assert not conv_union.union_path_supported(x, w, None)
    torch.testing.assert_close(
        relu_conv2d(x, w, None, padding=1), F.conv2d(x.relu(), w, padding=1), atol=1e-4, rtol=1e-4
    )
    monkeypatch.setattr(conv_union, "KERNELS", "fast")
    with pytest.raises(ValueError, match="auto, union or list"):
        relu_conv2d(x, w, None, padding=1)


def test_no_avx512_switches_to_list_kernels(monkeypatch):
    monkeypatch.setenv("SPARSA_NO_AVX512", "1")
    assert not U.union_native()
    x = _act((1, 16, 4, 4), 0.5, True, 1).requires_grad_()
    w = torch.randn(16, 16, 3, 3, requires_grad=True)
    before = conv_union.union_paths.copy()
    relu_conv2d(x, w, None, padding=1).sum().backward()
    assert conv_union.union_paths == before


@needs_native
@pytest.mark.parametrize("channels_last", [False, True])
def test_input_gradient_side_follows_the_sparser_operand(channels_last):
    w = torch.randn(128, 128, 3, 3) * 0.1
    for sp, dyd, side in ((0.97, 1.0, "dx_x"), (0.5, 0.1, "dx_dy")):
        x0 = _act((2, 128, 6, 6), sp, channels_last, 8)
        x, wr = x0.clone().requires_grad_(), w.clone().requires_grad_()
        y = relu_conv2d(x, wr, None, padding=1)
        gy = torch.randn(y.shape) * (torch.rand(y.shape) < dyd)
        before = conv_union.union_paths.copy()
        y.backward(gy)
        assert (conv_union.union_paths - before)[side] == 1, (sp, dyd)
        xr = x0.clone().requires_grad_()
        F.conv2d(xr.relu(), w, None, padding=1).backward(gy)
        torch.testing.assert_close(x.grad, xr.grad, atol=1e-4, rtol=1e-4)
        assert x.grad.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


@pytest.mark.parametrize(
    "shape,stride,pad",
    [
        ((2, 32, 16, 16), 1, 1),
        ((1, 48, 18, 20), 1, 1),
        ((1, 16, 33, 32), 2, 1),
        ((2, 16, 16, 17), 1, 1),
        ((1, 16, 16, 16), 1, 0),
    ],
)
def test_large_images_2x2_pixel_groups(native, threads, shape, stride, pad):
    # images of 16x16 and more (even-sized outputs) run the x-driven kernels on 2x2 pixel groups
    x = _act(shape, 0.6, True, 11)
    w = torch.randn(32, shape[1], 3, 3) * 0.1
    geo = U.geometry(x.shape, w.shape, (stride, stride), (pad, pad), (1, 1))
    op = U.union_operand(x, native=native)
    ref = F.conv2d(x.relu(), w, None, stride=stride, padding=pad)
    torch.testing.assert_close(U.union_conv_fwd(op, w, None, geo), ref, atol=1e-4, rtol=1e-4)
    dy = (torch.randn(ref.shape) * (torch.rand(ref.shape) < 0.4)).contiguous(memory_format=torch.channels_last)
    rdw = torch.nn.grad.conv2d_weight(x.relu(), w.shape, dy, stride=stride, padding=pad)
    torch.testing.assert_close(
        U.union_conv_wgrad(op, dy.permute(0, 2, 3, 1), geo, w.stride()), rdw, atol=1e-3, rtol=1e-4
    )


@needs_native
def test_relu_linear_runs_the_union_kernels(threads):
    from sparsa.adaptive import relu_linear

    x0 = torch.randn(2, 25, 96) - 0.3  # 50 rows: a tail group of 2
    w0, b0 = torch.randn(64, 96) * 0.1, torch.randn(64)
    x, w, b = x0.clone().requires_grad_(), w0.clone().requires_grad_(), b0.clone().requires_grad_()
    before = conv_union.union_paths.copy()
    y = relu_linear(x, w, b)
    gy = torch.randn(y.shape) * (torch.rand(y.shape) < 0.5)
    y.backward(gy)
    ran = conv_union.union_paths - before
    assert ran["fwd_g4"] + ran["fwd_g2"] == 1 and sum(ran.values()) == 3  # forward, dx and dW on the union path
    xr, wr, br = x0.clone().requires_grad_(), w0.clone().requires_grad_(), b0.clone().requires_grad_()
    ref = F.linear(xr.relu(), wr, br)
    ref.backward(gy)
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(w.grad, wr.grad, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(b.grad, br.grad, atol=1e-4, rtol=1e-4)


@needs_native
def test_relu_linear_sees_in_place_weight_updates():
    from sparsa.adaptive import relu_linear

    x = torch.randn(8, 32) - 0.2
    w = torch.nn.Parameter(torch.randn(32, 32) * 0.1)
    first = relu_linear(x, w)
    with torch.no_grad():
        w.add_(0.5)  # the weight packs are cached per version: this must re-pack
    torch.testing.assert_close(relu_linear(x, w), F.linear(x.relu(), w), atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        w.data = torch.randn(32, 32)  # new storage
    torch.testing.assert_close(relu_linear(x, w), F.linear(x.relu(), w), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(first, relu_linear(x, w))


def test_union_ratio_rescales_the_calibrated_cost():
    from sparsa.adaptive import CostEntry

    e = CostEntry(dense_ms=10.0, fixed_ms=1.0, slope_ms=10.0, union_ratio=2.0)
    base = e.speedup(0.5)
    assert e.speedup(0.5, None, 2.0) == pytest.approx(base)
    assert e.speedup(0.5, None, 3.0) < base < e.speedup(0.5, None, 1.5)  # less clustered zeros: slower
    assert e.sparse_ms(0.5, None, 100.0) == pytest.approx(e.sparse_ms(0.5, None, 4.0))  # clamped at 2x
    assert CostEntry(10.0, 1.0, 10.0).speedup(0.5, None, 3.0) == pytest.approx(base)  # no calibration ratio


@needs_native
def test_operand_union_ratio_measures_clustering():
    N, C, H, W = 2, 64, 4, 8
    shared = (torch.rand(N, C, 1, 1) < 0.5).float().expand(N, C, H, W)  # every pixel the same channels
    op = U.union_operand((shared * torch.rand(N, C, H, W) + shared * 0.1).contiguous(memory_format=torch.channels_last))
    assert op.union_ratio() == pytest.approx(1.0)
    # one channel per pixel, all different within each run of 4: no sharing
    x = torch.zeros(N, C, H, W)
    for w in range(W):
        x[:, w % 4, :, w] = 1.0
    assert U.union_operand(x).union_ratio() == pytest.approx(4.0)
    # runs go on across rows: a [P, K] matrix seen as a P x 1 image (Linear) is measured over 4 rows
    rows = torch.zeros(1, 16, 8, 1)
    rows[:, :8] = 1.0  # every row has the same 8 channels
    op = U.union_operand(rows)
    assert op.union4 == 2 * 8 and op.union_ratio() == pytest.approx(1.0)
    ragged = torch.rand(2, 20, 3, 3)  # 9 pixels an image: runs of 4, 4, 1; all channels nonzero
    assert U.union_operand(ragged).union4 == 2 * 3 * 20


@needs_native
def test_runtime_keeps_the_union_ratio_of_sparse_layers():
    import torch.nn as nn
    import sparsa.adaptive as sa

    net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1))
    rt = sa.enable(net, every=1, policy=sa.Policy(force="sparse"))
    for _ in range(3):
        net(torch.randn(2, 3, 8, 8)).sum().backward()
    st = rt.layers["2"]
    assert st.path == "sparse" and st.union_ratio is not None and 1.0 <= st.union_ratio <= 4.0
    row = next(r for r in rt.report() if r["layer"] == "2")
    assert row["kernels"] == "union" and row["union_ratio"] == st.union_ratio
    assert "kernels" in rt.format().splitlines()[0]


@needs_native
@pytest.mark.parametrize("layout", ["oihw", "ohwi", "odd"])
def test_union_packs_equal_the_list_packs(layout):
    from sparsa.kernels import adaptive as K

    w = torch.randn(96, 48, 3, 3)
    if layout == "ohwi":
        w = w.contiguous(memory_format=torch.channels_last)
    elif layout == "odd":
        w = torch.randn(3, 3, 96, 48).permute(2, 3, 0, 1)
    wf, wfl = U.union_packs(w)
    assert torch.equal(wf, K.packed_weight(w)[0]) and torch.equal(wfl, K.packed_weight_flipped(w))
    assert U.union_packs(w)[0] is wf  # cached while the weight is unchanged
    with torch.no_grad():
        w.mul_(2.0)
    assert torch.equal(U.union_packs(w)[0], 2 * wf)
    with torch.no_grad():
        w.mul_(0.5)
    wf2, none = U.union_packs(w, flipped=False)  # the forward pack only, the flipped one added on request
    assert none is None and torch.equal(wf2, wf)
    wf3, wfl3 = U.union_packs(w)
    assert wf3 is wf2 and torch.equal(wfl3, wfl)


def test_input_gradient_kernel_follows_the_union_ratio(monkeypatch):
    # clustered zeros (low union ratio) keep the 4-pixel unions; scattered ones, or an unknown ratio, the lists
    monkeypatch.setattr(U, "crossover", lambda name: {"conv_union.dx_x_lists": 1.8}[name])
    assert not U.igrad_x_lists(1.2) and not U.igrad_x_lists(1.8)
    assert U.igrad_x_lists(2.5) and U.igrad_x_lists(None)
