"""Sparse operands under ``torch.autocast``: cast as autocast casts dense ones, gradients back in fp32."""

import pytest
import torch
import torch.nn.functional as F

import sparsa
from sparsa.ops import autocast as ac
from sparsa.ops import dispatch

BF = torch.bfloat16


def _weight(layout, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(24, 32, generator=gen)
    if layout == "nm":
        return sparsa.to_sparse(dense, "nm", n=2, m=4)
    if layout == "grouped_nm":
        return sparsa.to_sparse(dense, "grouped_nm", n=1, m=4, g=4)
    if layout == "row_group":
        return sparsa.to_sparse(dense, "row_group", sparsity=0.5, group=4)
    if layout == "bsr":
        keep = (torch.rand(6, 8, generator=gen) < 0.5).repeat_interleave(4, 0).repeat_interleave(4, 1)
        return sparsa.to_sparse(dense, "bsr", blocksize=(4, 4), mask=keep)
    return sparsa.to_sparse(dense, layout, mask=torch.rand(24, 32, generator=gen) < 0.5)


LAYOUTS = ["masked", "sliced_ell", "bitmask", "nm", "grouped_nm", "row_group", "csr", "coo", "bsr"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("x_dtype", [torch.float32, BF])
def test_linear_matches_dense_autocast(layout, x_dtype):
    w = _weight(layout).requires_grad_(True)
    dense_w = w.sparse_layout.to_dense().clone().requires_grad_(True)
    bias = torch.randn(24, requires_grad=True)
    x = torch.randn(5, 32).to(x_dtype)
    g = torch.randn(5, 24)
    with torch.autocast("cpu", dtype=BF):
        y = F.linear(x, w, bias)
        want = F.linear(x, dense_w, bias)
    assert y.dtype == want.dtype == BF
    torch.testing.assert_close(y.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    y.float().backward(g)
    want.float().backward(g)
    gw = w.grad.to_dense() if isinstance(w.grad, sparsa.SparseTensor) else w.grad
    assert gw.dtype == torch.float32  # the master weight's dtype, as autocast's cast returns it
    mask = w.sparse_layout.mask()
    scale = float(dense_w.grad.abs().max())
    torch.testing.assert_close(gw * mask, dense_w.grad * mask, rtol=3e-2, atol=3e-2 * scale)


@pytest.mark.parametrize("layout", ["masked", "sliced_ell"])
def test_matmul_and_mm_under_autocast(layout):
    w = _weight(layout)
    x = torch.randn(32, 7)
    with torch.autocast("cpu", dtype=BF):
        for y in (torch.matmul(w, x), torch.mm(w, x), w @ x):
            assert y.dtype == BF
            want = w.sparse_layout.to_dense().double() @ x.double()
            torch.testing.assert_close(y.double(), want, rtol=3e-2, atol=3e-2 * float(want.abs().max()))


def test_a_float32_only_layout_runs_in_float32_and_returns_autocast_dtype(monkeypatch):
    w = _weight("csr")
    x = torch.randn(3, 32).to(BF)
    seen = []
    real = ac._cast

    def spy(a, dtype):
        seen.append(dtype)
        return real(a, dtype)

    monkeypatch.setattr(ac, "_cast", spy)
    with torch.autocast("cpu", dtype=BF):
        y = F.linear(x, w)
    assert y.dtype == BF and set(seen) == {torch.float32}
    want = x.double() @ w.sparse_layout.to_dense().double().T
    torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def test_relu_compact_conv_under_autocast():
    z = torch.randn(2, 8, 6, 6)
    a = sparsa.to_sparse(z, "relu_compact")
    wt = torch.randn(16, 8, 3, 3)
    with torch.autocast("cpu", dtype=BF):
        y = F.conv2d(a, wt, padding=1)
        want = F.conv2d(z.relu(), wt, padding=1)
    assert y.dtype == want.dtype == BF
    torch.testing.assert_close(y.float(), want.float(), rtol=3e-2, atol=3e-2 * float(want.abs().max()))


def test_operands_already_in_autocast_dtype_are_not_cast_again(monkeypatch):
    w = sparsa.to_sparse(torch.randn(8, 16).to(BF), "sliced_ell", sparsity=0.5)
    calls = []
    monkeypatch.setattr(dispatch, "run_under_autocast", lambda *a: calls.append(a))
    with torch.autocast("cpu", dtype=BF):
        y = F.linear(torch.randn(2, 16).to(BF), w)
    assert y.dtype == BF and calls == []


def test_float64_operands_are_left_as_autocast_leaves_them():
    w = sparsa.to_sparse(torch.randn(8, 16, dtype=torch.float64), "masked", mask=torch.rand(8, 16) < 0.5)
    x = torch.randn(3, 16, dtype=torch.float64)
    with torch.autocast("cpu", dtype=BF):
        y = F.linear(x, w)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, x @ w.sparse_layout.to_dense().T)


def test_mixed_dtypes_outside_autocast_are_still_an_error():
    w = _weight("sliced_ell")
    with pytest.raises(TypeError, match="same dtype"):
        F.linear(torch.randn(2, 32).to(BF), w)


def test_a_sparse_model_trains_under_autocast():
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    sparsa.sparsify(model, [sparsa.Rule(sparsifier=sparsa.sparsifiers.Magnitude(0.5), layout="masked")])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(64, 32)
    target = x[:, :4] * 2.0  # learnable by the sparse model
    losses = []
    for _ in range(40):
        with torch.autocast("cpu", dtype=BF):
            loss = F.mse_loss(model(x).float(), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert model[0].weight.dtype == torch.float32 and losses[-1] < 0.5 * losses[0]
