"""The bf16 union kernels (AVX512-BF16) and their PyTorch fallback against float64 references: the operand,
the paired weight pack, the forward and the stride-1 input gradient, and ``relu_conv2d`` on a bf16 input."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparsa.adaptive import relu_conv2d
from sparsa.adaptive.conv_union import union_path_supported_for, union_paths
from sparsa.kernels import adaptive_union as U
from sparsa.kernels import adaptive_union_bf16 as B
from sparsa.kernels import adaptive_union_ops as ops
from sparsa.kernels.adaptive import _pick_ob

BF = torch.bfloat16
RTOL = 2.0**-8  # the one rounding to bf16 (half an ulp is 2^-9), with room
ATOL_REL = 1e-5  # of the conv of |x| and |w|: fp32 accumulation


def _need_native():
    if not B.union_dpbf16():
        pytest.skip("the bf16 union kernels need AVX-512 with AVX512-BF16 (avx512_bf16 in /proc/cpuinfo)")


@pytest.fixture(params=["native", "fallback"])
def native(request):
    if request.param == "native":
        _need_native()
        return True
    return False


def _operand(x, native, relu=True):
    op = B.union_operand_bf16(x, relu=relu, native=native)
    assert (op.mask is not None) == native
    return op


def _check(y, ref, scale):
    y = y.double()
    err = (y - ref).abs()
    tol = RTOL * ref.abs() + ATOL_REL * scale + 1e-30
    bad = err > tol
    worst = float((err / tol).max())
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} outside tolerance; worst {worst:.3g} x tol"


def _sparse_bf16(shape, sparsity, gen):
    x = torch.randn(*shape, generator=gen)
    return (x - torch.quantile(x.flatten()[:50000], sparsity)).to(BF)


CONVS = [  # (N, C, H, W, O, kernel, stride, padding, dilation)
    (2, 16, 6, 6, 32, 3, 1, 1, 1),
    (1, 64, 16, 16, 64, 3, 1, 1, 1),
    (3, 32, 9, 7, 48, 3, 2, 1, 1),
    (2, 128, 4, 4, 256, 3, 1, 1, 1),
    (2, 16, 8, 8, 16, 1, 1, 0, 1),
    (1, 24, 10, 10, 32, 3, 1, 2, 2),
]


@pytest.mark.parametrize("N,C,H,W,O,k,s,p,d", CONVS)
@pytest.mark.parametrize("group", [4, 2, 1])
@pytest.mark.parametrize("with_bias", [False, True])
def test_forward_matches_float64(native, N, C, H, W, O, k, s, p, d, group, with_bias):
    gen = torch.Generator().manual_seed(N * 100 + C + O + k)
    x = _sparse_bf16((N, C, H, W), 0.6, gen)
    w = torch.randn(O, C, k, k, generator=gen) / (C * k * k) ** 0.5
    b = torch.randn(O, generator=gen) if with_bias else None
    geo = U.geometry(x.shape, w.shape, (s, s), (p, p), (d, d))
    y = B.union_conv_fwd_bf16(_operand(x, native), w, b, geo, group=group)
    assert y.dtype == BF and y.is_contiguous(memory_format=torch.channels_last)
    xr, wr = x.double().relu(), w.to(BF).double()
    ref = F.conv2d(xr, wr, None if b is None else b.double(), stride=s, padding=p, dilation=d)
    scale = F.conv2d(xr.abs(), wr.abs(), None if b is None else b.double().abs(), stride=s, padding=p, dilation=d)
    _check(y, ref, scale)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    N=st.integers(1, 3),
    C=st.sampled_from([8, 16, 40, 64, 72]),
    O=st.sampled_from([16, 32, 48, 80]),
    H=st.integers(1, 9),
    W=st.integers(1, 9),
    sparsity=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    group=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 999),
)
def test_forward_property(native, N, C, O, H, W, sparsity, group, seed):
    gen = torch.Generator().manual_seed(seed)
    x = _sparse_bf16((N, C, H, W), sparsity, gen) if sparsity < 1 else -torch.rand(N, C, H, W).to(BF)
    w = torch.randn(O, C, 3, 3, generator=gen)
    geo = U.geometry(x.shape, w.shape, (1, 1), (1, 1), (1, 1))
    y = B.union_conv_fwd_bf16(_operand(x, native), w, None, geo, group=group)
    xr, wr = x.double().relu(), w.to(BF).double()
    _check(y, F.conv2d(xr, wr, padding=1), F.conv2d(xr.abs(), wr.abs(), padding=1))


@pytest.mark.parametrize("N,C,H,W,O", [(2, 16, 6, 6, 32), (1, 64, 16, 16, 64), (2, 256, 4, 4, 128)])
@pytest.mark.parametrize("group", [4, 2])
def test_input_gradient_matches_float64(native, N, C, H, W, O, group):
    gen = torch.Generator().manual_seed(C + O)
    x = _sparse_bf16((N, C, H, W), 0.5, gen)
    w = torch.randn(O, C, 3, 3, generator=gen)
    gy = _sparse_bf16((N, O, H, W), 0.3, gen).contiguous(memory_format=torch.channels_last)
    geo = U.geometry(x.shape, w.shape, (1, 1), (1, 1), (1, 1))
    dx = B.union_conv_igrad_bf16(_operand(gy, native, relu=False), w, _operand(x, native), geo, group=group)
    assert dx.dtype == BF and dx.shape == x.shape
    xr, wr = x.double().relu(), w.to(BF).double()

    def igrad(g, wt):
        return torch.ops.aten.convolution_backward(
            g, xr, wt, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, False, False]
        )[0]

    ref = torch.where(xr != 0, igrad(gy.double(), wr), 0)
    scale = torch.where(xr != 0, igrad(gy.double().abs(), wr.abs()), 0)
    _check(dx, ref, scale)


@pytest.mark.parametrize(
    "N,C,H,W,O,s", [(2, 16, 6, 6, 16, 1), (1, 64, 16, 16, 48, 1), (2, 24, 9, 7, 64, 2), (1, 136, 7, 11, 96, 1)]
)
@pytest.mark.parametrize("lists", [False, True])
def test_input_gradient_at_nonzeros_matches_float64(native, N, C, H, W, O, s, lists):
    """The input gradient at relu(x)'s nonzeros (dot products over pairs of output channels; O = 16 and 48 take
    a last step of half a vector; 136 channels: three mask words, the last partial; 77 pixels: blocks of 32 and
    a tail), on 4-pixel unions and on per-channel pixel lists."""
    gen = torch.Generator().manual_seed(C * O + s)
    x = _sparse_bf16((N, C, H, W), 0.6, gen)
    w = torch.randn(O, C, 3, 3, generator=gen)
    geo = U.geometry(x.shape, w.shape, (s, s), (1, 1), (1, 1))
    Ho, Wo = geo.Ho, geo.Wo
    gy = torch.randn(N, Ho, Wo, O, generator=gen).to(BF)
    dx = B.union_conv_igrad_x_bf16(_operand(x, native), gy, geo, weight=w, lists=lists)
    assert dx.dtype == BF and dx.shape == x.shape
    xr, wr = x.double().relu(), w.to(BF).double()

    def igrad(g, wt):
        return torch.ops.aten.convolution_backward(
            g.permute(0, 3, 1, 2), xr, wt, None, [s, s], [1, 1], [1, 1], False, [0, 0], 1, [True, False, False]
        )[0]

    _check(
        dx, torch.where(xr != 0, igrad(gy.double(), wr), 0), torch.where(xr != 0, igrad(gy.double().abs(), wr.abs()), 0)
    )


@pytest.mark.parametrize(
    "N,C,H,W,O,s,d",
    [(2, 8, 6, 6, 16, 1, 1), (1, 64, 16, 16, 48, 1, 1), (2, 24, 9, 7, 64, 2, 1), (1, 32, 10, 10, 128, 1, 2)],
)
def test_weight_gradient_matches_float64(native, N, C, H, W, O, s, d):
    """The weight gradient over relu(x)'s mask with the group's pixels paired (C = 8: rows shorter than an
    output block; 16x16: 2x2 tiles; stride 2 and dilation 2: members outside the image)."""
    gen = torch.Generator().manual_seed(C * O + s + d)
    x = _sparse_bf16((N, C, H, W), 0.6, gen)
    w = torch.randn(O, C, 3, 3, generator=gen)
    geo = U.geometry(x.shape, w.shape, (s, s), (d, d), (d, d))
    gy = torch.randn(N, geo.Ho, geo.Wo, O, generator=gen).to(BF)
    ws = w.contiguous(memory_format=torch.channels_last).stride()
    dw = B.union_conv_wgrad_bf16(_operand(x, native), gy, geo, ws)
    assert dw.dtype == torch.float32 and dw.shape == w.shape and dw.stride() == ws
    xr = x.double().relu()

    def wgrad(g, xx):
        return torch.ops.aten.convolution_backward(
            g.permute(0, 3, 1, 2), xx, w.double(), None, [s, s], [d, d], [d, d], False, [0, 0], 1, [False, True, False]
        )[1]

    ref, scale = wgrad(gy.double(), xr), wgrad(gy.double().abs(), xr.abs())
    err = (dw.double() - ref).abs()
    assert (err <= 1e-5 * scale + 1e-6).all(), float((err / (scale + 1e-30)).max())  # fp32 sums of exact products


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("relu", [True, False])
def test_operand_is_the_fp32_operand_in_bf16(channels_last, relu):
    _need_native()
    gen = torch.Generator().manual_seed(5)
    x = _sparse_bf16((2, 72, 5, 6), 0.5, gen)
    x[0, 3, 1, 1], x[1, 70, 4, 5], x[0, 9, 2, 2], x[1, 0, 0, 0] = float("nan"), float("inf"), -0.0, -float("inf")
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    op = B.union_operand_bf16(x, relu=relu)
    ref = U.union_operand(x.float(), relu=relu)  # the fp32 kernels' operand of the same values
    assert torch.equal(op.mask, ref.mask) and op.nnz == ref.nnz and op.union4 == ref.union4
    assert op.values.dtype == BF
    torch.testing.assert_close(op.values.float(), ref.values, rtol=0, atol=0, equal_nan=True)
    fb = B.union_operand_bf16(x, relu=relu, native=False)
    assert fb.nnz == op.nnz
    torch.testing.assert_close(fb.values, op.values, rtol=0, atol=0, equal_nan=True)


def _paired(pack, rows, ob):
    """The reference pairing of an fp32 union pack [block][rows][ob]: [block][rows / 2][ob][2] in bf16, adjacent
    rows paired."""
    return pack.view(-1, rows // 2, 2, ob).to(BF).transpose(2, 3).reshape(-1)


def test_pair_packs_round_the_weight_and_follow_its_version():
    _need_native()
    w = torch.randn(32, 16, 3, 3)
    packs = B.union_pair_packs(w, flipped=False)
    assert packs.wfl2 is None and B.union_pair_packs(w, flipped=False) is packs
    wf_rounded = U.union_packs(w.to(BF).float(), flipped=False)[0]
    assert torch.equal(packs.wc, w.to(BF).permute(1, 2, 3, 0).reshape(-1))  # the input gradient's rows, rounded
    assert torch.equal(packs.wf2, _paired(wf_rounded, 16, 32))
    with torch.no_grad():
        w.mul_(2)
    again = B.union_pair_packs(w)
    assert again is not packs and again.wfl2 is not None
    assert torch.equal(again.wf2.float(), packs.wf2.float() * 2)


@pytest.mark.parametrize("layout", ["oihw", "ohwi", "odd"])
@pytest.mark.parametrize("O,C,k", [(32, 16, 3), (48, 64, 3), (16, 128, 1), (64, 32, 5), (512, 512, 3)])
def test_pair_packs_from_the_weight_equal_the_packs_through_fp32(layout, O, C, k):
    """The one-pass packs equal the fp32 union packs rounded and paired, for OIHW, channels-last and other strides."""
    _need_native()
    w = torch.randn(O, C, k, k, generator=torch.Generator().manual_seed(O + C + k))
    if layout == "ohwi":
        w = w.contiguous(memory_format=torch.channels_last)
    elif layout == "odd":
        w = torch.randn(k, k, O, C).permute(2, 3, 0, 1)
    w[0, 0, 0, 0] = 1.0 + 2**-8  # a tie: rounds to even (1.0)
    w[-1, -1, -1, -1] = 1.0 + 3 * 2**-8  # a tie: rounds to even (1.0 + 2**-6)
    wf2, wfl2, wc = ops.union_pair_packs(w, True, True)
    wf, wfl = U.union_packs(w.to(BF).float())
    assert torch.equal(wf2, _paired(wf, C, _pick_ob(O)))
    assert torch.equal(wfl2, _paired(wfl, O, _pick_ob(C)))
    assert torch.equal(wc, w.to(BF).permute(1, 2, 3, 0).reshape(-1))
    only_flipped = ops.union_pair_packs(w, False, True)
    assert only_flipped[0].numel() == 0 and only_flipped[2].numel() == 0 and torch.equal(only_flipped[1], wfl2)


def test_pair_packs_reject_blocks_the_kernels_cannot_take():
    _need_native()
    with pytest.raises(ValueError, match="multiples of 16"):
        ops.union_pair_packs(torch.randn(24, 16, 3, 3), True, False)  # output block 24
    with pytest.raises(ValueError, match="float32"):
        ops.union_pair_packs(torch.randn(32, 16, 3, 3).bfloat16(), True, False)


@pytest.mark.parametrize("shape", [(2, 16, 4, 4), (3, 17, 5, 7), (1, 64, 32, 32), (2, 33, 1, 1), (1, 5, 3, 2)])
@pytest.mark.parametrize("dtype", [BF, torch.float32])
def test_layout_copies_match_permute(native, monkeypatch, shape, dtype):
    """NCHW <-> NHWC copies (the 16x16-tile transpose for bf16 where the native kernels run): whole tiles, edge
    rows and columns, 1x1 images, fewer than 16 channels."""
    if not native:
        monkeypatch.setenv("SPARSA_NO_NATIVE", "1")
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)
    nhwc = ops.nhwc_copy(x)
    assert nhwc.is_contiguous() and torch.equal(nhwc, x.permute(0, 2, 3, 1))
    cl = x.contiguous(memory_format=torch.channels_last)
    assert ops.nhwc_copy(cl).data_ptr() == cl.data_ptr()  # channels-last already: a view
    back = ops.nchw_copy(cl)
    assert back.is_contiguous() and torch.equal(back, x)
    assert ops.nchw_copy(x) is x


@pytest.mark.parametrize("channels_last", [False, True])
def test_relu_conv2d_bf16_keeps_the_input_memory_format(native, monkeypatch, channels_last):
    """An NCHW bf16 input gets an NCHW output and input gradient (the layers after it need no conversion), a
    channels-last one channels-last; values as the dense conv's."""
    if not native:
        monkeypatch.setenv("SPARSA_NO_NATIVE", "1")
    gen = torch.Generator().manual_seed(7)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = _sparse_bf16((2, 32, 6, 6), 0.6, gen).contiguous(memory_format=fmt).requires_grad_(True)
    w = (torch.randn(32, 32, 3, 3, generator=gen) / 17).requires_grad_(True)
    y = relu_conv2d(x, w, None, padding=1)
    if native:
        assert y.is_contiguous(memory_format=fmt)
    gy = torch.randn(y.shape, generator=gen).to(BF).contiguous(memory_format=fmt)
    y.backward(gy)
    assert x.grad.is_contiguous(memory_format=fmt)
    x64 = x.detach().double().requires_grad_(True)
    w64 = (w.detach().to(BF) if native else w.detach()).double().requires_grad_(True)
    y64 = F.conv2d(x64.relu(), w64, padding=1)
    y64.backward(gy.double())
    for got, ref in ((y.detach(), y64.detach()), (x.grad, x64.grad)):
        torch.testing.assert_close(got.double(), ref, rtol=2**-7, atol=2**-8 * float(ref.abs().max()))


def test_layout16_rejects_bad_input():
    if not U.union_native():
        pytest.skip("needs the native kernels")
    with pytest.raises(ValueError, match="16-bit"):
        ops.layout16(torch.zeros(1, 2, 2, 2), True)
    with pytest.raises(ValueError, match="other memory format"):
        ops.layout16(torch.zeros(1, 2, 3, 3, dtype=BF).contiguous(memory_format=torch.channels_last), True)


def test_operand_rejects_other_dtypes():
    with pytest.raises(ValueError, match="bfloat16"):
        B.union_operand_bf16(torch.zeros(1, 8, 2, 2))
    with pytest.raises(ValueError, match="4-D"):
        B.union_operand_bf16(torch.zeros(8, 2, 2, dtype=BF))


@pytest.mark.parametrize("stride", [1, 2])
def test_relu_conv2d_on_a_bf16_input(native, monkeypatch, stride):
    """Forward and both gradients of ``relu_conv2d`` with a bf16 input and a float32 weight against float64 with
    the weight rounded to bf16 (native) or kept (the fp32 kernels, where no bf16 kernel runs)."""
    if not native:
        monkeypatch.setenv("SPARSA_NO_NATIVE", "1")
    gen = torch.Generator().manual_seed(stride)
    x = _sparse_bf16((2, 32, 8, 8), 0.6, gen).requires_grad_(True)
    w = (torch.randn(64, 32, 3, 3, generator=gen) / 17).requires_grad_(True)
    b = torch.randn(64, generator=gen).requires_grad_(True)
    bf16_path = union_path_supported_for(BF, x.device, w, b)
    assert bf16_path == native
    before = union_paths["bf16_fwd"]
    y = relu_conv2d(x, w, b, stride=stride, padding=1)
    assert y.dtype == BF
    assert union_paths["bf16_fwd"] - before == int(native)
    gy = torch.randn(y.shape, generator=gen).to(BF)
    y.backward(gy)
    assert x.grad.dtype == BF and w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    x64 = x.detach().double().requires_grad_(True)
    w64 = (w.detach().to(BF) if native else w.detach()).double().requires_grad_(True)
    b64 = b.detach().double().requires_grad_(True)
    y64 = F.conv2d(x64.relu(), w64, b64, stride=stride, padding=1)
    y64.backward(gy.double())
    # bf16 results: one rounding; the weight gradient: fp32 kernels, or (the cost model's choice in bf16 mode)
    # the dense bf16 one, rounded once as autocast's own
    for got, ref in ((y, y64), (x.grad, x64.grad), (w.grad, w64.grad)):
        torch.testing.assert_close(got.double(), ref, rtol=2**-7, atol=2**-8 * float(ref.abs().max()))
    torch.testing.assert_close(b.grad.double(), b64.grad, rtol=1e-4, atol=1e-4)
