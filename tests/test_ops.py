"""The pure-PyTorch operator implementations against the dense reference (forward, backward, dispatch)."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import sparsa
from sparsa.layouts import BSR, COO, CSR, GroupedNM, Masked, NM, grouped_nm_mask, nm_mask
from sparsa.ops import registry

SETTINGS = settings(max_examples=15, deadline=None)

WEIGHTS = [
    (CSR, {}),
    (COO, {}),
    (Masked, {}),
    (BSR, {"blocksize": (2, 3)}),
    (NM, {"n": 2, "m": 4}),
    (GroupedNM, {"n": 2, "m": 4, "g": 2}),
]
WIDS = [c[0].name for c in WEIGHTS]
ODD = st.sampled_from([1, 2, 3, 5, 7, 9, 13])
POINTWISE = [Masked, COO]


def make_mask(layout, params, w):
    if layout is NM:
        return nm_mask(w, params["n"], params["m"])
    if layout is GroupedNM:
        return grouped_nm_mask(w, params["n"], params["m"], params["g"])
    return torch.rand(w.shape) < 0.5


def sparse(w, layout, params, mask):
    return sparsa.to_sparse(w, layout, mask=mask, **params)


def close(got, want):
    """fp32 results agree with the dense reference within 1e-5 relative (of the output's scale)."""
    assert got.shape == want.shape
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)


def dense_input(draw, lead, k, noncontig):
    """A float32 input (*lead, k), optionally a non-contiguous view."""
    if noncontig:
        base = torch.randn(tuple(lead) + (2 * k,))
        return base[..., ::2]
    return torch.randn(tuple(lead) + (k,))


@pytest.fixture(autouse=True)
def _no_fallback_unless_checked():
    sparsa.reset_fallback_counts()
    yield


# ----------------------------------------------------------------------------- linear
@pytest.mark.parametrize("layout,params", WEIGHTS, ids=WIDS)
@SETTINGS
@given(data=st.data())
def test_linear_matches_dense(layout, params, data):
    out_f, in_f = data.draw(ODD), data.draw(st.sampled_from([1, 3, 4, 7, 10, 13]))
    lead = data.draw(st.sampled_from([(), (1,), (5,), (2, 3)]))
    noncontig = data.draw(st.booleans())
    use_bias = data.draw(st.booleans())
    torch.manual_seed(data.draw(st.integers(0, 9999)))
    w = torch.randn(out_f, in_f)
    mask = make_mask(layout, params, w)
    ws = sparse(w, layout, params, mask)
    x = dense_input(data, lead, in_f, noncontig)
    b = torch.randn(out_f) if use_bias else None
    sparsa.reset_fallback_counts()
    close(F.linear(x, ws, b), F.linear(x, ws.to_dense(), b))
    assert sparsa.fallback_counts() == {}


@pytest.mark.parametrize("layout,params", WEIGHTS, ids=WIDS)
@pytest.mark.parametrize("xshape", [(3, 8), (2, 2, 8), (1, 8)])
def test_linear_gradcheck(layout, params, xshape):
    torch.manual_seed(0)
    w0 = torch.randn(5, 8, dtype=torch.float64)
    mask = make_mask(layout, params, w0)
    x = torch.randn(xshape, dtype=torch.float64, requires_grad=True)
    w = w0.clone().requires_grad_()
    b = torch.randn(5, dtype=torch.float64, requires_grad=True)

    def f(x, w, b):
        return F.linear(x, sparse(w, layout, params, mask), b)

    sparsa.reset_fallback_counts()
    assert torch.autograd.gradcheck(f, (x, w, b))
    # input-only gradient (weight frozen): only grad_x is computed
    ws = sparse(w0, layout, params, mask)
    assert torch.autograd.gradcheck(lambda x: F.linear(x, ws), (x,))
    assert sparsa.fallback_counts() == {}
    # the weight gradient is exactly zero outside the stored pattern
    (gw,) = torch.autograd.grad(f(x, w, b).sum(), (w,))
    assert bool((gw[~ws.pattern()] == 0).all())


def test_linear_needs_input_grad_respected():
    torch.manual_seed(0)
    w = torch.randn(6, 8, requires_grad=True)
    x = torch.randn(4, 8)  # no grad for x
    y = F.linear(x, sparsa.to_sparse(w, NM, n=2, m=4))
    y.sum().backward()
    assert w.grad is not None and x.grad is None


def test_linear_rejects_mismatched_input():
    ws = sparsa.to_sparse(torch.randn(3, 4), "csr")
    with pytest.raises(ValueError, match="in_features 4"):
        F.linear(torch.randn(2, 5), ws)


# ----------------------------------------------------------------------------- matmul family
@pytest.mark.parametrize("layout,params", WEIGHTS, ids=WIDS)
@SETTINGS
@given(data=st.data())
def test_matmul_family_matches_dense(layout, params, data):
    r, k, ncols = data.draw(ODD), data.draw(ODD), data.draw(ODD)
    torch.manual_seed(data.draw(st.integers(0, 9999)))
    w = torch.randn(r, k)
    ws = sparse(w, layout, params, make_mask(layout, params, w))
    wd = ws.to_dense()
    lead = data.draw(st.sampled_from([(), (4,), (2, 3)]))
    noncontig = data.draw(st.booleans())
    sparsa.reset_fallback_counts()
    # dense @ sparse (sparse second): x (..., r) @ W (r, k)
    x = dense_input(data, lead, r, noncontig)
    close(torch.matmul(x, ws), torch.matmul(x, wd))
    close(x @ ws, x @ wd)
    # sparse @ dense (sparse first): W (r, k) @ y with y (k,), (k, n) or (b, k, n)
    for y in (torch.randn(k), torch.randn(k, ncols), torch.randn(2, k, ncols), torch.randn(ncols, k).t()):
        close(torch.matmul(ws, y), torch.matmul(wd, y))
    x2 = torch.randn(ncols, r)
    close(torch.mm(x2, ws), x2 @ wd)
    y2 = torch.randn(k, ncols)
    close(torch.mm(ws, y2), wd @ y2)
    inp = data.draw(st.sampled_from(["full", "row"]))
    bias = torch.randn(ncols, k) if inp == "full" else torch.randn(k)
    beta, alpha = data.draw(st.sampled_from([(1, 1), (0.5, 2.0), (0, 1)]))
    close(torch.addmm(bias, x2, ws, beta=beta, alpha=alpha), torch.addmm(bias, x2, wd, beta=beta, alpha=alpha))
    assert sparsa.fallback_counts() == {}


@pytest.mark.parametrize("layout,params", WEIGHTS, ids=WIDS)
def test_matmul_family_gradcheck(layout, params):
    torch.manual_seed(1)
    w0 = torch.randn(4, 7, dtype=torch.float64)
    mask = make_mask(layout, params, w0)
    w = w0.clone().requires_grad_()
    dd = dict(dtype=torch.float64, requires_grad=True)
    sp = lambda w: sparse(w, layout, params, mask)  # noqa: E731
    sparsa.reset_fallback_counts()
    assert torch.autograd.gradcheck(lambda x, w: torch.matmul(x, sp(w)), (torch.randn(2, 2, 4, **dd), w))
    assert torch.autograd.gradcheck(lambda w, y: torch.matmul(sp(w), y), (w, torch.randn(7, 3, **dd)))
    assert torch.autograd.gradcheck(lambda w, y: torch.matmul(sp(w), y), (w, torch.randn(2, 7, 2, **dd)))
    assert torch.autograd.gradcheck(lambda w, y: torch.matmul(sp(w), y), (w, torch.randn(7, **dd)))
    assert torch.autograd.gradcheck(lambda x, w: torch.mm(x, sp(w)), (torch.randn(3, 4, **dd), w))
    assert torch.autograd.gradcheck(lambda w, y: torch.mm(sp(w), y), (w, torch.randn(7, 2, **dd)))
    assert torch.autograd.gradcheck(
        lambda i, x, w: torch.addmm(i, x, sp(w), beta=0.5, alpha=2.0),
        (torch.randn(7, **dd), torch.randn(3, 4, **dd), w),
    )
    assert sparsa.fallback_counts() == {}


@pytest.mark.parametrize("layout", [Masked, COO])
@SETTINGS
@given(b=st.integers(1, 3), n=ODD, k=ODD, m=ODD, seed=st.integers(0, 999))
def test_bmm_matches_dense(layout, b, n, k, m, seed):
    torch.manual_seed(seed)
    w = torch.randn(b, k, m)
    ws = sparsa.to_sparse(w, layout, mask=torch.rand(b, k, m) < 0.5)
    x = torch.randn(b, n, k)
    sparsa.reset_fallback_counts()
    close(torch.bmm(x, ws), torch.bmm(x, ws.to_dense()))
    close(torch.matmul(x, ws), torch.matmul(x, ws.to_dense()))  # batched sparse operand in matmul
    assert sparsa.fallback_counts() == {}


@pytest.mark.parametrize("layout", [Masked, COO])
def test_bmm_gradcheck(layout):
    torch.manual_seed(2)
    mask = torch.rand(2, 4, 3) < 0.5
    x = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
    sparsa.reset_fallback_counts()
    assert torch.autograd.gradcheck(lambda x, w: torch.bmm(x, sparsa.to_sparse(w, layout, mask=mask)), (x, w))
    assert torch.autograd.gradcheck(lambda x, w: torch.matmul(x, sparsa.to_sparse(w, layout, mask=mask)), (x, w))
    assert sparsa.fallback_counts() == {}


# ----------------------------------------------------------------------------- pointwise


@pytest.mark.parametrize("layout", POINTWISE)
@SETTINGS
@given(
    shape=st.lists(ODD, min_size=1, max_size=3),
    seed=st.integers(0, 999),
    bshape=st.sampled_from(["same", "last", "scalar"]),
)
def test_pointwise_matches_dense(layout, shape, seed, bshape):
    torch.manual_seed(seed)
    a = torch.randn(shape)
    s = sparsa.to_sparse(a, layout, mask=torch.rand(shape) < 0.5)
    ad = s.to_dense()
    b = {"same": torch.randn(shape), "last": torch.randn(shape[-1]), "scalar": 1.5}[bshape]
    sparsa.reset_fallback_counts()
    close(torch.add(s, b), ad + b)
    close(torch.add(s, b, alpha=2.0), torch.add(ad, b, alpha=2.0))
    if isinstance(b, torch.Tensor):
        close(b + s, b + ad)
        prod = b * s
        assert isinstance(prod, sparsa.SparseTensor) and prod.layout_name == layout.name
        close(prod.to_dense(), b * ad)
    prod = torch.mul(s, b)
    assert isinstance(prod, sparsa.SparseTensor) and prod.layout_name == layout.name
    assert torch.equal(prod.pattern(), s.pattern())  # pattern kept
    close(prod.to_dense(), ad * b)
    r = torch.relu(s)
    assert isinstance(r, sparsa.SparseTensor) and r.layout_name == layout.name
    close(r.to_dense(), torch.relu(ad))
    assert torch.equal(r.pattern(), s.pattern() & (ad > 0))  # narrowed to the positive values
    assert sparsa.fallback_counts() == {}


def test_mul_ignores_inf_off_pattern():
    s = sparsa.to_sparse(torch.tensor([1.0, 0.0, 2.0]), "masked")
    out = s * torch.tensor([2.0, float("inf"), float("nan")])
    assert torch.equal(out.pattern(), s.pattern())
    assert out.to_dense()[1] == 0.0 and torch.isnan(out.to_dense()[2])


@SETTINGS
@given(shape=st.lists(ODD, min_size=1, max_size=3), seed=st.integers(0, 999))
def test_coo_coo_add_and_mul(shape, seed):
    torch.manual_seed(seed)
    a = sparsa.to_sparse(torch.randn(shape), COO, mask=torch.rand(shape) < 0.5)
    b = sparsa.to_sparse(torch.randn(shape), COO, mask=torch.rand(shape) < 0.5)
    sparsa.reset_fallback_counts()
    s = torch.add(a, b, alpha=0.5)
    assert s.layout_name == "coo"
    s.sparse_layout.validate()
    close(s.to_dense(), a.to_dense() + 0.5 * b.to_dense())
    assert torch.equal(s.pattern(), a.pattern() | b.pattern())
    p = a * b
    assert p.layout_name == "coo"
    p.sparse_layout.validate()
    close(p.to_dense(), a.to_dense() * b.to_dense())
    assert torch.equal(p.pattern(), a.pattern() & b.pattern())
    assert sparsa.fallback_counts() == {}


@pytest.mark.parametrize("layout", POINTWISE)
def test_pointwise_gradcheck(layout):
    torch.manual_seed(3)
    mask = torch.rand(4, 5) < 0.5
    a = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    row = torch.randn(5, dtype=torch.float64, requires_grad=True)
    sp = lambda a: sparsa.to_sparse(a, layout, mask=mask)  # noqa: E731
    sparsa.reset_fallback_counts()
    assert torch.autograd.gradcheck(lambda a, b: torch.add(sp(a), b, alpha=0.5), (a, b))
    assert torch.autograd.gradcheck(lambda a, b: b + sp(a), (a, row))
    assert torch.autograd.gradcheck(lambda a, b: torch.mul(sp(a), b).to_dense(), (a, b))
    assert torch.autograd.gradcheck(lambda a, b: (b * sp(a)).to_dense(), (a, row))
    assert torch.autograd.gradcheck(lambda a: (sp(a) * 3.0).to_dense(), (a,))
    assert torch.autograd.gradcheck(lambda a: torch.relu(sp(a)).to_dense(), (a,))
    if layout is COO:
        mask2 = torch.rand(4, 5) < 0.5
        sp2 = lambda b: sparsa.to_sparse(b, COO, mask=mask2)  # noqa: E731
        assert torch.autograd.gradcheck(lambda a, b: torch.add(sp(a), sp2(b), alpha=2.0).to_dense(), (a, b))
        assert torch.autograd.gradcheck(lambda a, b: (sp(a) * sp2(b)).to_dense(), (a, b))
    assert sparsa.fallback_counts() == {}


# ----------------------------------------------------------------------------- sparse leaves
def _leaf_grad_matches(fn, sp_leaf, *dense_args):
    """Gradient w.r.t. a SparseTensor leaf (what an optimizer sees) == dense reference grad * pattern."""
    (g,) = torch.autograd.grad(fn(sp_leaf, *dense_args).sum(), (sp_leaf,))
    ref_leaf = sp_leaf.to_dense().detach().requires_grad_()
    (ref,) = torch.autograd.grad(fn(ref_leaf, *dense_args).sum(), (ref_leaf,))
    pattern = sp_leaf.pattern()
    assert bool((g[~pattern] == 0).all()), "gradient leaks outside the stored pattern"
    close(g, ref * pattern)


@pytest.mark.parametrize("layout,params", WEIGHTS, ids=WIDS)
def test_sparse_leaf_gradients_are_restricted_to_pattern(layout, params):
    torch.manual_seed(4)
    w = torch.randn(6, 8)
    ws = sparsa.to_sparse(w, layout, mask=make_mask(layout, params, w), requires_grad=True, **params)
    sparsa.reset_fallback_counts()
    _leaf_grad_matches(lambda w, x: F.linear(x, w), ws, torch.randn(2, 3, 8))
    _leaf_grad_matches(lambda w, x: torch.matmul(x, w), ws, torch.randn(3, 6))
    _leaf_grad_matches(lambda w, y: torch.matmul(w, y), ws, torch.randn(8, 2))
    _leaf_grad_matches(lambda w, x: torch.addmm(torch.randn(8), x, w, alpha=2.0), ws, torch.randn(3, 6))
    if layout in POINTWISE:
        _leaf_grad_matches(lambda w, b: w + b, ws, torch.randn(6, 8))
        _leaf_grad_matches(lambda w, b: (w * b).to_dense(), ws, torch.randn(6, 8))
        _leaf_grad_matches(lambda w: torch.relu(w).to_dense(), ws)
    assert sparsa.fallback_counts() == {}


# ----------------------------------------------------------------------------- dispatch bookkeeping
def test_every_expected_combination_is_registered():
    names = registry.registered_impls()
    for lay, _ in WEIGHTS:
        n = lay.name
        assert ("linear", ("dense", n, "dense")) in names
        assert ("matmul", ("dense", n)) in names and ("matmul", (n, "dense")) in names
        assert ("mm", ("dense", n)) in names and ("mm", (n, "dense")) in names
        assert ("addmm", ("dense", "dense", n)) in names
    for n in ("masked", "coo"):
        assert ("bmm", ("dense", n)) in names
        for op in ("add", "mul"):
            assert (op, (n, "dense")) in names and (op, ("dense", n)) in names
        assert ("relu", (n,)) in names


def test_unregistered_op_falls_back_and_warns_once():
    x = torch.randn(1, 2, 6, 6)
    w = sparsa.to_sparse(torch.randn(3, 2, 3, 3), "masked", mask=torch.rand(3, 2, 3, 3) < 0.5)
    sparsa.reset_fallback_counts()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        y1 = F.conv2d(x, w, padding=1)
        y2 = F.conv2d(x, w, padding=1)
    msgs = [r for r in rec if issubclass(r.category, sparsa.SparseFallbackWarning)]
    assert len(msgs) == 1
    assert sparsa.fallback_counts() == {("conv2d", ("dense", "masked", "dense")): 2}
    close(y1, F.conv2d(x, w.to_dense(), padding=1))
    assert torch.equal(y1, y2)
