"""``sparsa::sliced_ell_linear``, ``sparsa::grouped_nm_spmm`` and ``sparsa::grouped_nm_sddmm`` as first-class ops:
``opcheck`` (float32, bfloat16), ``gradcheck`` in float64 (the reference path), gradients of the native kernels
(``SPARSA_ISA=avx2``) and of the fallback (``SPARSA_NO_NATIVE=1``) against dense autograd, and
``torch.compile(backend="aot_eager")`` forward + backward through the ops against eager."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from sparsa import cpu
from sparsa.kernels import grouped_nm as gk
from sparsa.kernels import sliced_ell as se
from sparsa.layouts import GroupedNM, SlicedELL

BF = torch.bfloat16
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, BF], ids=["f32", "bf16"])
SPMM = torch.ops.sparsa.grouped_nm_spmm.default
SDDMM = torch.ops.sparsa.grouped_nm_sddmm.default
SE = torch.ops.sparsa.sliced_ell_linear.default


@pytest.fixture
def path(request, monkeypatch):
    """``avx2``: the native kernels with the AVX2 pieces; ``fallback``: the pure-PyTorch reference."""
    monkeypatch.delenv("SPARSA_NO_AVX512", raising=False)
    if request.param == "fallback":
        monkeypatch.setenv("SPARSA_NO_NATIVE", "1")
        assert se.native_library() is None and gk.native_library() is None
        return request.param
    monkeypatch.delenv("SPARSA_NO_NATIVE", raising=False)
    if cpu.ISA_LEVELS.index(cpu.hardware_isa()) < cpu.ISA_LEVELS.index("avx2"):
        pytest.skip("this CPU has no avx2/fma")
    monkeypatch.setenv("SPARSA_ISA", "avx2")
    assert cpu.isa() == "avx2"
    assert se.native_library() is not None, "native sliced_ell kernel failed to build"
    assert gk.native_library() is not None, "native grouped_nm kernel failed to build"
    return request.param


def _close(got, want, dtype=torch.float32):
    """``got`` (of ``dtype``) against a float32/float64 reference, relative to the reference's scale."""
    assert got.dtype == dtype and got.shape == want.shape
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2  # bf16: rounded operands and outputs
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol * scale)


# ---------------------------------------------------------------------------------------------- SlicedELL
R_SE, K_SE = 9, 40  # odd R: the last slice's second row is missing (its entries feed nothing)


def _se_layout(sparsity, dtype=torch.float32, seed=0, padding_values=False):
    """A SlicedELL layout with padding entries (rows of a slice keep different counts); with
    ``padding_values`` the padding entries get nonzero values (they are parameters of the op like the rest)."""
    gen = torch.Generator().manual_seed(seed)
    lay = SlicedELL.from_dense(torch.randn(R_SE, K_SE, generator=gen, dtype=torch.float64), sparsity=sparsity)
    assert lay.values.numel() > lay.nnz, "the test needs padding entries"
    v = lay.values.clone()
    if padding_values:
        pad = torch.ones(v.numel(), dtype=torch.bool)
        pad[lay._entries()[2]] = False
        v[pad] = torch.randn(int(pad.sum()), generator=gen, dtype=v.dtype)
    return lay.slice_ptr, lay.columns, v.to(dtype)


def _se_rows(slice_ptr):
    """Output row of every entry, spelled out slice by slice (entry j of a slice: row 2s + j % 2)."""
    sp = slice_ptr.tolist()
    rows = torch.empty(sp[-1], dtype=torch.long)
    for s in range(len(sp) - 1):
        j = torch.arange(sp[s + 1] - sp[s])
        rows[sp[s] : sp[s + 1]] = 2 * s + j % 2
    return rows


def _se_dense(slice_ptr, columns, values, R, K):
    """The op as a dense product: every entry (padding too) adds values[e] at (row, column)."""
    rows = _se_rows(slice_ptr)
    w = torch.zeros(2 * (slice_ptr.numel() - 1), K, dtype=values.dtype)
    return w.index_put((rows, columns.long()), values, accumulate=True)[:R]


@pytest.fixture(params=["dense", "sparse"])
def se_branch(request, monkeypatch):
    """The SlicedELL backward's BLAS branch, or its gathered one cut into several small chunks."""
    monkeypatch.setattr(se, "_DENSE_BACKWARD", 0.0 if request.param == "dense" else float("inf"))
    monkeypatch.setattr(se, "_CHUNK", 64)
    return request.param


@pytest.mark.parametrize(
    "dtype,bias",
    [(torch.float32, None), (torch.float32, torch.float32), (BF, None), (BF, BF), (BF, torch.float32)],
    ids=["f32", "f32-bias", "bf16", "bf16-bias", "bf16-f32bias"],
)
def test_sliced_ell_opcheck(dtype, bias):
    sp, cols, v = _se_layout(0.8, dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, K_SE, generator=gen).to(dtype).requires_grad_()
    b = None if bias is None else torch.randn(R_SE, generator=gen).to(bias).requires_grad_()
    torch.library.opcheck(SE, (x, sp, cols, v.requires_grad_(), b, R_SE))


@pytest.mark.parametrize("bias", [False, True])
def test_sliced_ell_gradcheck(se_branch, bias):
    # float64 runs the reference forward; nonzero padding values make them count in grad_x too
    sp, cols, v = _se_layout(0.85, torch.float64, seed=2, padding_values=True)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 2, K_SE, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(R_SE, generator=gen, dtype=torch.float64, requires_grad=True) if bias else None
    fn = lambda x, v, b: se.sliced_ell_linear(x, sp, cols, v, b, R_SE)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, v.requires_grad_(), b), fast_mode=True)


@pytest.mark.parametrize("path", ["avx2", "fallback"], indirect=True)
@DTYPES
def test_sliced_ell_gradients_match_dense_autograd(path, se_branch, dtype):
    sp, cols, v0 = _se_layout(0.9, dtype, seed=4, padding_values=True)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 7, K_SE, generator=gen).to(dtype).requires_grad_()
    v = v0.clone().requires_grad_()
    b = torch.randn(R_SE, generator=gen).to(dtype).requires_grad_()
    y = se.sliced_ell_linear(x, sp, cols, v, b, R_SE)
    gy = torch.randn(y.shape, generator=gen).to(dtype)
    got = torch.autograd.grad(y, (x, v, b), gy)
    # dense autograd on the same (rounded) operands, float32 (float64 for the bf16 run)
    rd = torch.float32 if dtype == torch.float32 else torch.float64
    xr, vr, br = (t.detach().to(rd).requires_grad_() for t in (x, v, b))
    yr = F.linear(xr, _se_dense(sp, cols, vr, R_SE, K_SE), br)
    _close(y, yr.detach(), dtype)
    want = torch.autograd.grad(yr, (xr, vr, br), gy.to(rd))
    for g, w in zip(got, want):
        _close(g, w, dtype)
    assert not got[1][_se_rows(sp) >= R_SE].any()  # entries of the missing row feed nothing


# -------------------------------------------------------------------------------------------- GroupedNM
# (plan kind, n, m, R, K): a pattern plan (n = 2), interleaved forward plans (1:4: Q = 2 rows per group; 1:3: Q = 3),
# a block-pair plan (odd block count: one block paired with zero weights; empty groups between others), the
# input-grad plan (interleaved, its indices are W's rows)
PLANS = [
    ("pattern", 2, 4, 7, 26),
    ("forward", 1, 4, 10, 40),
    ("forward", 1, 3, 11, 23),
    ("pair", 1, 4, 17, 30),
    ("input_grad", 2, 4, 10, 21),
]
PLAN_IDS = [f"{p[0]}-{p[1]}:{p[2]}" for p in PLANS]
_BUILD = {
    "pattern": gk.pattern_plan,
    "forward": gk.forward_plan,
    "input_grad": gk.input_grad_plan,
    "pair": lambda v, c, n, m: gk.pair_plan(v, c, n, m, unit_cols=12),
}  # several units


def _gnm(kind, n, m, R, K, dtype=torch.float32, seed=0):
    """(layout, values leaf, plan built from the leaf, op's in_features, op's out_features)."""
    gen = torch.Generator().manual_seed(seed)
    w = GroupedNM.from_dense(torch.randn(R, K, generator=gen, dtype=torch.float64), n=n, m=m, g=2)
    vals = w.values.to(dtype).requires_grad_()
    plan = _BUILD[kind](vals, w.columns, n, m)  # differentiable in vals: plan.vals is a view/gather of them
    assert (plan.offsets is not None) == (kind == "pair")
    assert plan.interleaved == (kind == "input_grad" or (kind == "forward" and n == 1))
    if kind == "forward":
        assert plan.out_rows.shape[1] > 1
    if kind == "pair":
        start, end = plan.offsets[:, 0], plan.offsets[:, -1]
        assert plan.units > 1 and ((start == end) & (start < plan.idx.numel())).any()
    fin, fout = (R, K) if kind == "input_grad" else (K, R)
    return w, vals, plan, fin, fout


def _spmm_args(plan, x, vals, bias, out_features):
    return (
        x,
        plan.idx,
        vals,
        plan.out_rows,
        bias,
        out_features,
        plan.units,
        plan.unit_entries,
        plan.unit_span,
        plan.gpb,
        plan.rpb,
        plan.interleaved,
        plan.offsets,
    )


def _sddmm_args(plan, x, gy):
    return (x, gy, plan.idx, plan.out_rows, plan.units, plan.unit_entries, plan.unit_span, plan.out_pad)


@DTYPES
@pytest.mark.parametrize("plan_kind", PLANS, ids=PLAN_IDS)
def test_grouped_nm_spmm_opcheck(plan_kind, dtype):
    _, _, plan, fin, fout = _gnm(*plan_kind, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, fin, generator=gen).to(dtype).requires_grad_()
    v = plan.vals.detach().requires_grad_()
    b = torch.randn(fout, generator=gen).to(dtype).requires_grad_()
    torch.library.opcheck(SPMM, _spmm_args(plan, x, v, b, fout))
    if plan_kind[0] == "pattern":
        torch.library.opcheck(SPMM, _spmm_args(plan, x, v, None, fout))
        torch.library.opcheck(SPMM, _spmm_args(plan, x, v, b.detach().float(), fout))


@DTYPES
def test_grouped_nm_sddmm_opcheck(dtype):
    w, _, plan, fin, fout = _gnm("pattern", 2, 4, 7, 26, dtype)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, fin, generator=gen).to(dtype).requires_grad_()
    gy = torch.randn(5, fout, generator=gen).to(dtype).requires_grad_()
    torch.library.opcheck(SDDMM, _sddmm_args(plan, x, gy))
    torch.library.opcheck(SDDMM, _sddmm_args(plan, x.detach(), gy.detach()))


@pytest.mark.parametrize("plan_kind", PLANS, ids=PLAN_IDS)
def test_grouped_nm_spmm_gradcheck(plan_kind):
    _, _, plan, fin, fout = _gnm(*plan_kind, dtype=torch.float64, seed=3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 2, fin, generator=gen, dtype=torch.float64, requires_grad=True)
    v = plan.vals.detach().requires_grad_()
    b = torch.randn(fout, generator=gen, dtype=torch.float64, requires_grad=True)
    fn = lambda x, v, b: gk.grouped_nm_spmm(*_spmm_args(plan, x, v, b, fout))  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, v, b), fast_mode=True)


def test_grouped_nm_sddmm_gradcheck_and_spmm_gradgradcheck():
    # sddmm is the values-gradient of spmm (pattern plans), so its own autograd makes spmm twice differentiable
    _, _, plan, fin, fout = _gnm("pattern", 2, 4, 7, 26, torch.float64, seed=5)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, fin, generator=gen, dtype=torch.float64, requires_grad=True)
    gy = torch.randn(3, fout, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, gy: gk.grouped_nm_sddmm(*_sddmm_args(plan, x, gy)), (x, gy))
    v = plan.vals.detach().requires_grad_()
    fn = lambda x, v: gk.grouped_nm_spmm(*_spmm_args(plan, x, v, None, fout))  # noqa: E731
    assert torch.autograd.gradgradcheck(fn, (x, v), fast_mode=True)


@pytest.mark.parametrize("path", ["avx2", "fallback"], indirect=True)
@DTYPES
@pytest.mark.parametrize("plan_kind", PLANS, ids=PLAN_IDS)
def test_grouped_nm_spmm_gradients_match_dense_autograd(path, plan_kind, dtype):
    """Layout values -> plan -> op; against F.linear on the dense weight (grad_W on the kept pattern)."""
    w, vals, plan, fin, fout = _gnm(*plan_kind, dtype=dtype, seed=7)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 9, fin, generator=gen).to(dtype).requires_grad_()
    b = torch.randn(fout, generator=gen).to(dtype).requires_grad_()
    y = gk.grouped_nm_spmm(*_spmm_args(plan, x, plan.vals, b, fout))
    gy = torch.randn(y.shape, generator=gen).to(dtype)
    gx, gvals, gb = torch.autograd.grad(y, (x, vals, b), gy)
    rd = torch.float32 if dtype == torch.float32 else torch.float64
    wd = GroupedNM(vals.detach().to(rd), w.columns, w.shape, w.n, w.m, w.g).to_dense().requires_grad_()
    xr, br = x.detach().to(rd).requires_grad_(), b.detach().to(rd).requires_grad_()
    wt = wd.t() if plan_kind[0] == "input_grad" else wd  # the input-grad plan computes x @ W
    yr = F.linear(xr, wt, br)
    _close(y, yr.detach(), dtype)
    gxr, gwr, gbr = torch.autograd.grad(yr, (xr, wd, br), gy.to(rd))
    _close(gx, gxr, dtype)
    _close(gb, gbr, dtype)
    assert gvals.dtype == dtype
    _close(w._scatter(gvals), gwr.to(dtype) * w.mask(), dtype)


@pytest.mark.parametrize("path", ["avx2"], indirect=True)
def test_grouped_nm_ops_accept_noncontiguous_indices(path):
    # the native kernels read idx / out_rows through raw pointers: strided index tensors are copied first
    _, _, plan, fin, fout = _gnm("pattern", 2, 4, 7, 26, seed=12)
    gen = torch.Generator().manual_seed(13)
    x, gy = torch.randn(5, fin, generator=gen), torch.randn(5, fout, generator=gen)
    idx, rows = plan.idx.t().contiguous().t(), plan.out_rows.t().contiguous().t()
    assert not idx.is_contiguous() and not rows.is_contiguous()
    v = plan.vals.detach()
    want = gk.spmm_reference(x, plan, None, fout).detach()
    _close(gk.grouped_nm_spmm(x, idx, v, rows, None, fout, *_spmm_args(plan, x, v, None, fout)[6:]), want)
    _close(gk.grouped_nm_sddmm(x, gy, idx, rows, *_sddmm_args(plan, x, gy)[4:]), gk.sddmm_reference(x, gy, plan))


# ---------------------------------------------------------------------------------------------- compile
def _compiled_matches_eager(fn, inputs):
    """forward + backward of ``fn`` under torch.compile(aot_eager, fullgraph) equal eager's."""

    def run(f):
        leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        y = f(*leaves)
        gy = torch.linspace(-1, 1, y.numel(), dtype=torch.float32).reshape(y.shape).to(y.dtype)
        grads = torch.autograd.grad(y, [t for t in leaves if t.requires_grad], gy)
        return y, grads

    torch._dynamo.reset()
    y, grads = run(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yc, gradsc = run(torch.compile(fn, backend="aot_eager", fullgraph=True))
    torch.testing.assert_close(yc, y)
    for g, gc in zip(grads, gradsc):
        torch.testing.assert_close(gc, g)


@DTYPES
def test_compile_sliced_ell_linear(dtype):
    sp, cols, v = _se_layout(0.8, dtype)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(4, K_SE, generator=gen).to(dtype).requires_grad_()
    b = torch.randn(R_SE, generator=gen).to(dtype).requires_grad_()
    fn = lambda x, v, b: torch.ops.sparsa.sliced_ell_linear(x, sp, cols, v, b, R_SE).relu()  # noqa: E731
    _compiled_matches_eager(fn, (x, v.requires_grad_(), b))


@pytest.mark.parametrize("plan_kind", [PLANS[1], PLANS[3]], ids=[PLAN_IDS[1], PLAN_IDS[3]])
def test_compile_grouped_nm_spmm(plan_kind):
    _, _, plan, fin, fout = _gnm(*plan_kind)
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(5, fin, generator=gen, requires_grad=True)
    b = torch.randn(fout, generator=gen, requires_grad=True)

    def fn(x, v, b):
        return torch.ops.sparsa.grouped_nm_spmm(*_spmm_args(plan, x, v, b, fout)).relu()

    _compiled_matches_eager(fn, (x, plan.vals.detach().requires_grad_(), b))


def test_compile_grouped_nm_sddmm():
    _, _, plan, fin, fout = _gnm("pattern", 2, 4, 7, 26)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(6, fin, generator=gen, requires_grad=True)
    gy = torch.randn(6, fout, generator=gen, requires_grad=True)

    def fn(x, gy):
        return torch.ops.sparsa.grouped_nm_sddmm(*_sddmm_args(plan, x, gy)) * 2

    _compiled_matches_eager(fn, (x, gy))


# ---------------------------------------------------------------------------------------------- GELU epilogue
@pytest.mark.parametrize("path", ["avx2", "fallback"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features", [1, 7, 40])
def test_sliced_ell_gelu_epilogue_matches_float64(monkeypatch, path, dtype, out_features):
    from sparsa import cpu

    if path == "fallback":
        monkeypatch.setenv("SPARSA_NO_NATIVE", "1")
    elif cpu.hardware_isa() == "portable":
        pytest.skip("this CPU has no avx2/fma")
    else:
        monkeypatch.setenv("SPARSA_ISA", path)
    gen = torch.Generator().manual_seed(out_features)
    w = SlicedELL.from_dense(torch.randn(out_features, 50, generator=gen), sparsity=0.8)
    v = w.values.to(dtype)
    for tokens in (1, 9, 40):
        x = torch.randn(tokens, 50, generator=gen).to(dtype)
        b = torch.randn(out_features, generator=gen).to(dtype)
        y = se.sliced_ell_linear(x, w.slice_ptr, w.columns, v, b, out_features, "gelu")
        wd = SlicedELL(w.slice_ptr, w.columns, v, w.row_nnz, w.shape, validate=False).to_dense().double()
        ref = F.gelu(F.linear(x.double(), wd, b.double()))
        tol = 2e-6 if dtype == torch.float32 else 8e-3
        assert y.dtype == dtype
        assert ((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item() <= tol


def test_sliced_ell_gelu_gradcheck_and_opcheck():
    gen = torch.Generator().manual_seed(4)
    w = SlicedELL.from_dense(torch.randn(9, 12, generator=gen), sparsity=0.6)
    x = torch.randn(3, 12, dtype=torch.float64, generator=gen, requires_grad=True)
    v = w.values.double().requires_grad_()
    b = torch.randn(9, dtype=torch.float64, generator=gen, requires_grad=True)
    fn = lambda x, v, b: se.sliced_ell_linear(x, w.slice_ptr, w.columns, v, b, 9, "gelu")  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, v, b))
    xf = x.detach().float().requires_grad_()
    torch.library.opcheck(
        torch.ops.sparsa.sliced_ell_linear.default,
        (xf, w.slice_ptr, w.columns, w.values.clone().requires_grad_(), b.detach().float(), 9, "gelu"),
    )
    with pytest.raises(ValueError, match="activation must be one of"):
        se.sliced_ell_linear_impl(xf.detach(), w.slice_ptr, w.columns, w.values, None, 9, "swish")
