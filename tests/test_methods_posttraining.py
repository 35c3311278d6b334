"""Calibration hooks, Wanda, SparseGPT and distillation, against dense references."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

import sparsa
from sparsa.methods import (
    RowGroupSparsifier,
    SparseGPT,
    Wanda,
    WandaSparsifier,
    collect_input_stats,
    distill,
    forward_groups,
    named_pattern,
    sparsegpt_weight,
)
from sparsa.sparsifiers import Magnitude

warnings.filterwarnings("ignore", category=sparsa.SparseFallbackWarning)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _correlated_inputs(n=256, k=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, 4, generator=g)
    mix = torch.randn(4, k, generator=g)
    scale = torch.linspace(0.1, 3.0, k)
    return (base @ mix + 0.1 * torch.randn(n, k, generator=g)) * scale


def test_collect_input_stats_matches_dense_reference():
    model = _mlp()
    xs = [torch.randn(10, 16), torch.randn(6, 16)]
    stats = collect_input_stats(model, xs, hessian=True)
    assert forward_groups(model, xs[0]) == [["0"], ["2"]]
    x0 = torch.cat(xs)
    h1 = torch.relu(model[0](x0)).detach()
    torch.testing.assert_close(stats["0"].sq_norm, x0.pow(2).sum(0))
    torch.testing.assert_close(stats["2"].norm, h1.norm(dim=0))
    torch.testing.assert_close(stats["2"].hessian, h1.T @ h1, rtol=1e-4, atol=1e-3)
    assert stats["0"].count == 16
    early = collect_input_stats(model, xs, names=["0"], stop_early=True)
    torch.testing.assert_close(early["0"].sq_norm, stats["0"].sq_norm)
    with pytest.raises(ValueError, match="nn.Linear"):
        collect_input_stats(model, xs, names=["1"])


def test_forward_groups_groups_layers_sharing_an_input():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(4, 4) for _ in range(4))

        def forward(self, x):
            return self.o(self.q(x) * self.k(x) + self.v(x))

    assert forward_groups(Attn(), torch.randn(2, 4)) == [["q", "k", "v"], ["o"]]


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 8),
    cols=st.integers(1, 6).map(lambda c: 4 * c),
    seed=st.integers(0, 10_000),
    pattern=st.sampled_from(["unstructured", "2:4", "row_group4"]),
)
def test_wanda_mask_is_base_on_scaled_weight(rows, cols, seed, pattern):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    norm = torch.rand(cols, generator=g) * 3
    base, _ = named_pattern(pattern, 0.5)
    got = WandaSparsifier(base, norm).mask(w)
    assert torch.equal(got, base.mask(w.abs() * norm))
    if pattern == "unstructured":  # the paper's rule: per output row, keep the largest |w| * ||x||
        score = w.abs() * norm
        keep = cols - round(0.5 * cols)
        for r in range(rows):
            assert set(score[r].argsort(descending=True, stable=True)[:keep].tolist()) == set(
                got[r].nonzero().flatten().tolist()
            )


def test_wanda_model_level_layouts():
    x = _correlated_inputs()
    for pattern in ("unstructured", "2:4", "row_group8"):
        sp, layout = named_pattern(pattern, 0.5)
        model = sparsa.sparsify(_mlp(), Wanda(sparsifier=sp, layout=layout, calibration=[x]))
        assert model[0].weight.layout_name == layout
        assert abs(model[0].weight.density - 0.5) < 1e-6
        model(x)  # runs


def _layer_error(w_new, w, x):
    return (x @ (w_new - w).T).pow(2).sum().item()


@pytest.mark.parametrize("pattern", ["unstructured", "2:4", "4:8", "row_group4"])
def test_sparsegpt_beats_magnitude_and_wanda_on_layer_reconstruction(pattern):
    x = _correlated_inputs(k=32)
    torch.manual_seed(0)
    w = torch.randn(16, 32)
    sp, _ = named_pattern(pattern, 0.5)
    h = x.double().T @ x.double() / x.shape[0]
    w_gpt, keep = sparsegpt_weight(w, h, sp, block=16)
    assert torch.all(w_gpt[~keep] == 0)
    assert abs(keep.float().mean().item() - 0.5) < 1e-6
    if ":" in pattern:
        n, m = (int(v) for v in pattern.split(":"))
        assert torch.all(keep.view(16, -1, m).sum(-1) == n)
    if pattern.startswith("row_group"):
        assert torch.all(keep.view(4, 4, 32) == keep.view(4, 4, 32)[:, :1])  # rows of a group share columns
    err_gpt = _layer_error(w_gpt, w, x)
    err_mag = _layer_error(sp(w), w, x)
    err_wanda = _layer_error(WandaSparsifier(sp, x.norm(dim=0))(w), w, x)
    assert err_gpt < err_wanda <= err_mag * 1.01


def test_sparsegpt_identity_hessian_is_magnitude_pruning():
    torch.manual_seed(3)
    w = torch.randn(8, 16)
    sp = Magnitude(0.5, per="row")
    w_gpt, keep = sparsegpt_weight(w, torch.eye(16), sp, block=16, damp=0.0)
    assert torch.equal(keep, sp.mask(w))
    torch.testing.assert_close(w_gpt, sp(w), rtol=1e-6, atol=1e-6)


def test_sparsegpt_model_sequential_and_layouts():
    x = _correlated_inputs()
    ref_model = _mlp()
    ref = ref_model(x).detach()
    sp, layout = named_pattern("2:4", 0.5)
    model = sparsa.sparsify(
        copy.deepcopy(ref_model), SparseGPT(sparsifier=sp, layout=layout, calibration=[x[:128], x[128:]], block=16)
    )
    assert model[0].weight.layout_name == "nm" and model[2].weight.layout_name == "nm"
    mag = sparsa.sparsify(copy.deepcopy(ref_model), sparsa.Rule(sparsifier=sp, layout=layout, module_types=nn.Linear))
    assert (model(x) - ref).pow(2).mean() < (mag(x) - ref).pow(2).mean()
    with pytest.raises(ValueError, match="2-D"):
        sparsegpt_weight(torch.randn(4, 4), torch.eye(3), sp)


def test_distill_recovers_and_keeps_pattern():
    x = _correlated_inputs()
    teacher = _mlp()
    student = sparsa.sparsify(copy.deepcopy(teacher), Magnitude(0.7))
    pattern = student[0].weight.pattern().clone()
    before = (student(x) - teacher(x)).pow(2).mean().item()
    losses = distill(student, teacher, [x[i : i + 32] for i in range(0, 256, 32)], lr=3e-3, epochs=6)
    after = (student(x) - teacher(x)).pow(2).mean().item()
    assert losses[-1] < losses[0] and after < 0.7 * before
    assert torch.equal(student[0].weight.pattern(), pattern)
    assert all(not p.requires_grad or p.grad is None or True for p in teacher.parameters())
    assert all(p.grad is None for p in teacher.parameters())


def test_row_group_sparsifier_pattern():
    w = torch.randn(16, 12)
    m = RowGroupSparsifier(0.5, group=8).mask(w)
    assert torch.all(m.sum(1) == 6)
    assert torch.all(m.view(2, 8, 12) == m.view(2, 8, 12)[:, :1])
    with pytest.raises(ValueError, match="pattern"):
        named_pattern("blocky")


def test_calibration_edge_cases():
    class Shared(nn.Module):  # one layer called twice on different inputs, one never called
        def __init__(self):
            super().__init__()
            self.a, self.b, self.unused = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x)) + self.a(x + 1)

    m, xs = Shared(), [torch.randn(3, 4), torch.randn(5, 4)]
    assert forward_groups(m, xs[0]) == [["a"], ["b"]]
    stats = collect_input_stats(m, xs)
    assert sorted(stats) == ["a", "b"] and stats["a"].count == 16 and stats["b"].count == 8
    with pytest.raises(ValueError, match="never called"):
        collect_input_stats(m, xs, names=["a", "unused"])
    # every hook is removed, also after an error and after stopping early
    collect_input_stats(m, xs, names=["a"], stop_early=True)
    assert all(not mod._forward_pre_hooks for mod in m.modules())
    with pytest.raises(RuntimeError):
        collect_input_stats(m, [torch.randn(3, 5)])
    assert all(not mod._forward_pre_hooks for mod in m.modules())


def test_sparsegpt_one_pass_and_sequential_agree_on_a_single_layer():
    x = [_correlated_inputs(64)]
    one = nn.Sequential(nn.Linear(16, 8))
    seq = copy.deepcopy(one)
    sparsa.sparsify(one, SparseGPT(sparsifier=Magnitude(0.5, per="row"), calibration=x, sequential=False))
    sparsa.sparsify(seq, SparseGPT(sparsifier=Magnitude(0.5, per="row"), calibration=x))
    torch.testing.assert_close(one[0].weight.to_dense(), seq[0].weight.to_dense())
    with pytest.raises(ValueError, match="never called"):
        sparsa.sparsify(
            nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 8)),
            SparseGPT(sparsifier=Magnitude(0.5), calibration=x, forward=lambda m, b: m[0](b), sequential=False),
            lambda m, name: name == "1",
        )


def test_distillation_loss_checks_output_count():
    from sparsa.methods import distillation_loss

    a, b = torch.randn(4, 8), torch.randn(4, 8)
    assert float(distillation_loss(a, a)) == pytest.approx(0.0, abs=1e-6)
    assert float(distillation_loss([a, b], [a, b])) == pytest.approx(0.0, abs=1e-6)
    assert float(distillation_loss((a,), (b,))) > 0
    with pytest.raises(ValueError, match="outputs"):
        distillation_loss([a, b], [a])


def test_logit_distillation_loss_is_the_kl_of_the_next_token_distributions():
    from sparsa.methods import logit_distillation_loss

    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    ps, pt = torch.softmax(s.double(), -1), torch.softmax(t.double(), -1)
    ref = (pt * (pt.log() - ps.log())).sum(-1).mean()  # KL(teacher || student), mean over positions
    assert float(logit_distillation_loss(s, t)) == pytest.approx(float(ref), rel=1e-5)
    assert float(logit_distillation_loss(t + 2.5, t)) == pytest.approx(0.0, abs=1e-6)  # a shift: same distribution
    # temperature T: KL of the softened distributions, times T^2
    ps2, pt2 = torch.softmax(s.double() / 2, -1), torch.softmax(t.double() / 2, -1)
    ref2 = 4 * (pt2 * (pt2.log() - ps2.log())).sum(-1).mean()
    assert float(logit_distillation_loss(s, t, temperature=2.0)) == pytest.approx(float(ref2), rel=1e-5)
    # bf16 logits are compared in float32
    assert float(logit_distillation_loss(s.bfloat16(), s.bfloat16())) == pytest.approx(0.0, abs=1e-6)
    assert float(logit_distillation_loss([s, t], [t, t])) == pytest.approx(float(ref), rel=1e-5)
    with pytest.raises(ValueError, match="shape"):
        logit_distillation_loss(s, t[:, :4])
    with pytest.raises(ValueError, match="temperature"):
        logit_distillation_loss(s, t, temperature=0)
    with pytest.raises(ValueError, match="outputs"):
        logit_distillation_loss([s, t], [t])
