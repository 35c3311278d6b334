"""RigL, SET and movement pruning: constant sparsity, the right positions change, optimizer state reset."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

import sparsa
from sparsa.methods import SET, MovementPruning, RigL, erk_sparsities
from sparsa.sparsifiers import CubicSchedule, KeepAll, Magnitude

warnings.filterwarnings("ignore", category=sparsa.SparseFallbackWarning)


def _sparse_linear(out_f=8, in_f=16, sparsity=0.75, seed=0):
    torch.manual_seed(seed)
    return sparsa.sparsify(nn.Linear(in_f, out_f), Magnitude(sparsity))


def _backward(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, model.in_features, generator=g)
    model(x).pow(2).mean().backward()


@pytest.mark.parametrize("conv", [False, True])
def test_rigl_drops_smallest_and_grows_largest_dense_gradient(conv):
    torch.manual_seed(0)
    dense_model = nn.Conv2d(2, 4, 3, padding=1) if conv else nn.Linear(16, 8)
    x = torch.randn(6, 2, 5, 5) if conv else torch.randn(16, 16)
    model = sparsa.sparsify(
        copy.deepcopy(dense_model), sparsa.Rule(sparsifier=Magnitude(0.75), module_types=(nn.Linear, nn.Conv2d))
    )
    p = model.weight
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    rigl = RigL(model, opt, update_every=2, drop_fraction=0.25)
    model(x).pow(2).mean().backward()
    assert not rigl.step(1)  # arms the hooks for step 2
    opt.step()
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    old_mask, old_vals = p.pattern().clone(), p.to_dense().detach().clone()
    # reference: the gradient of a dense layer holding the same values, at every position
    with torch.no_grad():
        dense_model.weight.copy_(old_vals)
        dense_model.bias.copy_(model.bias)
    dense_model(x).pow(2).mean().backward()
    grad = dense_model.weight.grad
    assert torch.any(grad[~old_mask] != 0)
    assert rigl.step(2)
    new = p.pattern()
    k = int(0.25 * int(old_mask.sum()))
    drop_score = torch.where(old_mask, old_vals.abs(), torch.inf).flatten()
    kept = old_mask.flatten().clone()
    kept[drop_score.topk(k, largest=False).indices] = False
    grow_score = torch.where(kept, -torch.inf, grad.abs().flatten())
    ref = kept.clone()
    ref[grow_score.topk(k).indices] = True
    assert torch.equal(new.flatten(), ref)
    assert int(new.sum()) == int(old_mask.sum())  # constant sparsity
    kept = kept.view_as(new)
    grown = new & ~kept
    assert grown.any() and torch.all(p.to_dense()[grown] == 0)  # regrown weights start at zero
    torch.testing.assert_close(p.to_dense()[kept], old_vals[kept])
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.all(opt.state[p][name][grown] == 0)


@settings(max_examples=20, deadline=None)
@given(
    out_f=st.integers(2, 12),
    in_f=st.integers(2, 20),
    sparsity=st.floats(0.1, 0.9),
    frac=st.floats(0.05, 0.6),
    seed=st.integers(0, 1000),
    cls=st.sampled_from([RigL, SET]),
)
def test_dynamic_sparsity_keeps_nnz_and_trains(out_f, in_f, sparsity, frac, seed, cls):
    model = _sparse_linear(out_f, in_f, sparsity, seed)
    p = model.weight
    nnz = p.nnz
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dyn = cls(model, opt, update_every=2, drop_fraction=frac, end_step=10, seed=seed)
    for step in range(1, 8):
        opt.zero_grad()
        _backward(model, seed + step)
        dyn.step(step)
        opt.step()
        assert p.nnz == nnz and isinstance(p, sparsa.SparseTensor)
        assert torch.all(p.to_dense()[~p.pattern()] == 0)


def test_cosine_decay_and_end_step():
    model = _sparse_linear()
    r = RigL([model.weight], update_every=10, drop_fraction=0.4, end_step=100)
    assert r.fraction_at(0) == pytest.approx(0.4)
    assert r.fraction_at(50) == pytest.approx(0.2)
    assert r.fraction_at(100) == 0.0
    assert not r.step(100) and not r.step(15)


def test_set_is_seeded_and_rigl_needs_grad():
    masks = []
    for _ in range(2):
        model = _sparse_linear()
        SET([model.weight], update_every=1, drop_fraction=0.3, seed=7).step(1)
        masks.append(model.weight.pattern())
    assert torch.equal(masks[0], masks[1])
    model = _sparse_linear()
    with pytest.raises(ValueError, match="backward"):
        RigL(model, update_every=1).step(1)


def test_movement_keeps_weights_moving_away_from_zero():
    model = sparsa.sparsify(nn.Linear(6, 4, bias=False), sparsa.Rule(sparsifier=KeepAll()))
    p = model.weight
    mp = MovementPruning([p], CubicSchedule(0.0, 0.5, start_step=0, end_step=1))
    scores = torch.zeros(p.shape)
    for step in range(2):
        model.zero_grad()
        _backward(model, step)
        scores -= p.to_dense().detach() * p.grad
        mp.accumulate()
        mp.step(step)
    torch.testing.assert_close(mp.scores[0][p.pattern()], scores[p.pattern()])
    assert p.sparsity == 0.5
    kept_min = scores[p.pattern()].min()
    dropped_max = scores[~p.pattern()].max()
    assert kept_min >= dropped_max


def test_movement_needs_grad():
    model = sparsa.sparsify(nn.Linear(6, 4), sparsa.Rule(sparsifier=KeepAll()))
    with pytest.raises(ValueError, match="backward"):
        MovementPruning([model.weight], CubicSchedule(0.0, 0.5, 0, 4)).accumulate()


@settings(max_examples=30, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 64), st.integers(1, 64)), min_size=1, max_size=5),
    sparsity=st.floats(0.0, 0.95),
)
def test_erk_keeps_overall_sparsity(shapes, sparsity):
    got = erk_sparsities(shapes, sparsity)
    sizes = [a * b for a, b in shapes]
    assert all(0.0 <= s < 1.0 for s in got)
    kept = sum((1 - s) * n for s, n in zip(got, sizes))
    assert kept == pytest.approx((1 - sparsity) * sum(sizes), rel=1e-9, abs=1e-9)
    # denser for layers with a larger (fan_in + fan_out) / size
    ratio = [(a + b) / (a * b) for a, b in shapes]
    for i in range(len(shapes)):
        for j in range(len(shapes)):
            if ratio[i] > ratio[j]:
                assert got[i] <= got[j] + 1e-12
