"""Strict dispatcher: ``sparsa.strict()`` makes a dense fallback raise instead of warning and counting."""

import threading
import warnings

import pytest
import torch
import torch.nn.functional as F

import sparsa
from sparsa.layouts import Masked, NM
from sparsa.ops import aten_fallback
from sparsa.ops.strict import _STRICT


@pytest.fixture(autouse=True)
def _no_strict_leak(monkeypatch):
    """Each test starts without strict mode (flag or environment) and leaves none behind."""
    monkeypatch.delenv("SPARSA_STRICT", raising=False)
    token = _STRICT.set(None)
    yield
    _STRICT.reset(token)


def _nm():
    return sparsa.to_sparse(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)), NM, n=2, m=4)


def _conv_weight():
    w = torch.randn(2, 1, 3, 3, generator=torch.Generator().manual_seed(1))
    return w, sparsa.to_sparse(w, Masked, mask=w.abs() > 0.3)


def test_aten_fallback_raises_in_strict_and_falls_back_outside():
    w = _nm()
    with pytest.warns(sparsa.SparseFallbackWarning, match="sin"):
        out = torch.sin(w)
    torch.testing.assert_close(out, torch.sin(w.to_dense()))
    assert sparsa.fallback_counts() == {("aten.sin", ("nm",)): 1}
    with sparsa.strict():
        with pytest.raises(sparsa.SparseFallbackError) as e:
            torch.sin(w)
    msg = str(e.value)
    assert "aten.sin" in msg and "nm" in msg and "to_dense" in msg and "strict(False)" in msg


def test_torch_function_fallback_raises_in_strict_and_names_the_fix():
    w, s = _conv_weight()
    x = torch.randn(1, 1, 5, 5)
    with sparsa.strict():
        with pytest.raises(sparsa.SparseFallbackError) as e:
            F.conv2d(x, s)
    msg = str(e.value)
    assert "'conv2d'" in msg and "('dense', 'masked', 'dense')" in msg
    assert "sparsa.implements" in msg and "to_dense" in msg
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sparsa.SparseFallbackWarning)
        y = F.conv2d(x, s)  # outside strict: the dense fallback
    torch.testing.assert_close(y, F.conv2d(x, s.to_dense()))


def test_strict_raise_leaves_counters_and_warnings_unchanged():
    w, s = _conv_weight()
    x = torch.randn(1, 1, 5, 5)
    with pytest.warns(sparsa.SparseFallbackWarning):
        F.conv2d(x, s)
    before = sparsa.fallback_counts()
    with sparsa.strict(), warnings.catch_warnings():
        warnings.simplefilter("error", sparsa.SparseFallbackWarning)  # strict raises, never warns
        for op in (lambda: F.conv2d(x, s), lambda: torch.sin(s), lambda: torch.cos(_nm())):
            with pytest.raises(sparsa.SparseFallbackError):
                op()
    assert sparsa.fallback_counts() == before == {("conv2d", ("dense", "masked", "dense")): 1}


def test_nesting_restores_the_previous_state():
    assert not sparsa.is_strict()
    with sparsa.strict() as outer:
        assert sparsa.is_strict() and outer.enabled
        with sparsa.strict(False):
            assert not sparsa.is_strict()
            with sparsa.strict():
                assert sparsa.is_strict()
            assert not sparsa.is_strict()
        assert sparsa.is_strict()
    assert not sparsa.is_strict()
    with pytest.raises(RuntimeError), sparsa.strict():
        raise RuntimeError("the state is restored on an exception too")
    assert not sparsa.is_strict()


def test_flag_form():
    assert repr(sparsa.strict(True)) == "strict(True)"
    assert sparsa.is_strict()
    with pytest.raises(sparsa.SparseFallbackError):
        torch.sin(_nm())
    sparsa.strict(False)
    assert not sparsa.is_strict()
    with pytest.raises(TypeError, match="True or False"):
        sparsa.strict("yes")


def test_environment_variable_is_read_at_call_time(monkeypatch):
    w = _nm()
    monkeypatch.setenv("SPARSA_STRICT", "1")
    assert sparsa.is_strict()
    with pytest.raises(sparsa.SparseFallbackError):
        torch.sin(w)
    with sparsa.strict(False):  # an explicit setting wins over the environment
        assert not sparsa.is_strict()
    monkeypatch.setenv("SPARSA_STRICT", "0")
    assert not sparsa.is_strict()
    monkeypatch.delenv("SPARSA_STRICT")
    assert not sparsa.is_strict()


def test_strict_is_per_thread():
    seen = []
    with sparsa.strict():
        t = threading.Thread(target=lambda: seen.append(sparsa.is_strict()))
        t.start()
        t.join()
    assert seen == [False]


def test_registered_ops_structural_ops_and_training_work_in_strict():
    w = _nm()
    x = torch.randn(3, 8, requires_grad=True)
    p = torch.nn.Parameter(w.clone())
    opt = torch.optim.Adam([p], lr=0.1)  # zeros_like for its state; add_/addcdiv_/lerp_ in its step
    with sparsa.strict():
        y = F.linear(x, p)  # registered implementation (forward and backward)
        torch.testing.assert_close(y, x @ w.to_dense().T)
        y.sum().backward()
        assert p.grad is not None and x.grad is not None
        torch.mm(torch.randn(2, 4), w)  # registered
        w.clone(), w.detach(), w.to(torch.float64)  # structural: keep the layout
        opt.step()  # the refill rule, not a fallback
        assert p.layout_name == "nm"
    assert sparsa.fallback_counts() == {}
    dense = p.detach().to_dense()
    assert ((dense != 0).reshape(4, 2, 4).sum(-1) <= 2).all()


def test_refill_is_a_registered_rule():
    assert "refill" in aten_fallback.registered_rules()
    with pytest.raises(ValueError, match="already registered"):
        aten_fallback.register_rule("refill", lambda func, args, kwargs: False)(lambda func, args, kwargs: None)
    with pytest.raises(KeyError):
        aten_fallback.unregister_rule("no such rule")


def test_in_place_relu_fallback_is_counted_and_strict():
    s = sparsa.to_sparse(torch.tensor([-1.0, 2.0, 0.5]), Masked)
    with pytest.warns(sparsa.SparseFallbackWarning):
        out = F.relu(s, inplace=True)
    torch.testing.assert_close(out, torch.tensor([0.0, 2.0, 0.5]))
    assert sparsa.fallback_counts() == {("relu (in-place)", ("masked",)): 1}
    with sparsa.strict(), pytest.raises(sparsa.SparseFallbackError, match="relu"):
        F.relu(s, inplace=True)
