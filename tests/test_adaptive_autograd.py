"""relu_conv2d / relu_linear: gradcheck (float64, fallback path) and float32 native vs dense autograd."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from sparsa.adaptive import conv_union, relu_conv2d, relu_linear


@pytest.mark.parametrize("stride,padding,dilation,slice", [(1, 1, 1, 64), (2, 1, 1, 2), (1, 1, 2, 3)])
def test_gradcheck_relu_conv2d(stride, padding, dilation, slice):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(8, 3, 3, 3, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(8, dtype=torch.float64, generator=g, requires_grad=True)
    fn = lambda x, w, b: relu_conv2d(x, w, b, stride, padding, dilation, slice=slice)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w, b), fast_mode=True)


def test_gradcheck_relu_linear():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 10, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(16, 10, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(16, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: relu_linear(x, w, b, slice=4), (x, w, b), fast_mode=True)


def _grads(f, *ts):
    ts = [t.detach().clone().requires_grad_(True) if t is not None else None for t in ts]
    y = f(*ts)
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(y.dtype)
    y.backward(gy)
    return y.detach(), [None if t is None else t.grad for t in ts]


@settings(max_examples=25, deadline=None)
@given(
    N=st.integers(1, 3),
    C=st.one_of(st.integers(1, 40), st.sampled_from([16, 32, 48])),
    H=st.integers(2, 6),
    O=st.sampled_from([8, 32]),
    k=st.sampled_from([1, 3]),
    stride=st.sampled_from([1, 2]),
    cl=st.booleans(),
    bias=st.booleans(),
    seed=st.integers(0, 50),
    kernels=st.sampled_from(["auto", "list"]),
)
def test_native_conv_autograd_matches_dense(N, C, H, O, k, stride, cl, bias, seed, kernels):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, H, H, generator=g)
    if cl:
        x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(O, C, k, k, generator=g)
    b = torch.randn(O, generator=g) if bias else None
    conv_union.KERNELS = kernels  # union kernels where supported (C, O multiples of 16 here), or lists only
    try:
        ys, gs = _grads(lambda x, w, b: relu_conv2d(x, w, b, stride, k // 2), x, w, b)
    finally:
        conv_union.KERNELS = "auto"
    # the reference in float64: PyTorch's float32 CPU conv backward (1x1, stride 2, channels-last input,
    # both gradients) returns a wrong weight gradient in about 1 call in 200 (torch 2.13)
    xd, wd, bd = (None if t is None else t.double() for t in (x, w, b))
    yd, gd = _grads(lambda x, w, b: F.conv2d(x.relu(), w, b, stride, k // 2), xd, wd, bd)
    torch.testing.assert_close(ys, yd.float(), atol=1e-4, rtol=1e-4)
    for a, r in zip(gs, gd):
        if r is not None:
            torch.testing.assert_close(a, r.float(), atol=1e-3, rtol=1e-4)


@settings(max_examples=20, deadline=None)
@given(
    P=st.integers(1, 40),
    K=st.one_of(st.integers(1, 150), st.sampled_from([16, 64, 96])),
    O=st.sampled_from([8, 16, 40, 64]),
    seed=st.integers(0, 50),
    kernels=st.sampled_from(["auto", "list"]),
)
def test_native_linear_autograd_matches_dense(P, K, O, seed, kernels):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(P, K, generator=g)
    w = torch.randn(O, K, generator=g)
    b = torch.randn(O, generator=g)
    conv_union.KERNELS = kernels
    try:
        ys, gs = _grads(lambda x, w, b: relu_linear(x, w, b), x, w, b)
    finally:
        conv_union.KERNELS = "auto"
    yd, gd = _grads(lambda x, w, b: F.linear(x.relu(), w, b), x, w, b)
    torch.testing.assert_close(ys, yd, atol=1e-4, rtol=1e-4)
    for a, r in zip(gs, gd):
        torch.testing.assert_close(a, r, atol=1e-3, rtol=1e-4)


def test_relu_output_input_gives_same_grad_through_relu():
    # the masked input gradient is exact after the ReLU's own backward
    z = torch.randn(2, 8, 5, 5, requires_grad=True)
    w = torch.randn(16, 8, 3, 3)
    relu_conv2d(torch.relu(z), w, padding=1).square().sum().backward()
    z2 = z.detach().clone().requires_grad_(True)
    F.conv2d(torch.relu(z2), w, padding=1).square().sum().backward()
    torch.testing.assert_close(z.grad, z2.grad, atol=1e-3, rtol=1e-4)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="x must be 4-D"):
        relu_conv2d(torch.randn(3, 4), torch.randn(8, 3, 3, 3))
    with pytest.raises(ValueError, match="features"):
        relu_linear(torch.randn(3, 4), torch.randn(8, 5))
