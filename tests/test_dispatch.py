"""Dispatcher: exact match, conversion path, dense fallback (warn once + counted), autograd."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sparsa
from sparsa.layouts import Dense, Masked, register_layout, register_conversion
from sparsa.ops.dispatch import explain


class _Tagged(Masked):
    """A private copy of Masked used to test routing without touching built-in registrations."""

    name = "_test_tagged"


register_layout(_Tagged, replace=True)


class _Other(Masked):
    name = "_test_other"


register_layout(_Other, replace=True)
register_conversion(_Other, _Tagged, lambda l: _Tagged(l.values, l.mask(), validate=False), cost=1.0, replace=True)

CALLS = []


@sparsa.implements("linear", (Dense, _Tagged, Dense), replace=True)
class _TaggedLinear:
    @staticmethod
    def forward(ctx, x, w, b):
        CALLS.append("fwd")
        ctx.save_for_backward(x, w.values)
        y = x @ w.values.T
        return y if b is None else y + b

    @staticmethod
    def backward(ctx, g):
        CALLS.append("bwd")
        x, wv = ctx.saved_tensors
        gx = g @ wv if ctx.needs_input_grad[0] else None
        gw = g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        gb = g.reshape(-1, g.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None
        return gx, gw, gb


def _w(cls, seed=0):
    w = torch.randn(5, 7, generator=torch.Generator().manual_seed(seed))
    return w, sparsa.to_sparse(w, cls, mask=w.abs() > 0.3)


def test_exact_match_is_used_without_fallback():
    sparsa.reset_fallback_counts()
    CALLS.clear()
    w, s = _w(_Tagged)
    x = torch.randn(3, 7)
    y = F.linear(x, s)
    torch.testing.assert_close(y, x @ (w * (w.abs() > 0.3)).T)
    assert CALLS == ["fwd"]
    assert sparsa.fallback_counts() == {}


def test_conversion_path_is_used():
    sparsa.reset_fallback_counts()
    CALLS.clear()
    w, s = _w(_Other)
    x = torch.randn(3, 7)
    y = F.linear(x, s)
    torch.testing.assert_close(y, x @ (w * (w.abs() > 0.3)).T)
    assert CALLS == ["fwd"]
    assert "after conversion" in explain("linear", Dense, _Other, Dense)
    assert sparsa.fallback_counts() == {}


def test_backward_through_registered_impl():
    CALLS.clear()
    w, s = _w(_Tagged)
    p = torch.nn.Parameter(s)
    x = torch.randn(3, 7, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    F.linear(x, p, b).sum().backward()
    assert CALLS == ["fwd", "bwd"]
    wd = w * (w.abs() > 0.3)
    torch.testing.assert_close(x.grad, torch.ones(3, 5) @ wd)
    torch.testing.assert_close(b.grad, torch.full((5,), 3.0))
    assert p.grad.shape == w.shape


def test_impl_without_backward_is_skipped_when_grad_needed():
    @sparsa.implements("mm", (Dense, _Tagged), replace=True)
    def fwd_only(ctx, a, b):
        return a @ b.values

    _, s = _w(_Tagged)
    s = s.detach()
    a = torch.randn(2, 5, requires_grad=True)
    sparsa.reset_fallback_counts()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sparsa.SparseFallbackWarning)
        out = torch.mm(a, s)
    assert sparsa.fallback_counts() == {("mm", ("dense", "_test_tagged")): 1}
    out.sum().backward()
    with torch.no_grad():
        sparsa.reset_fallback_counts()
        torch.mm(a, s)
        assert sparsa.fallback_counts() == {}


def test_fallback_warns_once_and_counts():
    sparsa.reset_fallback_counts()
    _, s = _w(_Tagged)
    x = torch.randn(1, 1, 5, 7)
    w4 = sparsa.to_sparse(torch.randn(2, 1, 3, 3), _Tagged)
    with pytest.warns(sparsa.SparseFallbackWarning, match="conv2d"):
        F.conv2d(x, w4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sparsa.SparseFallbackWarning)
        y = F.conv2d(x, w4)  # no second warning
    torch.testing.assert_close(y, F.conv2d(x, w4.to_dense()))
    assert sparsa.fallback_counts()[("conv2d", ("dense", "_test_tagged", "dense"))] == 2


def test_duplicate_registration_is_an_error():
    with pytest.raises(ValueError, match="already registered"):
        sparsa.implements("linear", (Dense, _Tagged, Dense))(_TaggedLinear)
    with pytest.raises(ValueError, match="already registered"):
        register_layout(type("Dup", (Masked,), {"name": "masked"}))
    with pytest.raises(ValueError, match="unknown op"):
        sparsa.ops.register_impl("not_an_op", (Dense,), lambda ctx, x: x)


def test_dense_args_are_never_sparsified_implicitly():
    # linear with a dense weight never dispatches (no SparseTensor involved) and an impl that wants a
    # sparse *input* is not chosen for a dense input
    assert "dense fallback" in explain("linear", _Tagged, Dense, Dense)


def test_registered_impls_table_lists_names():
    tab = sparsa.ops.registered_impls("linear")
    assert ("linear", ("dense", "_test_tagged", "dense")) in tab


def test_layout_registry_errors():
    with pytest.raises(ValueError, match="unknown layout"):
        sparsa.layouts.get_layout("nope")
    with pytest.raises(TypeError):
        register_layout(int)


@pytest.mark.parametrize(
    "layout, params",
    [("masked", {}), ("csr", {}), ("nm", {"n": 2, "m": 4}), ("row_group", {"group": 8, "sparsity": 0.5})],
)
def test_bad_operands_get_clear_errors(layout, params):
    w = sparsa.to_sparse(torch.randn(16, 32), layout, **params)
    with pytest.raises(ValueError, match="32"):
        F.linear(torch.randn(3, 31), w)
    with pytest.raises(TypeError, match="same dtype"):
        F.linear(torch.randn(3, 32, dtype=torch.float64), w)


def test_the_direct_autograd_entry_matches_function_apply_and_yields_to_functorch(monkeypatch):
    from sparsa.ops import dispatch as D

    torch.manual_seed(0)
    w = torch.randn(6, 5)
    b = torch.randn(6, requires_grad=True)
    x = torch.randn(3, 5, requires_grad=True)
    sw = torch.nn.Parameter(sparsa.to_sparse(w, "masked", mask=w.abs() > 0.5).detach())

    def grads():
        for t in (x, b, sw):
            t.grad = None
        F.linear(x, sw, b).pow(2).sum().backward()
        return x.grad.clone(), b.grad.clone(), sw.grad.clone()

    fast = grads()
    took = []
    monkeypatch.setattr(D, "_run_apply_c", lambda *a: took.append("c") or D._Run.apply(*a))
    grads()
    assert took == ["c"]  # outside functorch and tracing, the C entry point runs
    monkeypatch.undo()
    slow = []
    real = D._Run.apply
    monkeypatch.setattr(D._Run, "apply", lambda *a: slow.append(1) or real(*a))
    monkeypatch.setattr(D, "_run_apply_c", lambda *a: pytest.fail("the C entry point ran"))
    monkeypatch.setattr(D, "_functorch_active", lambda: True)
    ref = grads()
    assert slow == [1]  # under a transform, Function.apply (which knows functorch) runs
    for a, r in zip(fast, ref):
        assert torch.equal(a, r)
