"""One registration makes an op implementation reachable at the torch-function and the aten level, and
its handle unregisters it (restoring what it replaced, invalidating the dispatch caches)."""

import pytest
import torch

import sparsa
from sparsa.layouts import COO, Masked
from sparsa.ops import op_table, registry


def _masked():
    return sparsa.to_sparse(torch.tensor([[-1.0, 0.0, 2.0], [0.0, 3.0, -0.5]]), Masked)


class MaskedSin:
    """sin keeps the pattern: sin(0) = 0."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        MaskedSin.calls += 1
        ctx.x = x
        return Masked(torch.sin(x.values) * x.mask(), x.mask(), validate=False)

    @staticmethod
    def backward(ctx, g):
        return g * torch.cos(ctx.x.values) * ctx.x.mask()


def test_a_torch_function_becomes_an_op_at_both_levels_and_goes_away_on_remove():
    s = _masked()
    assert "sin" not in sparsa.ops.OPS
    reg = sparsa.implements(torch.sin, (Masked,))
    reg(MaskedSin)
    try:
        assert sparsa.ops.OPS["sin"] == 1
        MaskedSin.calls = 0
        with sparsa.strict():
            out = torch.sin(s)  # torch-function level
            assert out.layout_name == "masked" and MaskedSin.calls == 1
            assert s.sin().layout_name == "masked"  # the method is the same op
            with torch._C.DisableTorchFunctionSubclass():  # aten level: aten.sin.default
                low = torch.sin(s)
            assert MaskedSin.calls == 3 and isinstance(low, sparsa.SparseTensor)
        torch.testing.assert_close(out.to_dense(), torch.sin(s.to_dense()))
        torch.testing.assert_close(low.to_dense(), out.to_dense())
        assert sparsa.fallback_counts() == {}
        assert "MaskedSin" in sparsa.ops.explain(torch.sin, Masked)
    finally:
        reg.remove()
    assert "sin" not in sparsa.ops.OPS and torch.sin not in op_table.TORCH_FNS
    with pytest.warns(sparsa.SparseFallbackWarning):
        torch.sin(s)
    assert sparsa.fallback_counts() == {("aten.sin", ("masked",)): 1}


def test_gradient_through_a_registered_torch_function():
    w = torch.nn.Parameter(_masked())
    with sparsa.implements(torch.sin, (Masked,)) as reg:
        reg(MaskedSin)
        torch.sin(w).to_dense().sum().backward()
    dense = w.detach().to_dense()
    torch.testing.assert_close(w.grad, torch.cos(dense) * (dense != 0))
    assert "sin" not in sparsa.ops.OPS


@sparsa.layouts.register_layout
class _Unconvertible(Masked):
    """A layout with no registered conversion to any other."""

    name = "_test_reg_unconvertible"


def test_a_new_op_converts_or_falls_back_like_a_built_in_one():
    coo = sparsa.to_sparse(torch.tensor([0.0, 1.0]), COO)
    lone = sparsa.to_sparse(torch.tensor([0.0, 1.0]), _Unconvertible)
    with sparsa.implements(torch.sin, (Masked,)) as reg:
        reg(MaskedSin)
        with sparsa.strict():
            assert torch.sin(coo).layout_name == "masked"  # through the COO -> Masked conversion
        with pytest.warns(sparsa.SparseFallbackWarning):
            torch.testing.assert_close(torch.sin(lone), torch.sin(torch.tensor([0.0, 1.0])))
        assert sparsa.fallback_counts() == {("sin", ("_test_reg_unconvertible",)): 1}
        with sparsa.strict(), pytest.raises(sparsa.SparseFallbackError, match="'sin'"):
            torch.sin(lone)


def test_remove_restores_the_replaced_implementation_and_invalidates_the_plan():
    s = _masked()
    before = registry.registered_impls("relu")[("relu", ("masked",))]
    torch.relu(s)  # the plan for relu(masked) is now cached
    with sparsa.ops.register_impl("relu", (Masked,), lambda ctx, x: torch.zeros(3), replace=True, name="Zero") as reg:
        assert reg.name == "Zero" and not reg.has_backward
        assert registry.registered_impls("relu")[("relu", ("masked",))] == "Zero"
        assert torch.relu(s).shape == (3,)
    assert reg.removed
    assert registry.registered_impls("relu")[("relu", ("masked",))] == before
    assert torch.relu(s).layout_name == "masked"
    reg.remove()  # a second remove does nothing


def test_remove_of_a_new_registration_leaves_no_entry():
    reg = sparsa.ops.register_impl("relu", (_Unconvertible,), lambda ctx, x: x)
    assert ("relu", ("_test_reg_unconvertible",)) in registry.registered_impls()
    reg.remove()
    assert ("relu", ("_test_reg_unconvertible",)) not in registry.registered_impls()


def test_device_registration_handle():
    calls = []
    reg = registry.register_device_impl(
        "relu", (COO,), lambda ctx, x: calls.append(1) or x, applies=lambda x: True, name="_test_dev"
    )
    s = sparsa.to_sparse(torch.tensor([0.0, 1.0]), COO)
    torch.relu(s)
    assert calls == [1]
    reg.remove()
    torch.relu(s)
    assert calls == [1] and "_test_dev" not in sparsa.ops.explain("relu", COO)


def test_registration_errors_name_the_fix():
    with pytest.raises(ValueError, match="pass the function itself"):
        sparsa.ops.register_impl("sin", (Masked,), MaskedSin.forward)
    with pytest.raises(ValueError, match="no functional aten op"):
        sparsa.implements(lambda x: x, (Masked,))(MaskedSin)
    with pytest.raises(ValueError, match="already registered"):
        sparsa.implements("relu", (Masked,))(MaskedSin)
    reg = sparsa.implements("relu", (Masked,), replace=True)
    reg(MaskedSin)
    try:
        with pytest.raises(ValueError, match="remove"):
            reg(MaskedSin)
    finally:
        reg.remove()
    with pytest.raises(ValueError, match="has not decorated"):
        sparsa.implements("relu", (Masked,)).remove()
    assert "sin" not in sparsa.ops.OPS  # a failed registration defines no op
    with pytest.raises(ValueError, match="takes 1 tensor"):
        sparsa.implements(torch.sin, (Masked, Masked))(MaskedSin)
    assert "sin" not in sparsa.ops.OPS


# ----------------------------------------------------------------------------- aten rules
def _is_sign(func, args, kwargs):
    return func is torch.ops.aten.sign.default


def test_register_rule_returns_a_handle_that_removes_it():
    from sparsa.ops import aten_fallback as A

    s = _masked()
    h = A.register_rule("sign7", _is_sign)

    @h
    def seven(func, args, kwargs):
        return torch.full(s.shape, 7.0)

    assert seven.__name__ == "seven" and "sign7" in A.registered_rules() and "active" in repr(h)
    try:
        torch.testing.assert_close(torch.sign(s), torch.full(s.shape, 7.0))
        assert sparsa.fallback_counts() == {}
    finally:
        h.remove()
    assert "sign7" not in A.registered_rules() and "removed" in repr(h)
    h.remove()  # a second remove does nothing
    with pytest.warns(sparsa.SparseFallbackWarning):
        torch.testing.assert_close(torch.sign(s), torch.sign(s.to_dense()))
    h(seven)  # a removed handle may register again
    assert A.registered_rules().count("sign7") == 1
    h.remove()
    with pytest.raises(ValueError, match="nothing to remove"):
        A.register_rule("never", _is_sign).remove()


def test_register_rule_as_a_context_manager_restores_the_replaced_rule():
    from sparsa.ops import aten_fallback as A

    before = A.registered_rules()
    refill = next(r for r in A._RULES if r.name == "refill")
    with A.register_rule("refill", lambda func, args, kwargs: False, replace=True) as h:
        h(lambda func, args, kwargs: None)
        assert A.registered_rules() == before and next(r for r in A._RULES if r.name == "refill") is h.rule
        with pytest.raises(ValueError, match="already registered a handler"):
            h(lambda func, args, kwargs: None)
    assert A.registered_rules() == before and next(r for r in A._RULES if r.name == "refill") is refill
    with A.register_rule("sign7", _is_sign) as h:
        pass  # never decorated: nothing to undo
    assert A.registered_rules() == before
