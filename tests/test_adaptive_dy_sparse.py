"""The input gradient of relu_conv2d over the nonzeros of dY (stride 1): a forward conv of the
compacted dY with the flipped, transposed weight, masked by relu(x)'s nonzeros; the signed compaction
it reads; the cached flipped weight pack; and the rule in relu_conv2d's backward that picks the path."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from sparsa.adaptive import conv as M
from sparsa.adaptive import conv_union
from sparsa.adaptive import relu_conv2d
from sparsa.kernels import adaptive as K, loader


@pytest.fixture(autouse=True)
def _list_kernels(monkeypatch):
    """These tests cover the list kernels' dY path: keep relu_conv2d off the union kernels."""
    monkeypatch.setattr(conv_union, "KERNELS", "list")


@pytest.fixture(params=["native", "fallback"])
def backend(request, monkeypatch):
    if request.param == "fallback":
        monkeypatch.setenv("SPARSA_NO_NATIVE", "1")
    else:
        monkeypatch.delenv("SPARSA_NO_NATIVE", raising=False)
        assert K.native_available(), "native adaptive kernels failed to build"
    return request.param


def _native_only():
    if not loader.native_enabled():
        pytest.skip("SPARSA_NO_NATIVE is set; the dY path is native-only")
    assert K.native_available(), "native adaptive kernels failed to build"


@pytest.fixture
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


def _sparse(shape, zeros, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=dtype)
    return t * (torch.rand(shape, generator=g) >= zeros).to(dtype)


def _entries(cnt, idx, val, shape, slice):
    """The (pixel, channel) -> value map an operand encodes, as dense [P, C] values and a kept mask."""
    N, C, H, W = shape
    P, S = N * H * W, -(-C // slice)
    vals = torch.zeros(P, C, dtype=val.dtype)
    kept = torch.zeros(P, C, dtype=torch.bool)
    c = cnt.reshape(P, S)
    for q in range(P):
        for s in range(S):
            base = q * C + s * slice
            ii = idx[base : base + int(c[q, s])].long()
            assert torch.all(ii[1:] > ii[:-1]), "channel indices ascend within a slice"
            assert torch.all((ii >= s * slice) & (ii < min(C, (s + 1) * slice)))
            vals[q, ii] = val[base : base + int(c[q, s])]
            kept[q, ii] = True
    return vals, kept


# ------------------------------------------------------------------------------------ signed compaction
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided"])
@pytest.mark.parametrize("C,slice", [(5, 8), (24, 8), (40, 16), (70, 64)])
def test_compact_signed_matches_reference(backend, layout, C, slice):
    # keeps every element != 0: negatives, +-inf and NaN; -0.0 == 0 is dropped like +0.0
    x = _sparse((2, C, 3, 5), 0.5, C)
    flat = x.view(-1)
    flat[::7] = -flat[::7].abs() - 0.5
    flat[1::11] = -0.0
    flat[2::13] = float("nan")
    flat[3::17] = float("-inf")
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "strided":
        x = torch.zeros(2, C, 3, 10).copy_(x.repeat_interleave(2, dim=3))[..., ::2]
    cnt, idx, val = K.compact_signed(x, slice)
    rc, ri, rv = K._compact_reference(x, slice, signed=True)
    assert torch.equal(cnt, rc)
    xh = x.permute(0, 2, 3, 1).reshape(-1, C)
    keep = (xh != 0) | xh.isnan()
    assert int(cnt.sum()) == int(keep.sum())
    vals, kept = _entries(cnt, idx, val, x.shape, slice)
    assert torch.equal(kept, keep)
    torch.testing.assert_close(vals, torch.where(keep, xh, torch.zeros(())), equal_nan=True, rtol=0, atol=0)
    # the ReLU compaction is unchanged: only x > 0 (NaN, -0.0 and negatives dropped)
    pc, pi, pv = K.compact(x, slice)
    _, kept_pos = _entries(pc, pi, pv, x.shape, slice)
    assert torch.equal(kept_pos, xh > 0)


def test_compact_signed_all_zero_and_empty(backend):
    cnt, _, _ = K.compact_signed(torch.zeros(2, 16, 3, 3), 8)
    assert int(cnt.sum()) == 0
    cnt, idx, val = K.compact_signed(torch.zeros(0, 16, 3, 3), 8)
    assert cnt.numel() == 0


# ------------------------------------------------------------------------------------ the dY-path kernel
CASES = list(itertools.product([0, 1, 2], [1, 2], [1, 3, 5]))  # padding, dilation, kernel


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("cl", [True, False])
@pytest.mark.parametrize("dy_zeros", [0.0, 0.5, 0.9, 1.0])
def test_conv_igrad_dy_matches_dense(threads, cl, dy_zeros):
    _native_only()
    N, C, H, W, O = 2, 16, 9, 8, 24
    for p, d, k in CASES:
        if H + 2 * p < d * (k - 1) + 1 or W + 2 * p < d * (k - 1) + 1:
            continue
        x = _sparse((N, C, H, W), 0.0, k + 10 * p + 100 * d)
        x = x - 0.3
        if cl:
            x = x.contiguous(memory_format=torch.channels_last)
        w = torch.randn(O, C, k, k, generator=torch.Generator().manual_seed(k))
        geo = K.geometry(x.shape, w.shape, (1, 1), (p, p), (d, d), 8)
        dyn = _sparse((N, O, geo.Ho, geo.Wo), dy_zeros, p + d + k)
        cnt, idx, _ = K.compact(x, 8)
        gc, gi, gv = K.compact_signed(dyn, 16)
        dx = K.conv_igrad_dy(gc, gi, gv, K.packed_weight_flipped(w), cnt, idx, geo, 16, cl)
        ref = torch.nn.grad.conv2d_input(x.shape, w, dyn, padding=p, dilation=d) * (x > 0)
        torch.testing.assert_close(dx, ref, atol=1e-4, rtol=1e-4, msg=f"p={p} d={d} k={k}")
        assert dx.is_contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)


@pytest.mark.parametrize("p,d,k", CASES)
def test_igrad_dy_geometry_float64(backend, p, d, k):
    # the identity behind the dY path, in float64 through the pure-PyTorch ops (the fallback's conv_fwd):
    # dx = conv2d(dY, W.transpose(0, 1).flip(2, 3), padding=d*(k-1)-p, dilation=d), masked by x > 0
    N, C, H, W, O = 2, 3, 7, 6, 5
    if min(H, W) + 2 * p < d * (k - 1) + 1:
        return
    g = torch.Generator().manual_seed(p + d + k)
    x = torch.randn(N, C, H, W, dtype=torch.float64, generator=g)
    w = torch.randn(O, C, k, k, dtype=torch.float64, generator=g)
    geo = K.geometry(x.shape, w.shape, (1, 1), (p, p), (d, d), 4)
    dyn = _sparse((N, O, geo.Ho, geo.Wo), 0.5, k, dtype=torch.float64)
    g2 = K.igrad_dy_geometry(geo, 4)
    assert (g2.Ho, g2.Wo) == (H, W)
    gc, gi, gv = K._compact_reference(dyn, 4, signed=True)
    wflip = w.transpose(0, 1).flip(2, 3)
    if g2.ph >= 0:  # the conv_fwd op (float64: its pure-PyTorch path) with the dY geometry
        y = K.conv_fwd(gc, gi, gv, wflip.permute(2, 3, 1, 0).contiguous(), None, g2)
    else:  # negative padding': a crop of the unpadded conv
        q = -g2.ph
        y = F.conv2d(K.densify(gc, gi, gv, g2), wflip, dilation=d)[:, :, q : q + H, q : q + W].permute(0, 2, 3, 1)
    ref = torch.nn.grad.conv2d_input(x.shape, w, dyn, padding=p, dilation=d)
    torch.testing.assert_close(y.permute(0, 3, 1, 2) * (x > 0), ref * (x > 0), atol=1e-10, rtol=1e-10)


# ------------------------------------------------------------------------------------ flipped weight pack
def test_flipped_pack_is_cached_and_repacked_after_update():
    _native_only()
    w = torch.nn.Parameter(torch.randn(16, 8, 3, 3))
    a = K.packed_weight_flipped(w)
    assert K.packed_weight_flipped(w) is a  # no re-pack while the weight is unchanged
    wf_ref, _ = K.packed_weight(w.detach().transpose(0, 1).flip(2, 3).contiguous())
    assert torch.equal(a, wf_ref)
    with torch.no_grad():
        w.mul_(-2.0)  # an in-place optimizer step: a new version
    b = K.packed_weight_flipped(w)
    assert b is not a
    torch.testing.assert_close(b, -2.0 * a)
    assert K.packed_weight_flipped(w) is b
    wid = id(w)
    del w
    assert wid not in K._FLIP_PACKS  # the entry goes away with its weight


# ------------------------------------------------------------------------------------ relu_conv2d backward
def _grads(f, x, w, b, gy):
    ts = [t.detach().clone().requires_grad_(True) for t in (x, w, b)]
    f(*ts).backward(gy)
    return [t.grad for t in ts]


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("C,O", [(16, 24), (8, 8), (12, 16), (16, 12)])
@pytest.mark.parametrize("force", ["dy", "x"])
def test_relu_conv2d_grads_match_dense(backend, threads, monkeypatch, C, O, force):
    # force the rule either way (C % 8 != 0 keeps the x path; O % 8 != 0 is not the packed path at all)
    monkeypatch.setattr(M, "_DY_MARGIN", 1e9 if force == "dy" else 0.0)
    monkeypatch.setattr(M, "_DY_MARGIN_WITH_DW", 1e9 if force == "dy" else 0.0)
    native = backend == "native"
    for (p, d, k), cl, dy_zeros in itertools.product(
        [(1, 1, 3), (0, 2, 3), (2, 1, 5), (2, 1, 1)], [True, False], [0.0, 0.5, 0.9, 1.0]
    ):
        x = _sparse((2, C, 7, 6), 0.0, C + O + k) - 0.2
        if cl:
            x = x.contiguous(memory_format=torch.channels_last)
        w = torch.randn(O, C, k, k, generator=torch.Generator().manual_seed(p))
        b = torch.randn(O)
        Ho = 7 + 2 * p - d * (k - 1)
        Wo = 6 + 2 * p - d * (k - 1)
        gy = _sparse((2, O, Ho, Wo), dy_zeros, d + k)
        before = M.backward_paths.copy()
        gs = _grads(lambda x, w, b: relu_conv2d(x, w, b, 1, p, d, slice=8), x, w, b, gy)
        rs = _grads(lambda x, w, b: F.conv2d(x.relu(), w, b, 1, p, d), x, w, b, gy)
        for a, r, name in zip(gs, rs, "xwb"):
            torch.testing.assert_close(a, r, atol=1e-4, rtol=1e-4, msg=f"d{name} p={p} d={d} k={k} cl={cl}")
        dy_taken = M.backward_paths["dy"] - before["dy"]
        x_taken = M.backward_paths["x"] - before["x"]
        expect_dy = native and force == "dy" and C % 8 == 0 and O % 8 == 0
        assert dy_taken == int(expect_dy)
        assert x_taken == int(native and O % 8 == 0 and not expect_dy)


def test_weight_updated_between_forward_and_backward_keeps_x_path(monkeypatch):
    # the flipped pack would read the new values: the x path (weight packed at forward) runs instead
    _native_only()
    monkeypatch.setattr(M, "_DY_MARGIN", 1e9)
    monkeypatch.setattr(M, "_DY_MARGIN_WITH_DW", 1e9)
    x = (torch.randn(2, 16, 6, 6) - 0.2).requires_grad_()
    w = torch.nn.Parameter(torch.randn(16, 16, 3, 3))
    w0 = w.detach().clone()
    y = relu_conv2d(x, w, None, padding=1)
    gy = _sparse(y.shape, 0.9, 3)
    with torch.no_grad():
        w.add_(1.0)
    before = M.backward_paths.copy()
    y.backward(gy)
    assert M.backward_paths["dy"] == before["dy"] and M.backward_paths["x"] == before["x"] + 1
    ref = torch.nn.grad.conv2d_input(x.shape, w0, gy, padding=1) * (x > 0)
    torch.testing.assert_close(x.grad, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("need_dw", [False, True])
def test_rule_picks_dy_path_for_sparse_dy_only(need_dw):
    # the default rule: a 90%-zero dY over a 50%-zero x takes the dY path; a dense dY over a 90%-zero x not
    _native_only()
    w = (torch.randn(64, 64, 3, 3) * 0.05).requires_grad_(need_dw)
    for x_zeros, dy_zeros, expect in ((0.5, 0.9, 1), (0.9, 0.0, 0)):
        x = torch.randn(4, 64, 8, 8).abs() * (torch.rand(4, 64, 8, 8) >= x_zeros)
        x = x.contiguous(memory_format=torch.channels_last).requires_grad_()
        w.grad = None
        y = relu_conv2d(x, w, None, padding=1)
        before = M.backward_paths.copy()
        gy = _sparse(y.shape, dy_zeros, 5)
        y.backward(gy.contiguous(memory_format=torch.channels_last))
        assert M.backward_paths["dy"] - before["dy"] == expect
        assert M.backward_paths["x"] - before["x"] == 1 - expect
        ref = torch.nn.grad.conv2d_input(x.shape, w.detach(), gy, padding=1) * (x > 0)
        torch.testing.assert_close(x.grad, ref, atol=1e-4, rtol=1e-4)
        if need_dw:
            rdw = torch.nn.grad.conv2d_weight(x.detach(), w.shape, gy, padding=1)
            torch.testing.assert_close(w.grad, rdw, atol=1e-3, rtol=1e-4)
        else:
            assert w.grad is None


def test_weight_gradient_only_runs_neither_input_path():
    _native_only()
    x = torch.randn(2, 16, 6, 6)
    w = torch.randn(16, 16, 3, 3, requires_grad=True)
    before = M.backward_paths.copy()
    relu_conv2d(x, w, None, padding=1).backward(_sparse((2, 16, 6, 6), 0.9, 1))
    assert M.backward_paths == before
    torch.testing.assert_close(
        w.grad,
        torch.nn.grad.conv2d_weight(x.relu(), w.shape, _sparse((2, 16, 6, 6), 0.9, 1), padding=1),
        atol=1e-3,
        rtol=1e-4,
    )


def test_gradcheck_float64_fallback():
    # float64 runs the pure-PyTorch ops (the dY path is native float32 only); sparse dY in the
    # function itself (a ReLU after the conv) so gradcheck probes the zeros too
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(8, 8, 3, 3, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(8, dtype=torch.float64, generator=g, requires_grad=True)
    fn = lambda x, w, b: relu_conv2d(x, w, b, 1, 1, 1, slice=8).relu()  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w, b), fast_mode=True)


@pytest.mark.parametrize("cl", [True, False])
def test_nan_and_inf_in_dy_propagate_like_the_x_path(monkeypatch, cl):
    # the signed compaction keeps NaN/inf of dY, so both paths give the same NaN/inf pattern
    _native_only()
    x = torch.randn(2, 16, 6, 6) - 0.2
    if cl:
        x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(16, 16, 3, 3)
    gy = _sparse((2, 16, 6, 6), 0.9, 2)
    gy[0, 3, 2, 2] = float("nan")
    gy[1, 5, 4, 1] = float("inf")
    grads = []
    for margin in (1e9, 0.0):
        monkeypatch.setattr(M, "_DY_MARGIN", margin)
        monkeypatch.setattr(M, "_DY_MARGIN_WITH_DW", margin)
        xr = x.detach().clone().requires_grad_()
        before = M.backward_paths["dy"]
        relu_conv2d(xr, w, None, padding=1).backward(gy)
        assert M.backward_paths["dy"] - before == (margin > 1)
        grads.append(xr.grad)
    assert grads[0].isnan().any() and grads[0].isinf().any()
    torch.testing.assert_close(grads[0], grads[1], atol=1e-4, rtol=1e-4, equal_nan=True)


# ------------------------------------------------------------------------------ dY-driven weight gradient
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("C,O", [(16, 24), (8, 8), (24, 16)])
@pytest.mark.parametrize("nonneg", [False, True])
def test_weight_gradient_over_dy_matches_dense(threads, monkeypatch, C, O, nonneg):
    # dW as the weight gradient of the flipped conv (input dY, "output gradient" relu(x)); forced on
    _native_only()
    monkeypatch.setattr(M, "_DY_MARGIN_WITH_DW", 1e9)
    monkeypatch.setattr(M, "_DW_DY_RATIO", 1e9)
    for (p, d, k), cl, dy_zeros in itertools.product(
        [(1, 1, 3), (0, 2, 3), (2, 1, 5), (0, 1, 1), (2, 1, 1)], [True, False], [0.0, 0.6, 0.95]
    ):
        x = _sparse((3, C, 8, 7), 0.3, C * O + k + p) - (0.0 if nonneg else 0.3)
        if nonneg:
            x = x.relu()
        if cl:
            x = x.contiguous(memory_format=torch.channels_last)
        w = torch.randn(O, C, k, k, generator=torch.Generator().manual_seed(d + k))
        b = torch.randn(O)
        Ho, Wo = 8 + 2 * p - d * (k - 1), 7 + 2 * p - d * (k - 1)
        gy = _sparse((3, O, Ho, Wo), dy_zeros, p + 5 * d)
        before = M.backward_paths_dw.copy()
        gs = _grads(lambda x, w, b: relu_conv2d(x, w, b, 1, p, d, slice=8, nonnegative=nonneg), x, w, b, gy)
        rs = _grads(lambda x, w, b: F.conv2d(x.relu(), w, b, 1, p, d), x, w, b, gy)
        for a, r, name in zip(gs, rs, "xwb"):
            torch.testing.assert_close(a, r, atol=1e-4, rtol=1e-4, msg=f"d{name} p={p} d={d} k={k} cl={cl}")
        # padding > dilation * (k - 1) would crop relu(x) in the flipped conv: that case keeps the x side
        expect = int(p <= d * (k - 1))
        assert M.backward_paths_dw["dy"] - before["dy"] == expect, (p, d, k)


def test_weight_gradient_over_dy_rule_and_inplace_x(monkeypatch):
    _native_only()
    monkeypatch.setattr(M, "_DY_MARGIN_WITH_DW", 1e9)  # dx over dY; dW decided by _DW_DY_RATIO
    x = _sparse((2, 16, 8, 8), 0.5, 1).relu().requires_grad_()
    w = torch.randn(16, 16, 3, 3, requires_grad=True)
    for dy_zeros, expect in ((0.95, 1), (0.0, 0)):  # nnz(dY) * C vs 0.75 * nnz(x) * O
        gy = _sparse((2, 16, 8, 8), dy_zeros, 2)
        before = M.backward_paths_dw.copy()
        relu_conv2d(x, w, None, padding=1, nonnegative=True).backward(gy)
        assert M.backward_paths_dw["dy"] - before["dy"] == expect
    # x changed in place between forward and backward: the dY side would read the new values, so the
    # x side (its compacted copy from the forward) computes dW, and the result is the true gradient
    monkeypatch.setattr(M, "_DW_DY_RATIO", 1e9)
    xa = _sparse((2, 16, 8, 8), 0.5, 3).relu()
    x0 = xa.clone()
    wl = w.detach().clone().requires_grad_()
    y = relu_conv2d(xa, wl, None, padding=1, nonnegative=True)
    xa.mul_(2.0)
    gy = _sparse(y.shape, 0.9, 4)
    before = M.backward_paths_dw.copy()
    y.backward(gy)
    assert M.backward_paths_dw == before
    torch.testing.assert_close(wl.grad, torch.nn.grad.conv2d_weight(x0, wl.shape, gy, padding=1), atol=1e-4, rtol=1e-4)
