"""No dense fallback slips through strict mode: a sweep of ops on sparse tensors, each run outside and
inside ``sparsa.strict()``. An op that runs in strict mode must be listed in ``NOT_FALLBACKS`` with
the reason it is not one; every other op must raise ``SparseFallbackError`` there, and everything
counted as a fallback outside strict mode must raise inside it."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sparsa
from sparsa.layouts import NM, Masked


def _nm():
    torch.manual_seed(0)
    return sparsa.to_sparse(torch.randn(4, 8), NM, n=2, m=4)


def _masked():
    torch.manual_seed(1)
    return sparsa.to_sparse(torch.randn(4, 8), Masked)


OPS = {
    # name: (make the sparse operand, the op)
    "sin": (_nm, torch.sin),
    "exp": (_nm, lambda s: s.exp()),
    "abs": (_masked, torch.abs),
    "neg": (_nm, lambda s: -s),
    "sum": (_nm, lambda s: s.sum()),
    "mean_dim": (_masked, lambda s: s.mean(0)),
    "t": (_nm, lambda s: s.t()),
    "transpose": (_nm, lambda s: s.transpose(0, 1)),
    "reshape": (_nm, lambda s: s.reshape(2, 16)),
    "view": (_masked, lambda s: s.view(32)),
    "index": (_nm, lambda s: s[0]),
    "cat": (_nm, lambda s: torch.cat([s, s])),
    "stack": (_masked, lambda s: torch.stack([s, s])),
    "compare": (_nm, lambda s: s > 0),
    "softmax": (_masked, lambda s: F.softmax(s, -1)),
    "clamp": (_nm, lambda s: s.clamp(-0.1, 0.1)),
    "where": (_nm, lambda s: torch.where(s > 0, s, torch.zeros(4, 8))),
    "sub_dense": (_nm, lambda s: s - torch.ones(4, 8)),
    "relu_inplace": (_masked, lambda s: F.relu(s, inplace=True)),
    "mm_masked_masked": (_masked, lambda s: torch.mm(s, s.t())),
    "equal": (_nm, lambda s: torch.equal(s, s)),
    "allclose": (_nm, lambda s: torch.allclose(s, s)),
    "item": (_masked, lambda s: s[0, 0].item()),
    # not fallbacks
    "linear": (_nm, lambda s: F.linear(torch.randn(3, 8), s)),
    "mm_dense_nm_t": (_nm, lambda s: torch.mm(torch.randn(3, 8), s.t())),
    "relu_masked": (_masked, torch.relu),
    "mul_masked_scalar": (_masked, lambda s: s * 2.0),
    "add_masked_dense": (_masked, lambda s: s + torch.ones(4, 8)),
    "mul_nm_dense": (_nm, lambda s: s * torch.ones(4, 8)),
    "clone": (_nm, lambda s: s.clone()),
    "detach": (_nm, lambda s: s.detach()),
    "to_float64": (_nm, lambda s: s.to(torch.float64)),
    "zeros_like": (_nm, torch.zeros_like),
    "to_dense": (_nm, lambda s: s.to_dense()),
    "to_int": (_nm, lambda s: s.to(torch.int32)),
    "in_place_add": (_nm, lambda s: s.add_(torch.ones(4, 8))),
}

NOT_FALLBACKS = {
    "linear": "registered implementation",
    "relu_masked": "registered implementation",
    "mul_masked_scalar": "registered implementation",
    "add_masked_dense": "registered implementation",
    "mul_nm_dense": "a registered conversion (NM -> Masked), then a registered implementation",
    "clone": "structural: keeps the layout",
    "detach": "structural: keeps the layout",
    "to_float64": "structural: keeps the layout",
    "zeros_like": "reads shape and dtype only",
    "to_dense": "an explicit conversion",
    "to_int": "an explicit conversion: integer tensors are dense",
    "in_place_add": "the refill rule (optimizer steps): keeps the pattern",
}


def _outcome(name, strict):
    make, op = OPS[name]
    s = make()
    sparsa.reset_fallback_counts()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with sparsa.strict(strict):
            try:
                op(s)
            except sparsa.SparseFallbackError:
                return "raised", sparsa.fallback_counts()
    return "ran", sparsa.fallback_counts()


def test_not_fallbacks_lists_only_swept_ops():
    assert set(NOT_FALLBACKS) <= set(OPS)


@pytest.mark.parametrize("name", sorted(OPS))
def test_no_fallback_slips_through_strict(name):
    loose, counted = _outcome(name, strict=False)
    assert loose == "ran"
    strict, strict_counts = _outcome(name, strict=True)
    assert strict_counts == {}, "a raise in strict mode leaves the counters alone"
    if name in NOT_FALLBACKS:
        assert strict == "ran" and counted == {}, f"{name} ({NOT_FALLBACKS[name]}) must run, uncounted"
    else:
        assert strict == "raised", f"{name} ran densely in strict mode without raising (counted: {counted})"
    if counted:
        assert strict == "raised", f"{name} is counted as a fallback but does not raise in strict mode"


def test_the_refill_rule_runs_an_optimizer_step_in_strict_mode():
    p = torch.nn.Parameter(_nm())
    pattern = p.detach().pattern().clone()
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    with sparsa.strict():
        for _ in range(2):
            F.linear(torch.randn(3, 8), p).sum().backward()
            opt.step()
            opt.zero_grad()
    assert p.layout_name == "nm" and torch.equal(p.detach().pattern(), pattern)
    assert sparsa.fallback_counts() == {}
