"""sparsa.crossovers: the sparse backward kernels' density crossovers are data, refitted per CPU."""

import pytest
import torch
import torch.nn.functional as F

import sparsa
from sparsa import cli, cost_model
from sparsa.cost_model import CostModel
from sparsa.layouts import GroupedNM, RowGroup, SlicedELL
from sparsa import crossovers
from sparsa.ops import crossover_refit
from sparsa.ops import native_grouped_nm, native_linear
from sparsa.kernels import adaptive_union as U
from sparsa.kernels import adaptive_union_bf16 as B
from sparsa.kernels import bitmask as bm


@pytest.fixture
def table(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSA_COST_DIR", str(tmp_path))
    return cost_model.default_cost_model()


def test_defaults_until_refitted(table, monkeypatch):
    for name, c in crossovers.CROSSOVERS.items():
        assert crossovers.crossover(name) == crossovers.builtin_default(name)
    # the figure measured on this CPU class where there is one, else the default
    monkeypatch.setattr(crossovers, "_this_class", lambda: "amd-avx2")
    assert (
        crossovers.crossover("row_group.backward") == crossovers.CROSSOVERS["row_group.backward"].by_class["amd-avx2"]
    )
    monkeypatch.setattr(crossovers, "_this_class", lambda: "some-other-cpu")
    for name, c in crossovers.CROSSOVERS.items():
        assert crossovers.crossover(name) == c.default
    table.set_fit(crossovers.PREFIX + "row_group.backward", {"max_density": 0.4})
    assert crossovers.crossover("row_group.backward") == 0.4
    with pytest.raises(ValueError, match="unknown name"):
        crossovers.crossover("nope")


def _grads(w, x, gy):
    x = x.clone().requires_grad_(True)
    p = w.clone().requires_grad_(True) if isinstance(w, torch.Tensor) and not isinstance(w, sparsa.SparseTensor) else w
    F.linear(x, p).backward(gy)
    return x.grad


CASES = {
    "row_group.backward": (
        lambda d: sparsa.to_sparse(d, RowGroup, group=4, sparsity=0.75),
        native_linear,
        "_rg_grad_input",
    ),
    "sliced_ell.grad_input": (lambda d: sparsa.to_sparse(d, SlicedELL, sparsity=0.9), native_linear, "_se_grad_input"),
    "grouped_nm.grad_weight": (
        lambda d: sparsa.to_sparse(d, GroupedNM, n=1, m=8, g=4),
        native_grouped_nm,
        "_grad_weight_sparse",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_stored_crossover_picks_the_path_and_both_paths_agree(table, name, monkeypatch):
    make, module, _ = CASES[name]
    torch.manual_seed(0)
    w = make(torch.randn(24, 32)).requires_grad_(True)
    x, gy = torch.randn(10, 32), torch.randn(10, 24)
    dense_w = w.to_dense().detach().requires_grad_(True)
    x_ref = x.clone().requires_grad_(True)
    F.linear(x_ref, dense_w).backward(gy)
    results = {}
    for forced in (1.0, 0.0):  # sparse side everywhere, then dense side everywhere
        table.set_fit(crossovers.PREFIX + name, {"max_density": forced})
        xi = x.clone().requires_grad_(True)
        w.grad = None
        F.linear(xi, w).backward(gy)
        results[forced] = (xi.grad, w.grad.to_dense() if isinstance(w.grad, sparsa.SparseTensor) else w.grad)
        torch.testing.assert_close(xi.grad, x_ref.grad, rtol=1e-4, atol=1e-4)
    for a, b in zip(results[1.0], results[0.0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_refit_stores_a_measured_crossover_for_every_name(tmp_path):
    cm = CostModel(tmp_path / "t.json")
    out = crossover_refit.refit(cm, densities=(0.125, 0.25), shape=(64, 64), tokens=32, rounds=1)
    by_default = {n for n, c in crossovers.CROSSOVERS.items() if c.refit_by_default}
    assert set(out) == by_default and {n for n in crossovers.CROSSOVERS if n.startswith("conv_union.")}.isdisjoint(out)
    out.update(crossover_refit.refit(cm, names=sorted(set(crossovers.CROSSOVERS) - by_default), shape=(64, 64)))
    for name, d in out.items():
        fit = CostModel(tmp_path / "t.json").fit(crossovers.PREFIX + name)
        c = crossovers.CROSSOVERS[name]
        if c.unit == "tokens":  # its own grid of token counts; the low side wins up to d at every one
            grid = [int(t) for t in c.grid]
            if not fit["ratios"]:  # the 2:4 panel kernel does not run here: the bitmask strategies always
                assert name == "nm24.panel_bf16" and d == grid[-1] and c.absent == "low"
                continue
            assert fit["max_tokens"] == d and sorted(fit["ratios"], key=int) == [str(t) for t in grid]
            assert all(fit["ratios"][str(t)] >= 1 for t in grid if t <= d) and (d == grid[0] - 1 or d in grid)
            if d < grid[-1]:  # the next point up lost
                assert fit["ratios"][str(min(t for t in grid if t > d))] <= 1
            assert crossovers.crossover(name, cm) == d
            continue
        if c.unit == "ratio":  # 4-pixel groups up to d: a ratio built there, or 1 (2-pixel groups always)
            assert fit["max_ratio"] == d and (d == 1.0 or str(d) in fit["ratios"])
            # timed where the union kernels run (AVX-512; the tiles one AVX512-BF16 too), else nothing timed
            runs = U.union_native() and (name != "conv_union.fwd_group4_bf16_tiles" or B.union_dpbf16())
            assert bool(fit["ratios"]) == runs
            assert crossovers.crossover(name, cm) == d and fit["shapes"][0]["dims"] == [2, 64, 16]
            continue
        if not fit["ratios"]:  # a bitmask panel kernel this CPU lacks: nothing timed, the dense side stays
            assert name in set(bm.PANEL_CROSSOVERS.values()) | set(bm.BATCH_PANEL_CROSSOVERS.values()) and d == 0.0
            continue
        assert fit["max_density"] == d and (d == 0.0 or str(d) in fit["ratios"]) and len(fit["ratios"]) == 2
        assert crossovers.crossover(name, cm) == d
    with pytest.raises(ValueError, match="densities"):
        crossover_refit.refit(cm, densities=(1.5,))
    with pytest.raises(ValueError, match="unknown name"):
        crossover_refit.refit(cm, names=["nope"])


def test_refit_of_a_panel_kernel_this_cpu_lacks_keeps_expand(tmp_path, monkeypatch):
    from sparsa.kernels import bitmask as bm

    monkeypatch.setattr(bm, "has_panel_bf16", lambda: False)
    cm = CostModel(tmp_path / "t.json")
    out = crossover_refit.refit(cm, names=["bitmask.panel_bf16"], densities=(0.5,), shape=(32, 64), tokens=16)
    assert out == {"bitmask.panel_bf16": 0.0}
    assert cm.fit(crossovers.PREFIX + "bitmask.panel_bf16")["ratios"] == {}
    assert bm.panel_max_density(torch.bfloat16) == crossovers.builtin_default("bitmask.panel_bf16")
    assert bm.choose_strategy(64, torch.bfloat16, 0.01) == ("amx" if bm.has_amx() else "expand")


def test_refit_times_the_panel_against_expand(tmp_path):
    from sparsa.kernels import bitmask as bm

    if not bm.has_panel_f32():
        pytest.skip("no AVX2 build of the bitmask kernels here: the float32 panel kernel does not run")
    cm = CostModel(tmp_path / "t.json")
    crossover_refit.refit(cm, names=["bitmask.panel_f32"], densities=(0.3, 0.5), shape=(64, 200), tokens=64)
    fit = cm.fit(crossovers.PREFIX + "bitmask.panel_f32")
    assert sorted(fit["ratios"]) == ["0.3", "0.5"] and all(r > 0 for r in fit["ratios"].values())
    assert crossovers.crossover("bitmask.panel_f32", cm) == fit["max_density"]


def test_batch_panel_case_streams_copies_of_the_weight(monkeypatch):
    # batched decoding reads every weight from memory: up to BATCH_MAX_TOKENS the case cycles through copies
    from sparsa.kernels import bitmask as bm

    monkeypatch.setattr(bm, "has_panel_f32", lambda: True)
    calls = []
    monkeypatch.setattr(bm, "bitmask_linear_impl", lambda x, bits, *a: calls.append((x.shape[0], bits.data_ptr())))
    case = crossover_refit._CASES["bitmask.batch_panel_f32"]
    for tokens in (16, bm.BATCH_MAX_TOKENS + 1):
        calls.clear()
        _, fns = case(0.5, 32, 64, tokens)
        fns["low"]()
        copies = 1 if tokens > bm.BATCH_MAX_TOKENS else 1024  # capped; (32 x 64) is far under STREAM_BYTES
        assert len(calls) == copies and len({p for _, p in calls}) == copies and calls[0][0] == tokens


def test_batch_panel_crossovers_by_cpu_class(monkeypatch, tmp_path):
    from sparsa.kernels import bitmask as bm

    monkeypatch.setenv("SPARSA_COST_DIR", str(tmp_path))
    monkeypatch.setattr(crossovers, "_this_class", lambda: "amd-avx512")
    assert bm.panel_max_density(torch.bfloat16, 16) == 0.4 and bm.panel_max_density(torch.float32, 16) == 0.9
    monkeypatch.setattr(crossovers, "_this_class", lambda: "unmeasured-class")  # bf16 waits for a refit
    assert bm.panel_max_density(torch.bfloat16, 16) == 0.0 and bm.panel_max_density(torch.float32, 16) == 0.3
    monkeypatch.setattr(crossovers, "_this_class", lambda: "intel-amx")
    # the AMX tiles beat the panel at every density there
    assert bm.panel_max_density(torch.bfloat16, 16) == 0.0 and bm.panel_max_density(torch.float32, 16) == 0.9


def test_token_crossovers_by_cpu_class(monkeypatch, tmp_path):
    from sparsa.kernels import bitmask as bm

    monkeypatch.setenv("SPARSA_COST_DIR", str(tmp_path))
    monkeypatch.setattr(crossovers, "_this_class", lambda: "amd-avx512")
    assert bm.stream_max_tokens(torch.bfloat16) == 12 and bm.stream_max_tokens(torch.float32) == 6
    assert bm.row_blocks_max_tokens() == 256
    assert crossovers.token_crossover(bm.BATCH_STREAM_CROSSOVER) == 16
    monkeypatch.setattr(crossovers, "_this_class", lambda: "unmeasured-class")  # the old constants
    assert bm.stream_max_tokens(torch.bfloat16) == bm.stream_max_tokens(torch.float32) == 8
    assert bm.row_blocks_max_tokens() == 511
    assert crossovers.token_crossover(bm.BATCH_STREAM_CROSSOVER) == 0  # never: expand, as before
    monkeypatch.setattr(crossovers, "_this_class", lambda: "intel-amx")  # bf16: against the AMX tiles
    assert bm.stream_max_tokens(torch.bfloat16) == 3 and bm.stream_max_tokens(torch.float32) == 10
    assert crossovers.token_crossover(bm.BATCH_STREAM_CROSSOVER) == 3  # the AMX tiles from 4 tokens
    assert bm.fused_max_tokens() == 192
    assert bm.row_blocks_max_tokens() == 63


def test_refit_stores_the_median_over_the_shapes(tmp_path, monkeypatch):
    # a fake measurement whose crossover grows with the first dimension: 0.2, 0.4 and 0.6 at the three shapes
    wins_below = {1: 0.25, 2: 0.45, 3: 0.65}

    def fake_case(d, a, b, c):
        fast, slow = (lambda: 1.0), (lambda: 2.0)
        return d, {"low": fast if d < wins_below[a] else slow, "high": slow if d < wins_below[a] else fast}

    monkeypatch.setitem(crossover_refit._CASES, "relu_compact.linear", fake_case)
    monkeypatch.setitem(
        crossovers.CROSSOVERS,
        "relu_compact.linear",
        crossovers.Crossover(0.25, "test", (0.2, 0.4, 0.6), ((3, 1, 1), (1, 1, 1), (2, 1, 1))),
    )
    monkeypatch.setattr(crossover_refit, "round_robin_ms", lambda fns, rounds: {k: f() for k, f in fns.items()})
    cm = CostModel(tmp_path / "t.json")
    assert crossover_refit.refit(cm, names=["relu_compact.linear"]) == {"relu_compact.linear": 0.4}
    fit = CostModel(tmp_path / "t.json").fit(crossovers.PREFIX + "relu_compact.linear")
    per_shape = [(p["dims"], p["max_density"]) for p in fit["shapes"]]
    assert per_shape == [([3, 1, 1], 0.6), ([1, 1, 1], 0.2), ([2, 1, 1], 0.4)]
    assert fit["ratios"] == {"0.2": 2.0, "0.4": 2.0, "0.6": 0.5}  # the median shape's own figures
    # an explicit size replaces the crossover's own shapes
    assert crossover_refit._dims("relu_compact.linear", (24, 32), 16) == [(16, 32, 24)]
    assert crossover_refit._dims("relu_compact.conv2d", None, None) == list(
        crossover_refit.CROSSOVERS["relu_compact.conv2d"].shapes
    )


def test_cli_refit_and_clear(table, monkeypatch, capsys):
    monkeypatch.setattr(crossover_refit, "refit", lambda cm: {n: 0.2 for n in crossovers.CROSSOVERS})
    from sparsa.adaptive import cost_fits_refit

    monkeypatch.setattr(cost_fits_refit, "refit", lambda cm: ({}, {}))  # tests/test_adaptive_cost_fits.py
    assert cli.main(["cost", "--refit"]) == 0
    assert "crossover row_group.backward: sparse at density <= 0.2" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["cost", "--clear", "--refit"])
    assert e.value.code == 2 and "not both" in capsys.readouterr().err


def _fake_timer(monkeypatch):
    monkeypatch.setattr(crossover_refit, "round_robin_ms", lambda fns, rounds: {k: f() for k, f in fns.items()})


@pytest.mark.parametrize(
    "low_wins_at,expected",
    [({4, 6, 8, 12}, 8), (set(), 3), (set(crossovers.CROSSOVERS["bitmask.stream_f32"].grid), 32), ({6, 8}, 3)],
)
def test_a_token_crossover_is_the_top_of_the_low_sides_first_winning_run(tmp_path, monkeypatch, low_wins_at, expected):
    # the stream loop wins at 4, 6, 8, loses at 10 and wins again at 12 by noise: it takes up to 8 tokens
    calls = []

    def fake_case(T, R, K):
        calls.append((T, R, K))
        low = 1.0 if T in low_wins_at else 3.0
        # the high side's fastest way counts: 2.0, not the slower 5.0
        return T, {"low": lambda: low, "high_expand": lambda: 5.0, "high_panel": lambda: 2.0}

    monkeypatch.setitem(crossover_refit._CASES, "bitmask.stream_f32", fake_case)
    _fake_timer(monkeypatch)
    cm = CostModel(tmp_path / "t.json")
    out = crossover_refit.refit(cm, names=["bitmask.stream_f32"], densities=(0.5,), shape=(24, 40), tokens=7)
    assert out == {"bitmask.stream_f32": expected}
    fit = CostModel(tmp_path / "t.json").fit(crossovers.PREFIX + "bitmask.stream_f32")
    assert fit["max_tokens"] == expected and "max_density" not in fit
    assert fit["ratios"]["4"] == (2.0 if 4 in low_wins_at else round(2 / 3, 3))
    # its own token grid at the explicit shape; neither densities nor tokens apply to it
    assert {c[1:] for c in calls} == {(24, 40)}
    assert [c[0] for c in calls] == list(crossovers.CROSSOVERS["bitmask.stream_f32"].grid)
    assert crossovers.crossover("bitmask.stream_f32", cm) == crossovers.token_crossover("bitmask.stream_f32", cm)


def test_token_crossovers_decide_the_bitmask_strategies(table):
    from sparsa.kernels import bitmask as bm

    bf = torch.bfloat16
    table.set_fit(crossovers.PREFIX + "bitmask.stream_bf16", {"max_tokens": 12})
    table.set_fit(crossovers.PREFIX + "bitmask.stream_f32", {"max_tokens": 1})
    assert bm.stream_max_tokens(bf) == 12 and bm.choose_strategy(12, bf, 0.5) == "stream"
    assert bm.choose_strategy(13, bf, 0.5) == bm.many_token_strategy(13, bf, 0.5) != "stream"
    # fewer tokens than the grid starts at always stream: no refit measured them
    assert bm.stream_max_tokens(torch.float32) == 3 and bm.choose_strategy(3, torch.float32, 0.5) == "stream"
    assert bm.choose_strategy(4, torch.float32, 0.5) != "stream"
    table.set_fit(crossovers.PREFIX + "bitmask.stream_f32", {"max_tokens": 20})  # a refit: read again
    assert bm.choose_strategy(20, torch.float32, 0.5) == "stream"
    table.set_fit(crossovers.PREFIX + bm.ROW_BLOCKS_CROSSOVER, {"max_tokens": 256})
    assert bm.row_blocks_max_tokens() == 256
    with pytest.raises(ValueError, match="dtype must be one of"):
        bm.choose_strategy(4, torch.float16)
    with pytest.raises(ValueError, match="density crossover"):
        crossovers.token_crossover("bitmask.panel_f32")
    with pytest.raises(ValueError, match="unit must be one of"):
        crossovers.Crossover(1, "x", unit="rows")
    assert crossovers.describe("bitmask.stream_bf16", 12.0) == "stream up to 12 tokens, panel, amx or expand above"
    assert crossovers.describe("row_group.backward", 0.2) == "sparse at density <= 0.2"


def test_the_stream_case_times_stream_against_panel_and_expand_on_streamed_copies(monkeypatch):
    from sparsa.kernels import bitmask as bm

    if bm.native_library() is None:
        pytest.skip("no native kernel here")
    calls = []
    monkeypatch.setattr(
        bm, "bitmask_linear_impl", lambda x, bits, rp, v, b, R, s: calls.append((x.shape[0], bits.data_ptr(), s))
    )
    T, fns = crossover_refit._CASES["bitmask.stream_bf16"](10, 32, 64)
    dense = {"high_amx"} if bm.has_amx() else set()
    assert T == 10 and set(fns) == {"low", "high_expand"} | ({"high_panel"} if bm.has_panel_bf16() else set()) | dense
    for key, strategy in (("low", "stream"), ("high_expand", "expand")) + ((("high_amx", "amx"),) if dense else ()):
        calls.clear()
        fns[key]()
        assert {s for *_, s in calls} == {strategy} and len({p for _, p, _ in calls}) == len(calls) == 1024
        assert calls[0][0] == 10


def test_the_fused_case_times_fused_against_expand_on_streamed_copies(monkeypatch):
    from sparsa.kernels import bitmask as bm

    if not bm.has_fused_f32():
        assert crossover_refit._CASES["bitmask.fused_f32"](64, 32, 48) is None  # expand at every token count
        pytest.skip("this CPU (or SPARSA_ISA) has no AVX-512F: the fused kernel does not run")
    calls = []
    monkeypatch.setattr(
        bm, "bitmask_linear_impl", lambda x, bits, rp, v, b, R, s: calls.append((x.shape[0], v.data_ptr(), s))
    )
    T, fns = crossover_refit._CASES["bitmask.fused_f32"](64, 32, 48)
    assert T == 64 and set(fns) == {"low", "high"}
    for key, strategy in (("low", "fused"), ("high", "expand")):
        calls.clear()
        fns[key]()
        assert {s for *_, s in calls} == {strategy} and len({p for _, p, _ in calls}) == len(calls) > 1


def test_the_row_blocks_case_times_row_blocks_against_the_whole_weight(monkeypatch):
    from sparsa.kernels import bitmask as bm

    if bm.native_library() is None:
        pytest.skip("no native kernel here")
    seen = []
    monkeypatch.setattr(bm, "_expand", lambda *a, whole: seen.append((a[2].shape, whole)))
    T, fns = crossover_refit._CASES["bitmask.row_blocks_f32"](64, 32, 48)
    fns["low"]()
    fns["high"]()
    assert T == 64 and seen == [((64, 48), False), ((64, 48), True)]


def test_a_bf16_weight_too_dense_for_the_panel_streams_up_to_the_batch_stream_crossover(table, monkeypatch):
    from sparsa.kernels import bitmask as bm

    bf = torch.bfloat16
    monkeypatch.setattr(bm, "has_panel_bf16", lambda: True)
    monkeypatch.setattr(bm, "has_panel_f32", lambda: True)
    table.set_fit(crossovers.PREFIX + "bitmask.stream_bf16", {"max_tokens": 8})
    table.set_fit(crossovers.PREFIX + "bitmask.batch_panel_bf16", {"max_density": 0.4})
    table.set_fit(crossovers.PREFIX + "bitmask.batch_panel_f32", {"max_density": 0.4})
    table.set_fit(crossovers.PREFIX + bm.BATCH_STREAM_CROSSOVER, {"max_tokens": 16})
    monkeypatch.setattr(bm, "has_amx", lambda: False)
    assert [bm.choose_strategy(t, bf, 0.5) for t in (8, 9, 16, 17)] == ["stream", "stream", "stream", "expand"]
    assert bm.choose_strategy(16, bf, 0.3) == "panel"  # sparse enough for the panel: it comes first
    assert bm.choose_strategy(16, torch.float32, 0.5) == bm.dense_strategy(16, torch.float32) != "stream"  # bf16 only
    table.set_fit(crossovers.PREFIX + bm.BATCH_STREAM_CROSSOVER, {"max_tokens": 0})
    assert bm.choose_strategy(9, bf, 0.5) == "expand"


def test_the_batch_stream_case_times_stream_against_the_dense_sides_only(monkeypatch):
    from sparsa.kernels import bitmask as bm

    if bm.native_library() is None:
        pytest.skip("no native kernel here")
    monkeypatch.setattr(bm, "bitmask_linear_impl", lambda x, bits, rp, v, b, R, s: s)
    T, fns = crossover_refit._CASES["bitmask.batch_stream_bf16"](16, 32, 64)
    dense = {"high_amx"} if bm.has_amx() else set()  # no panel: this crossover is for weights too dense for it
    assert T == 16 and set(fns) == {"low", "high_expand"} | dense
    assert set(fns["low"]()) == {"stream"} and set(fns["high_expand"]()) == {"expand"}
    assert not dense or set(fns["high_amx"]()) == {"amx"}
