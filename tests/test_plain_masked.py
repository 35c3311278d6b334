"""PlainMaskedWeights: masked sparse weights trained as plain Parameters follow the same trajectory as
the tensor subclass itself, keep their pattern under any optimizer, take a pruner's new pattern, and
reject weights they cannot hold."""

import copy

import pytest
import torch
import torch.nn as nn

import sparsa
from sparsa.methods.pattern import set_pattern
from sparsa.methods.plain_masked import PlainMaskedWeights

NAMES = ["0", "2"]


def _masked_mlp(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(24, 32), nn.ReLU(), nn.Linear(32, 8))
    for n in NAMES:
        m = model.get_submodule(n)
        mask = torch.rand(m.weight.shape) > 0.6
        m.weight = nn.Parameter(sparsa.to_sparse(m.weight.detach(), "masked", mask=mask))
    return model


def _loss(model, seed):
    x = torch.randn(16, 24, generator=torch.Generator().manual_seed(seed))
    return model(x).pow(2).mean()


def _weights(model):
    return [sparsa.to_dense(model.get_submodule(n).weight).detach().clone() for n in NAMES]


@pytest.mark.parametrize("fused", [False, True])
def test_same_trajectory_as_the_subclass(fused):
    ref = _masked_mlp()
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    for step in range(5):
        opt_ref.zero_grad()
        _loss(ref, step).backward()
        opt_ref.step()

    plain = PlainMaskedWeights(model, NAMES)
    assert all(type(model.get_submodule(n).weight) is nn.Parameter for n in NAMES)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, fused=fused)
    for step in range(5):
        opt.zero_grad()
        _loss(model, step).backward()
        plain.mask_grads()
        opt.step()
    plain.restore()
    for n, a, b in zip(NAMES, _weights(ref), _weights(model)):
        w = model.get_submodule(n).weight
        assert w.layout_name == "masked"
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        assert (a != 0).sum() > 0 and bool((b[~w.sparse_layout.mask()] == 0).all())


def test_mask_weights_keeps_the_pattern_under_a_non_elementwise_optimizer():
    model = _masked_mlp()
    masks = [model.get_submodule(n).weight.sparse_layout.mask().clone() for n in NAMES]
    plain = PlainMaskedWeights(model, NAMES)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # what a step that moves zeros would do
    plain.mask_weights()
    plain.restore()
    for w, mask in zip(_weights(model), masks):
        assert bool((w[~mask] == 0).all()) and bool((w[mask] != 0).any())


def test_pattern_changed_takes_the_new_mask_and_resets_the_optimizer_state():
    model = _masked_mlp()
    plain = PlainMaskedWeights(model, NAMES)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    _loss(model, 0).backward()
    plain.mask_grads()
    opt.step()
    sparse = plain.sparse_params[0]
    old = sparse.sparse_layout.mask().clone()
    new = old & (torch.rand(old.shape) > 0.5)  # a pruner removing about half the survivors
    set_pattern(sparse, new)
    plain.pattern_changed(sparse, opt)
    w = model.get_submodule("0").weight
    assert bool((w[~new] == 0).all()) and bool((w[new] != 0).all())
    with pytest.raises(ValueError, match="not one of"):
        plain.pattern_changed(nn.Parameter(sparsa.to_sparse(torch.ones(2, 2), "masked")), opt)
    for state in ("exp_avg", "exp_avg_sq"):
        assert bool((opt.state[w][state][old & ~new] == 0).all())
    # the layout reads the plain parameter's storage: a later step is what the pruners rank
    with torch.no_grad():
        w.mul_(2.0)
    torch.testing.assert_close(sparse.sparse_layout.to_dense(), w.detach())


def test_restore_is_idempotent_and_puts_the_sparse_parameters_back():
    model = _masked_mlp()
    sparse = [model.get_submodule(n).weight for n in NAMES]
    plain = PlainMaskedWeights(model, NAMES)
    plain.restore()
    plain.restore()
    assert [model.get_submodule(n).weight for n in NAMES] == sparse


@pytest.mark.parametrize("layout", [None, "sliced_ell"])
def test_rejects_weights_that_are_not_masked(layout):
    model = nn.Sequential(nn.Linear(8, 8))
    if layout is not None:
        model[0].weight = nn.Parameter(sparsa.to_sparse(model[0].weight.detach(), layout))
    with pytest.raises(ValueError, match=r"0\.weight must be a 'masked' SparseTensor"):
        PlainMaskedWeights(model, ["0"])


def test_a_tied_weight_stays_tied():
    model = _masked_mlp()
    extra = nn.Linear(24, 32)
    extra.weight = model[0].weight  # the same sparse parameter in two modules
    holder = nn.ModuleDict({"mlp": model, "extra": extra})
    plain = PlainMaskedWeights(holder, ["mlp.0", "extra", "mlp.2"])
    assert len(plain.entries) == 2 and holder["extra"].weight is model[0].weight
    plain.restore()
    assert holder["extra"].weight is model[0].weight and model[0].weight is plain.sparse_params[0]


def test_recover_puts_the_sparse_weights_back_when_the_optimizer_factory_fails():
    model = _masked_mlp()
    teacher = copy.deepcopy(model)

    def broken(params):
        raise RuntimeError("no optimizer")

    with pytest.raises(RuntimeError, match="no optimizer"):
        sparsa.recover(
            model,
            teacher,
            [torch.randn(4, 24)],
            target_sparsity=0.5,
            steps=1,
            names=NAMES,
            optimizer=broken,
            progress=False,
        )
    assert all(model.get_submodule(n).weight.layout_name == "masked" for n in NAMES)
