"""Gradual (cubic), iterative and one-shot pruning; set_pattern / reset_optimizer_state."""

import warnings

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

import sparsa
from sparsa.methods import GradualPruning, IterativeSchedule, OneShot, reset_optimizer_state, set_pattern
from sparsa.sparsifiers import CubicSchedule, KeepAll, Magnitude, NM

warnings.filterwarnings("ignore", category=sparsa.SparseFallbackWarning)


def _dense_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 4))


def _keepall(model):
    return sparsa.sparsify(model, sparsa.Rule(sparsifier=KeepAll(), module_types=nn.Linear))


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 9),
    cols=st.integers(1, 17),
    seed=st.integers(0, 10_000),
    layout=st.sampled_from(["masked", "csr", "coo"]),
)
def test_set_pattern_matches_dense_reference(rows, cols, seed, layout):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    p = nn.Parameter(sparsa.to_sparse(w, layout, mask=torch.ones(rows, cols, dtype=torch.bool)))
    mask = torch.rand(rows, cols, generator=g) > 0.5
    ident = id(p)
    set_pattern(p, mask)
    assert id(p) == ident and p.layout_name == layout
    assert torch.equal(p.pattern(), mask)
    torch.testing.assert_close(p.to_dense(), w * mask)


def test_set_pattern_rejects_bad_input():
    p = nn.Parameter(sparsa.to_sparse(torch.randn(3, 4), "masked"))
    with pytest.raises(ValueError, match="shape"):
        set_pattern(p, torch.ones(4, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="SparseTensor"):
        set_pattern(nn.Parameter(torch.randn(3, 4)), torch.ones(3, 4, dtype=torch.bool))


def test_reset_optimizer_state_zeroes_adam_moments_at_positions():
    model = _keepall(_dense_model())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(5, 12)).pow(2).mean().backward()
    opt.step()
    p = model[0].weight
    pos = torch.zeros(p.shape, dtype=torch.bool)
    pos[0, :3] = True
    reset_optimizer_state(opt, p, pos)
    st_ = opt.state[p]
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.all(st_[k][pos] == 0) and torch.any(st_[k][~pos] != 0)


def test_gradual_reaches_cubic_targets_and_patterns_shrink():
    model = _keepall(_dense_model())
    sched = CubicSchedule(0.0, 0.9, start_step=0, end_step=40, every=10)
    pruner = GradualPruning([model[0].weight, model[2].weight], sched)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    prev = model[0].weight.pattern().clone()
    x, y = torch.randn(32, 12), torch.randint(0, 4, (32,))
    for step in range(50):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if pruner.step(step):
            cur = model[0].weight.pattern()
            assert not torch.any(cur & ~prev)  # never regrows
            expected = round(sched(step) * cur.numel())
            assert int((~cur).sum()) == expected
            prev = cur.clone()
    for p in (model[0].weight, model[2].weight):
        assert p.numel() - p.nnz == round(0.9 * p.numel())
    # the optimizer kept training the same parameter objects
    assert model[0].weight is opt.param_groups[0]["params"][0]


def test_gradual_with_structured_sparsifier_rejected_clearly():
    model = _keepall(_dense_model())
    pruner = GradualPruning([model[0].weight], CubicSchedule(0.0, 0.5, 0, 10), sparsifier=NM(2, 4))
    with pytest.raises(TypeError, match="sparsity"):
        pruner.step(5)


def test_gradual_requires_sparse_params_and_schedule():
    with pytest.raises(TypeError, match="SparseTensor"):
        GradualPruning([nn.Parameter(torch.randn(2, 2))], CubicSchedule(0.0, 0.5, 0, 10))
    with pytest.raises(TypeError, match="Schedule"):
        GradualPruning([nn.Parameter(sparsa.to_sparse(torch.randn(2, 2), "masked"))], 0.5)
    with pytest.raises(ValueError, match="empty"):
        GradualPruning([], CubicSchedule(0.0, 0.5, 0, 10))


def test_iterative_schedule_geometric_rounds():
    s = IterativeSchedule(0.875, rounds=3, every=5, start_step=10)
    assert s(0) == 0.0
    assert [round(s(t), 6) for t in (10, 14, 15, 20, 99)] == [0.5, 0.5, 0.75, 0.875, 0.875]
    with pytest.raises(ValueError, match="rounds"):
        IterativeSchedule(0.5, rounds=0, every=5)


def test_iterative_prune_and_finetune_with_gradual_callback():
    model = _keepall(_dense_model())
    pruner = GradualPruning([model[0].weight], IterativeSchedule(0.75, rounds=2, every=3))
    seen = []
    for step in range(8):
        if pruner.step(step):
            seen.append(round(model[0].weight.sparsity, 3))
    assert seen == [0.5, 0.75]


def test_one_shot_equals_magnitude_reference():
    model = _dense_model()
    w = model[0].weight.detach().clone()
    sparsa.sparsify(model, OneShot(sparsifier=Magnitude(0.5, per="row")))
    ref = Magnitude(0.5, per="row").mask(w)
    assert torch.equal(model[0].weight.pattern(), ref)
    torch.testing.assert_close(model[0].weight.to_dense(), w * ref)


def test_schedule_arguments_validated_with_clear_errors():
    for kw, msg in (
        (dict(every=0), "every must be a positive int"),
        (dict(every=True), "every"),
        (dict(every=1.5), "every"),
        (dict(end_step=5), "end_step must be > start_step"),
        (dict(start_step=-1), "start_step must be a non-negative int"),
        (dict(final=1.5), "final"),
    ):
        args = {**dict(initial=0.0, final=0.5, start_step=5, end_step=15, every=2), **kw}
        with pytest.raises(ValueError, match=msg):
            CubicSchedule(**args)
    for kw in (dict(every=0), dict(every=2.0), dict(rounds=True), dict(start_step=-3)):
        with pytest.raises(ValueError, match="must be a"):
            IterativeSchedule(**{**dict(final=0.5, rounds=2, every=3), **kw})


def test_cubic_schedule_piecewise_formula():
    s = CubicSchedule(0.2, 0.8, start_step=3, end_step=23, every=4)
    for t in range(0, 40):
        last = 3 + max(t - 3, 0) // 4 * 4
        want = 0.8 if t >= 23 else 0.2 + 0.6 * (1 - (1 - (last - 3) / 20) ** 3)
        assert s(t) == pytest.approx(want, abs=1e-12)
    assert s(0) == 0.2 and s(3) == 0.2 and s(23) == 0.8  # exact at both ends
