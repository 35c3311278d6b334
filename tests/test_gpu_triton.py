"""sparsa.gpu: Triton kernels checked against the dense reference.

Without CUDA they run on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``): the variable is
set while ``triton`` is first imported (Triton decides then how its own library functions run) and
while this module's tests run, and restored otherwise; sparsa's kernels are decorated lazily per mode,
so nothing leaks into other tests. With CUDA the same tests run the compiled kernels on the GPU.
Shapes are tiny (the interpreter runs every program in Python) and deliberately not tile multiples.
"""

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

DEV = "cuda" if torch.cuda.is_available() else "cpu"
_OLD = os.environ.get("TRITON_INTERPRET")
if DEV == "cpu":
    if "triton" in sys.modules and _OLD != "1":
        pytest.skip(
            "triton was imported before TRITON_INTERPRET=1 could be set; run this file in its own "
            "process (pytest tests/test_gpu_triton.py)",
            allow_module_level=True,
        )
    os.environ["TRITON_INTERPRET"] = "1"
try:
    pytest.importorskip("triton", reason="Triton is not installed (pip install triton); the GPU kernels need it")
finally:
    if _OLD is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _OLD

import sparsa  # noqa: E402
from sparsa.gpu import _triton  # noqa: E402
from sparsa.layouts import BSR, NM, Masked  # noqa: E402
from sparsa.ops import registry  # noqa: E402

FAST = settings(max_examples=12, deadline=None)


CPU_ONLY = pytest.mark.skipif(DEV != "cpu", reason="float64 / CPU-routing checks run under the interpreter")


@pytest.fixture(autouse=True, scope="module")
def _interpret():
    if DEV == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    yield
    if _OLD is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _OLD


def _ws():
    from sparsa.gpu import weight_sparse

    return weight_sparse


def _act():
    from sparsa.gpu import act_sparse

    return act_sparse


def _close(a, b, dtype):
    tol = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2}[dtype]
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(1.0, float(b.abs().max()) if b.numel() else 1.0))


def _block_weight(gen, n, k, bs, density, dtype):
    w = torch.randn(n, k, generator=gen, dtype=torch.float64)
    bh, bw = bs
    keep = torch.rand((n + bh - 1) // bh, (k + bw - 1) // bw, generator=gen) < density
    mask = keep.repeat_interleave(bh, 0).repeat_interleave(bw, 1)[:n, :k]
    return (w * mask).to(dtype)


# ----------------------------------------------------------------------------- block-sparse weight
@FAST
@given(
    m=st.integers(1, 40),
    n=st.integers(1, 50),
    k=st.integers(1, 50),
    density=st.sampled_from([0.0, 0.3, 1.0]),
    bs=st.sampled_from([(16, 16), (16, 32), (32, 16)]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_bsr_kernels_match_dense(m, n, k, density, bs, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    lay = BSR.from_dense(_block_weight(gen, n, k, bs, density, dtype).to(DEV), blocksize=bs)
    x, b, g = (torch.randn(*s, generator=gen).to(dtype).to(DEV) for s in ((m, k), (n,), (m, n)))
    wd = lay.to_dense().double()
    ws = _ws()
    _close(ws.bsr_linear_forward(x, lay, b), x.double() @ wd.T + b.double(), dtype)
    _close(ws.bsr_linear_grad_input(g, lay), g.double() @ wd, dtype)
    _close(ws.bsr_linear_grad_weight(g, x, lay), (g.double().T @ x.double()) * lay.mask(), dtype)


def test_bsr_grad_weight_respects_partial_block_mask():
    w = torch.randn(32, 32, device=DEV)
    mask = (torch.rand(32, 32, generator=torch.Generator().manual_seed(1)) < 0.5).to(DEV)
    lay = BSR.from_dense(w, mask=mask, blocksize=(16, 16))
    x, g = torch.randn(5, 32, device=DEV), torch.randn(5, 32, device=DEV)
    gw = _ws().bsr_linear_grad_weight(g, x, lay)
    assert torch.equal(gw == 0, ~mask | ((g.T @ x) == 0))
    torch.testing.assert_close(gw, (g.T @ x) * mask)


def test_bsr_small_blocks_are_rejected_with_a_fix():
    lay = BSR.from_dense(torch.randn(8, 8), blocksize=(4, 4))
    assert not _ws().bsr_supported(lay)
    with pytest.raises(ValueError, match="blocksize"):
        _ws().bsr_linear_forward(torch.randn(2, 8), lay)


# ----------------------------------------------------------------------------- N:M weight
@FAST
@given(
    m=st.integers(1, 40),
    n=st.integers(1, 40),
    k=st.integers(1, 60),
    nm=st.sampled_from([(2, 4), (1, 4), (2, 8), (3, 5), (1, 16)]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_nm_kernels_match_dense(m, n, k, nm, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    lay = NM.from_dense(torch.randn(n, k, generator=gen).to(dtype).to(DEV), n=nm[0], m=nm[1])
    x, b, g = (torch.randn(*s, generator=gen).to(dtype).to(DEV) for s in ((m, k), (n,), (m, n)))
    wd = lay.to_dense().double()
    ws = _ws()
    _close(ws.nm_linear_forward(x, lay, b), x.double() @ wd.T + b.double(), dtype)
    _close(ws.nm_linear_grad_input(g, lay), g.double() @ wd, dtype)
    _close(ws.nm_linear_grad_weight(g, x, lay), (g.double().T @ x.double()) * lay.mask(), dtype)


def test_weight_kernels_reject_bad_inputs():
    lay = NM.from_dense(torch.randn(8, 16, device=DEV), n=2, m=4)
    with pytest.raises(ValueError, match="reshape"):
        _ws().nm_linear_forward(torch.randn(3, 15, device=DEV), lay)
    with pytest.raises(TypeError, match="dtype"):
        _ws().nm_linear_forward(torch.randn(3, 16, dtype=torch.float64, device=DEV), lay)
    with pytest.raises(TypeError, match="float32"):
        _ws().nm_linear_forward(torch.ones(3, 16, dtype=torch.int32, device=DEV), lay)


# ----------------------------------------------------------------------------- through the dispatcher
@pytest.mark.parametrize("kind", ["bsr", "nm"])
def test_dispatcher_routes_to_triton_and_gradients_match(kind, monkeypatch):
    ws = _ws()
    calls = []
    for name in ("forward", "grad_input", "grad_weight"):
        fn = getattr(ws, f"{kind}_linear_{name}")
        monkeypatch.setattr(ws, f"{kind}_linear_{name}", lambda *a, _fn=fn, _n=name: (calls.append(_n), _fn(*a))[1])
    gen = torch.Generator().manual_seed(0)
    if kind == "bsr":
        dense = _block_weight(gen, 40, 48, (16, 16), 0.5, torch.float32)
        params = {"blocksize": (16, 16)}
    else:
        dense = torch.randn(40, 48, generator=gen)
        params = {"n": 2, "m": 4}
    w0 = dense.to(DEV).requires_grad_()
    w = sparsa.to_sparse(w0, kind, **params)
    x = torch.randn(2, 3, 48, generator=gen).to(DEV).requires_grad_()
    b = torch.randn(40, generator=gen).to(DEV).requires_grad_()
    sparsa.reset_fallback_counts()
    y = F.linear(x, w, b)
    g = torch.randn_like(y)
    y.backward(g)
    assert calls == ["forward", "grad_input", "grad_weight"]
    assert sparsa.fallback_counts() == {}
    wd = w.to_dense().detach()
    mask = w.pattern()
    x2, b2 = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    wd2 = wd.clone().requires_grad_()
    F.linear(x2, wd2, b2).backward(g)
    torch.testing.assert_close(y, F.linear(x2, wd2, b2))
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(b.grad, b2.grad)
    torch.testing.assert_close(w0.grad, wd2.grad * mask)


@CPU_ONLY
def test_dispatcher_uses_cpu_implementation_without_interpreter(monkeypatch):
    ws = _ws()
    monkeypatch.setattr(ws, "bsr_linear_forward", lambda *a: pytest.fail("Triton kernel ran on the CPU path"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    w = sparsa.to_sparse(
        _block_weight(torch.Generator().manual_seed(0), 32, 32, (16, 16), 0.5, torch.float32), "bsr", blocksize=(16, 16)
    )
    x = torch.randn(3, 32)
    torch.testing.assert_close(F.linear(x, w), x @ w.to_dense().T)


@CPU_ONLY
def test_gradcheck_float64_through_dispatcher():
    gen = torch.Generator().manual_seed(3)
    w = sparsa.to_sparse(_block_weight(gen, 20, 18, (16, 16), 0.6, torch.float64), "bsr", blocksize=(16, 16))
    nm = sparsa.to_sparse(torch.randn(5, 9, generator=gen, dtype=torch.float64), "nm", n=1, m=3)
    for wt, k in ((w, 18), (nm, 9)):
        x = torch.randn(2, k, generator=gen, dtype=torch.float64, requires_grad=True)
        b = torch.randn(wt.shape[0], generator=gen, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda x, b, wt=wt: F.linear(x, wt, b), (x, b))


# ----------------------------------------------------------------------------- activation sparsity
def _relu_input(gen, m, k, pattern, dtype):
    z = torch.randn(m, k, generator=gen, dtype=torch.float64)
    if pattern == "dead_channels":
        z[:, torch.rand(k, generator=gen) < 0.7] = -1.0
    elif pattern == "dead_rows":
        z[torch.rand(m, generator=gen) < 0.6] = -1.0
    elif pattern == "all_zero":
        z = -z.abs() - 1
    elif pattern == "dense":
        z = z.abs() + 1
    return z.to(dtype)


def test_compaction_lists_exactly_the_active_columns_and_rows():
    gen = torch.Generator().manual_seed(0)
    a = torch.relu(_relu_input(gen, 37, 70, "dead_channels", torch.float32)).to(DEV)
    c = _act().compact(a, block_m=16, block_k=16)
    for p in range(c.col_counts.shape[0]):
        want = (a[p * 16 : (p + 1) * 16] != 0).any(0).nonzero().flatten().tolist()
        assert c.cols[p, : int(c.col_counts[p])].tolist() == want
    for q in range(c.row_counts.shape[0]):
        want = (a[:, q * 16 : (q + 1) * 16] != 0).any(1).nonzero().flatten().tolist()
        assert c.rows[q, : int(c.row_counts[q])].tolist() == want


@FAST
@given(
    m=st.integers(1, 40),
    n=st.integers(1, 40),
    k=st.integers(1, 70),
    pattern=st.sampled_from(["random", "dead_channels", "dead_rows", "all_zero", "dense"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_act_sparse_linear_forward_backward_match_dense(m, n, k, pattern, dtype, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    z = _relu_input(gen, m, k, pattern, dtype).to(DEV)
    w = torch.randn(n, k, generator=gen).to(dtype).to(DEV)
    b = torch.randn(n, generator=gen).to(dtype).to(DEV) if bias else None
    g = torch.randn(m, n, generator=gen).to(dtype).to(DEV)
    outs = []
    for fn in (_act().act_sparse_linear, F.linear):
        zz, ww = z.clone().requires_grad_(), w.clone().requires_grad_()
        bb = b.clone().requires_grad_() if bias else None
        y = fn(torch.relu(zz), ww, bb)
        y.backward(g)
        outs.append([y, zz.grad, ww.grad] + ([bb.grad] if bias else []))
    for u, v in zip(*outs):
        _close(u, v, dtype)


@pytest.mark.parametrize("stride,padding,dilation", [(1, 0, 1), (2, 1, 1), (1, 2, 2)])
def test_act_sparse_conv2d_forward_backward_match_dense(stride, padding, dilation):
    gen = torch.Generator().manual_seed(stride * 7 + padding)
    z = torch.randn(2, 3, 9, 8, generator=gen)
    z[:, 1] = -1.0
    z, w, b = z.to(DEV), torch.randn(5, 3, 3, 3, generator=gen).to(DEV), torch.randn(5, generator=gen).to(DEV)
    outs = []
    for fn in (_act().act_sparse_conv2d, F.conv2d):
        zz, ww, bb = (t.clone().requires_grad_() for t in (z, w, b))
        y = fn(torch.relu(zz), ww, bb, stride, padding, dilation)
        y.square().sum().backward()
        outs.append((y, zz.grad, ww.grad, bb.grad))
    for u, v in zip(*outs):
        torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-4)


@CPU_ONLY
def test_act_sparse_gradcheck_float64():
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(6, 10, generator=gen, dtype=torch.float64)
    z[z.abs() < 0.05] = 0.5  # keep clear of the ReLU kink for finite differences
    z.requires_grad_()
    w = torch.randn(4, 10, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z, w, b: _act().act_sparse_linear(torch.relu(z), w, b), (z, w, b))


def test_masked_activation_through_dispatcher():
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(2, 7, 24, generator=gen).to(DEV).requires_grad_()
    w = torch.randn(9, 24, generator=gen).to(DEV).requires_grad_()
    a = sparsa.to_sparse(torch.relu(z), "masked")
    assert "ActSparseLinear" in sparsa.ops.explain("linear", Masked, None, needs_grad=True)
    sparsa.reset_fallback_counts()
    y = F.linear(a, w)
    y.square().sum().backward()
    assert sparsa.fallback_counts() == {}
    z2, w2 = z.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y2 = F.linear(torch.relu(z2), w2)
    y2.square().sum().backward()
    torch.testing.assert_close(y, y2)
    torch.testing.assert_close(z.grad, z2.grad)
    torch.testing.assert_close(w.grad, w2.grad)

    x = torch.randn(2, 3, 8, 8, generator=gen).to(DEV).requires_grad_()
    wc = torch.randn(4, 3, 3, 3, generator=gen).to(DEV).requires_grad_()
    yc = F.conv2d(sparsa.to_sparse(torch.relu(x), "masked"), wc, None, 1, 1)
    yc.sum().backward()
    x2, wc2 = x.detach().clone().requires_grad_(), wc.detach().clone().requires_grad_()
    F.conv2d(torch.relu(x2), wc2, None, 1, 1).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(wc.grad, wc2.grad)


@CPU_ONLY
def test_masked_activation_reference_path_off_gpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    z = torch.randn(5, 12, requires_grad=True)
    w = torch.randn(3, 12, requires_grad=True)
    F.linear(sparsa.to_sparse(torch.relu(z), "masked"), w).sum().backward()
    z2, w2 = z.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    F.linear(torch.relu(z2), w2).sum().backward()
    torch.testing.assert_close(z.grad, z2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


# ----------------------------------------------------------------------------- monitor
def test_sampled_density_matches_the_same_sample_in_torch(monkeypatch):
    from sparsa.gpu import monitor

    x = torch.relu(torch.randn(3001, generator=torch.Generator().manual_seed(0))).to(DEV)
    exact = monitor.sampled_density(x, samples=10_000)
    assert float(exact) == pytest.approx(float((x != 0).float().mean()))
    tri = monitor.sampled_counts(x, samples=500, offset=3)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ref = monitor.sampled_counts(x.cpu(), samples=500, offset=3)
    assert tri.tolist() == ref.tolist() and int(ref[1]) == 500


def test_monitor_refreshes_every_k_steps():
    from sparsa.gpu.monitor import SparsityMonitor

    mon = SparsityMonitor(every=2, samples=64)
    assert mon.density is None
    mon.observe(torch.zeros(100, device=DEV))
    assert mon.density == 0.0
    mon.observe(torch.ones(100, device=DEV))  # not due: keeps the old estimate
    assert mon.density == 0.0
    mon.observe(torch.ones(100, device=DEV))
    assert mon.density == 1.0
    with pytest.raises(ValueError, match="every"):
        SparsityMonitor(every=0)


# ----------------------------------------------------------------------------- availability / routing
def test_semi_structured_is_never_used_on_cpu():
    from sparsa.gpu.semi_structured import semi_structured_supported, semi_structured_weight

    ok, why = semi_structured_supported()
    if not torch.cuda.is_available():
        assert not ok and "CUDA" in why
    lay = NM.from_dense(torch.randn(64, 128, dtype=torch.bfloat16), n=2, m=4)
    assert semi_structured_weight(lay) is None


def test_missing_triton_gives_a_clear_reason(monkeypatch):
    monkeypatch.setattr(_triton, "_STATE", {"mod": None, "why": "Triton is not importable (test)"})
    assert not _triton.triton_available()
    assert not _triton.gpu_eligible(torch.randn(2))
    with pytest.raises(ImportError, match="not importable"):
        _triton.require_triton()


def test_device_impl_routes_by_predicate_and_falls_back_to_plain_impl():
    class _Lay(Masked):
        name = "_test_gpu_route"

    calls = []
    registry.register_impl("relu", (_Lay,), lambda ctx, x: calls.append("plain") or torch.relu(x.values))
    registry.register_device_impl(
        "relu",
        (_Lay,),
        lambda ctx, x: calls.append("dev") or torch.relu(x.values),
        applies=lambda x: bool(x.values.sum() > 0),
        name="_test_dev",
    )
    impl = registry.lookup("relu", (_Lay,))
    ctx = type("C", (), {})()
    impl.forward(ctx, _Lay(torch.ones(2), torch.ones(2, dtype=torch.bool)))
    impl.forward(ctx, _Lay(-torch.ones(2), torch.ones(2, dtype=torch.bool)))
    assert calls == ["dev", "plain"]
    assert not impl.has_backward
