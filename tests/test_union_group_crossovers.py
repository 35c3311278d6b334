"""The union kernels' pixel-group size is chosen by ratio crossovers (sparsa.crossovers), refitted per CPU."""

import pytest
import torch
import torch.nn.functional as F

from sparsa import cost_model, crossovers
from sparsa.adaptive import conv_union, relu_conv2d
from sparsa.cost_model import CostModel
from sparsa.kernels import adaptive_union as U
from sparsa.kernels import adaptive_union_bf16 as B
from sparsa.ops import crossover_refit

needs_native = pytest.mark.skipif(not U.union_native(), reason="union kernels need AVX-512 and the native build")
NAMES = ("conv_union.fwd_group4", "conv_union.fwd_group4_bf16_tiles", "conv_union.dy_group4")


@pytest.fixture
def table(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSA_COST_DIR", str(tmp_path))
    return cost_model.default_cost_model()


def _union_ratio(x):
    """4 x (run of 4 pixels along a row, channel) pairs holding a nonzero / nonzeros, in PyTorch."""
    N, C, H, W = x.shape
    runs = (x != 0).reshape(N, C, H, W // 4, 4)
    return 4.0 * float(runs.any(-1).sum()) / float(runs.sum())


@pytest.mark.parametrize("ratio", [1.0, 1.3, 2.2, 3.0, 3.5, 4.0])
def test_union_pattern_has_the_ratio_and_density_asked_for(ratio):
    torch.manual_seed(0)
    x = crossover_refit.union_pattern((4, 32, 8, 16), ratio, density=0.25)
    assert abs(_union_ratio(x) - ratio) < 0.05 * ratio and bool((x >= 0).all())
    density = float((x != 0).float().mean())
    # up to a ratio of about 3 the blocks hold the density asked for; above, fewer nonzeros fit
    assert abs(density - 0.25) < 0.02 if ratio <= 3.0 else 0.1 < density < 0.25
    # 2x2 tiles see the clustering runs of 4 see: their union ratio is about the same
    tiles = (x != 0).reshape(4, 32, 4, 2, 8, 2).permute(0, 1, 2, 4, 3, 5).reshape(4, 32, 32, 4)
    assert abs(4.0 * float(tiles.any(-1).sum()) / float(tiles.sum()) - ratio) < 0.1 * ratio
    with pytest.raises(ValueError, match="multiple of 4"):
        crossover_refit.union_pattern((1, 8, 4, 6), 2.0)
    with pytest.raises(ValueError, match="height must be even"):
        crossover_refit.union_pattern((1, 8, 5, 8), 2.0)


def test_ratio_crossovers_have_their_old_defaults_and_describe_themselves(table, monkeypatch):
    monkeypatch.setattr(crossovers, "_this_class", lambda: "some-other-cpu")
    assert [crossovers.crossover(n) for n in NAMES] == [1.65, 2.4, 2.2]
    assert crossovers.describe(NAMES[0], 1.65) == "4-pixel groups up to a union ratio of 1.65, 2-pixel groups above"
    with pytest.raises(ValueError, match="ratio crossover"):
        crossovers.token_crossover(NAMES[0])
    # refitted on request only: their synthetic timing case did not carry over to clustered activations
    monkeypatch.setattr(crossovers, "_this_class", lambda: "amd-avx512")
    assert [crossovers.crossover(n) for n in NAMES] == [1.65, 2.4, 2.2]
    assert not any(crossovers.CROSSOVERS[n].refit_by_default for n in NAMES)


@pytest.mark.parametrize("low_wins_at,expected", [({1.2, 1.4, 1.65, 2.6}, 1.65), (set(), 1.0)])
def test_a_ratio_crossover_is_the_top_of_the_first_winning_run(tmp_path, monkeypatch, low_wins_at, expected):
    def fake_case(r, N, C, H):
        low = 1.0 if r in low_wins_at else 3.0
        return r + 0.001, {"low": lambda: low, "high": lambda: 2.0}  # the ratio built, rounded to 0.01

    monkeypatch.setitem(crossover_refit._CASES, NAMES[0], fake_case)
    monkeypatch.setattr(crossover_refit, "round_robin_ms", lambda fns, rounds: {k: f() for k, f in fns.items()})
    cm = CostModel(tmp_path / "t.json")
    assert crossover_refit.refit(cm, names=[NAMES[0]], densities=(0.5,)) == {NAMES[0]: expected}
    fit = cm.fit(crossovers.PREFIX + NAMES[0])
    assert fit["max_ratio"] == expected and [s["dims"] for s in fit["shapes"]] == [
        list(d) for d in crossovers.CROSSOVERS[NAMES[0]].shapes
    ]
    # an explicit size: one 3x3 conv over 16x16 images with that many channels
    crossover_refit.refit(cm, names=[NAMES[0]], shape=(8, 24))
    assert [s["dims"] for s in cm.fit(crossovers.PREFIX + NAMES[0])["shapes"]] == [[2, 24, 16]]
    assert crossovers.crossover(NAMES[0], cm) == expected


@needs_native
def test_the_forward_group_follows_the_stored_crossover(table):
    torch.manual_seed(1)
    x = crossover_refit.union_pattern((2, 64, 8, 8), 2.0)  # 8x8: no 2x2 tiles
    w = torch.randn(32, 64, 3, 3)
    want = F.conv2d(x.relu(), w, padding=1)
    for stored, group in ((1.9, "fwd_g2"), (2.1, "fwd_g4")):
        table.set_fit(crossovers.PREFIX + "conv_union.fwd_group4", {"max_ratio": stored})
        before = conv_union.union_paths.copy()
        y = relu_conv2d(x, w, None, padding=1)
        assert (conv_union.union_paths - before)[group] == 1
        torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)


@needs_native
def test_the_dy_side_group_follows_the_stored_crossover(table, monkeypatch):
    torch.manual_seed(2)
    x = torch.randn(2, 32, 8, 8).requires_grad_()
    w = torch.randn(32, 32, 3, 3)
    gy = crossover_refit.union_pattern((2, 32, 8, 8), 3.0, density=0.1)
    groups = []
    real = conv_union._u.union_conv_igrad
    monkeypatch.setattr(
        conv_union._u, "union_conv_igrad", lambda *a, group=4, **k: groups.append(group) or real(*a, group=group, **k)
    )
    xr = x.detach().clone().requires_grad_()
    F.conv2d(xr.relu(), w, padding=1).backward(gy)
    for stored, group in ((2.5, 2), (3.5, 4)):
        table.set_fit(crossovers.PREFIX + "conv_union.dy_group4", {"max_ratio": stored})
        groups.clear()
        x.grad = None
        relu_conv2d(x, w, None, padding=1).backward(gy)
        if not groups:
            pytest.skip("the cost model sent the input gradient to another side on this CPU")
        assert groups == [group]
        torch.testing.assert_close(x.grad, xr.grad, atol=1e-4, rtol=1e-4)


@needs_native
@pytest.mark.parametrize("name", NAMES)
def test_each_union_case_times_group_4_against_group_2_at_the_ratio_built(name, monkeypatch):
    if name.endswith("bf16_tiles") and not B.union_dpbf16():
        assert crossover_refit._CASES[name](2.0, 2, 64, 16) is None  # no bf16 union kernels: nothing timed
        return
    groups = []
    target = (
        (B, "union_conv_fwd_bf16") if "bf16" in name else (U, "union_conv_fwd" if "fwd" in name else "union_conv_igrad")
    )
    real = getattr(*target)
    monkeypatch.setattr(*target, lambda *a, group=4, **k: groups.append(group) or real(*a, group=group, **k))
    r, fns = crossover_refit._CASES[name](2.6, 2, 64, 16)
    assert abs(r - 2.6) < 0.15 and set(fns) == {"low", "high"}
    fns["low"]()
    fns["high"]()
    assert groups == [4, 2]
