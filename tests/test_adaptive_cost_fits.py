"""sparsa.adaptive.cost_fits: the conv backward's fitted cost models are data in the cost table, refitted per CPU."""

import itertools

import pytest
import torch

from sparsa import cli, cost_model
from sparsa.adaptive import conv as M
from sparsa.adaptive import conv_union as U
from sparsa.adaptive import cost_fits, cost_fits_refit, relu_conv2d
from sparsa.cost_model import CostModel
from sparsa.kernels import adaptive as K


@pytest.fixture
def table(tmp_path, monkeypatch):
    """An empty cost table, on a CPU class without measured coefficients (the defaults are in effect)."""
    monkeypatch.setenv("SPARSA_COST_DIR", str(tmp_path))
    monkeypatch.setattr(cost_fits, "_this_class", lambda: "some-other-cpu")
    monkeypatch.setattr(cost_fits, "_CACHE", {})
    return cost_model.default_cost_model()


# The formulas as they were written in code before they became data: the defaults must reproduce them exactly.
def _old_dx_costs(d_x, d_g, C, O, stride1):
    cost = {"x": 0.2 + 1.6 * d_x + (0.1 if C * O >= 512 * 256 else 0.0)}
    if not stride1:
        cost["dense"] = 1.03
    elif d_g is not None:
        cost["dy"] = 0.5 + 0.65 * d_g
    return cost


def _old_dw_costs(d_x, d_g, C, O, ratio):
    r = 2.0 if ratio is None else min(4.0, max(1.0, ratio))
    lists = 0.04 + 1.45 * d_x + (0.08 if C <= 64 else 0.0) + (0.12 if C * O >= 512 * 256 else 0.0)
    cost = {"lists": lists, "x": 0.3 + 0.65 * d_x * r - (0.1 if C * O >= 512 * 256 else 0.0)}
    if d_g is not None:
        cost["dy"] = 0.45 + 0.75 * d_g
        cost["dy_lists"] = 0.11 + 1.25 * d_g  # the list kernel over dY's nonzeros, added as data
    return cost


def _old_dy_rule(nnz_x, nnz_dy, numel_dy, C, O, need_dw):
    new = (0.375 * nnz_dy * C + 0.0625 * numel_dy * O) * max(1.0, C / O) ** 0.5
    return new < (0.6 if need_dw else 0.8) * nnz_x * O


DENSITIES = [i / 20 for i in range(21)] + [0.123, 0.377, 0.61]
CHANNELS = [16, 64, 128, 256, 512]


def test_defaults_reproduce_the_old_decisions(table):
    assert not table.fit_keys()
    for d_x, d_g, C, O in itertools.product(DENSITIES, [None] + DENSITIES, CHANNELS, CHANNELS):
        for stride1 in (True, False):
            assert U._dx_costs(d_x, d_g, C, O, stride1) == _old_dx_costs(d_x, d_g, C, O, stride1)
            old = _old_dx_costs(d_x, d_g, C, O, stride1)
            assert U._dx_side(d_x, d_g, C, O, stride1) == min(old, key=old.get)
        for ratio in (None, 0.5, 1.0, 1.7, 3.0, 5.0):
            old = _old_dw_costs(d_x, d_g, C, O, ratio)
            assert U._dw_costs(d_x, d_g, C, O, ratio) == old
            assert U._dw_side(d_x, d_g, C, O, ratio) == min(old, key=old.get)
        if d_g is None:
            assert U._dx_x_certain(d_x, C, O) == (_old_dx_costs(d_x, None, C, O, True)["x"] < 0.5)
    assert U._dy_floor("conv_union.dw.dy") == 0.45 and U._dy_floor("conv_union.dx.dy") == 0.5
    numel = 2 * 8 * 8 * 64
    for d_x, d_g, C, O, need_dw in itertools.product(DENSITIES, DENSITIES, CHANNELS, CHANNELS, (True, False)):
        nnz_x, nnz_dy = round(d_x * numel), d_g * numel
        assert M._dy_rule(nnz_x, nnz_dy, numel, C, O, need_dw) == _old_dy_rule(nnz_x, nnz_dy, numel, C, O, need_dw)
    assert M._DW_DY_RATIO is None and cost_fits.coefficients("conv_list.dw.dy")["ratio"] == 0.75


def test_a_stored_fit_changes_the_decision_and_forgetting_it_restores_the_default(table):
    assert U._dx_side(0.3, 0.3, 128, 128, True) == "x"  # 0.68 against 0.695
    assert U._dx_x_certain(0.1, 128, 128)  # 0.36 below the dY side's floor 0.5
    table.set_fit(cost_fits.PREFIX + "conv_union.dx.dy", {"base": 0.3, "per_dg": 0.65})
    assert U._dx_side(0.3, 0.3, 128, 128, True) == "dy"
    assert U._dx_x_certain(0.05, 128, 128) and not U._dx_x_certain(0.1, 128, 128)  # floor now 0.3
    assert U._dw_side(0.5, None, 128, 128) == "lists"
    table.set_fit(cost_fits.PREFIX + "conv_union.dw.x", {"base": 0.0, "per_dx_ratio": 0.1, "big_weight": 0.0})
    assert U._dw_side(0.5, None, 128, 128) == "x"

    args = (1000, 1000.0, 8000, 64, 64, False)  # units of nnz(x) O: 0.375 + 0.0625 * 8 = 0.875 > 0.8 -> x path
    assert not M._dy_rule(*args)
    table.set_fit(
        cost_fits.PREFIX + "conv_list.dx.dy", {"per_nnz": 0.7, "fixed": 0.0, "margin": 0.8, "margin_with_dw": 0.6}
    )
    assert M._dy_rule(*args) and not M._dy_rule(*args[:-1], True)

    assert table.forget(cost_fits.PREFIX) == 3
    assert U._dx_side(0.3, 0.3, 128, 128, True) == "x" and not M._dy_rule(*args)
    assert cost_fits.coefficients("conv_union.dx.dy") is cost_fits.COST_FITS["conv_union.dx.dy"].defaults


def test_coefficients_measured_on_this_cpu_class_replace_the_defaults(table, monkeypatch):
    monkeypatch.setattr(cost_fits, "_this_class", lambda: "amd-avx512")
    monkeypatch.setattr(cost_fits, "_CACHE", {})
    measured = cost_fits.COST_FITS["conv_union.dx.dy"].by_class["amd-avx512"]
    assert cost_fits.measured_on_this_class("conv_union.dx.dy")
    assert cost_fits.coefficients("conv_union.dx.dy") == measured == cost_fits.builtin("conv_union.dx.dy")
    # coefficients not measured (size classes) keep their defaults; the list rule reads the class's ratio
    assert (
        cost_fits.builtin("conv_union.dx.x")["big_weight"]
        == cost_fits.COST_FITS["conv_union.dx.x"].defaults["big_weight"]
    )
    assert (
        cost_fits.coefficients("conv_list.dw.dy")["ratio"]
        == cost_fits.COST_FITS["conv_list.dw.dy"].by_class["amd-avx512"]["ratio"]
    )
    # a refit on this machine still wins
    table.set_fit(cost_fits.PREFIX + "conv_union.dx.dy", {"base": 0.1, "per_dg": 0.2})
    assert cost_fits.coefficients("conv_union.dx.dy")["base"] == 0.1
    for name, fit in cost_fits.COST_FITS.items():
        for cls, c in fit.by_class.items():
            assert set(c) == set(fit.defaults), (name, cls)


def test_a_fit_missing_a_coefficient_is_not_trusted(table):
    table.set_fit(cost_fits.PREFIX + "conv_list.dw.dy", {"ratio_old": 3.0})
    assert cost_fits.stored("conv_list.dw.dy") is None and cost_fits.coefficients("conv_list.dw.dy")["ratio"] == 0.75
    with pytest.raises(ValueError, match="unknown name"):
        cost_fits.coefficients("nope")


def test_reads_are_cached_until_the_table_changes(table):
    first = cost_fits.table()
    assert cost_fits.table() is first
    table.observe("linear|x", "sparse", 1.0)  # timings do not touch the fitted models
    assert cost_fits.table() is first
    table.set_fit(cost_fits.PREFIX + "conv_list.dw.dy", {"ratio": 2.0})
    assert cost_fits.table() is not first and cost_fits.table()["conv_list.dw.dy"]["ratio"] == 2.0


def _sparse(shape, zeros, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * (torch.rand(*shape, generator=g) >= zeros)


def test_a_stored_fit_picks_the_list_backward_path(table, monkeypatch):
    if not K.native_available():
        pytest.skip("the dY path of the list kernels is native-only")
    monkeypatch.setattr(U, "KERNELS", "list")
    x = _sparse((2, 16, 8, 8), 0.3, 0) - 0.1
    w = torch.randn(16, 16, 3, 3, generator=torch.Generator().manual_seed(1))
    gy = _sparse((2, 16, 8, 8), 0.9, 2)
    ref = None
    for margin, path in ((1e9, "dy"), (0.0, "x")):
        table.set_fit(
            cost_fits.PREFIX + "conv_list.dx.dy",
            {"per_nnz": 0.375, "fixed": 0.0625, "margin": margin, "margin_with_dw": margin},
        )
        xi = x.clone().requires_grad_(True)
        before = M.backward_paths.copy()
        relu_conv2d(xi, w, None, padding=1).backward(gy)
        assert (M.backward_paths - before) == {path: 1}
        ref = xi.grad if ref is None else ref
        torch.testing.assert_close(xi.grad, ref, atol=1e-4, rtol=1e-4)


def test_refit_stores_what_runs_here_and_says_why_it_skips_the_rest(tmp_path):
    cm = CostModel(tmp_path / "t.json")
    # timings on a tiny shape scatter: the residual gate is tested below, the procedure here
    fitted, skipped = cost_fits_refit.refit(cm, shape=(2, 16, 8, 8), rounds=1, max_residual=float("inf"))
    assert set(fitted) | set(skipped) == set(cost_fits.COST_FITS) and not set(fitted) & set(skipped)
    for name, fit in cost_fits.COST_FITS.items():
        why = cost_fits_refit.skip_reason(fit.kernels)
        if why is None:
            stored = CostModel(tmp_path / "t.json").fit(cost_fits.PREFIX + name)
            assert (
                set(fit.defaults) <= set(stored) and stored["shapes"] == [[2, 16, 8, 8, 16]] and stored["residual"] >= 0
            )
            assert dict(fitted[name]) == {k: stored[k] for k in fit.defaults}
        else:
            assert skipped[name] == why and cm.fit(cost_fits.PREFIX + name) is None
    if not cost_fits_refit._u.union_native():
        assert "AVX-512" in skipped["conv_union.dx.x"]
    with pytest.raises(ValueError, match="unknown name"):
        cost_fits_refit.refit(cm, names=["nope"])
    with pytest.raises(ValueError, match="densities"):
        cost_fits_refit.refit(cm, densities=(0.5,))


def test_timings_that_do_not_fit_their_line_are_not_stored(tmp_path):
    if cost_fits_refit.skip_reason("list") is not None:
        pytest.skip("the list kernels' dY path is native-only")
    cm = CostModel(tmp_path / "t.json")
    names = [n for n, f in cost_fits.COST_FITS.items() if f.kernels == "list"]
    fitted, skipped = cost_fits_refit.refit(cm, names=names, shape=(2, 16, 8, 8), rounds=1, max_residual=-1.0)
    assert not fitted and not cm.fit_keys() and sorted(skipped) == sorted(names)
    assert all("too unsteady" in why for why in skipped.values())
    assert cost_fits.coefficients("conv_list.dx.dy", cm) == cost_fits.builtin("conv_list.dx.dy")


def test_the_list_fit_pools_shapes_and_recovers_the_coefficients():
    # timings made by the models themselves, on convs with C = O, C < O and C > O whose x paths run at
    # different speeds: one fit over all of them must give back the coefficients (per shape, the dY times
    # count in units of that shape's x path; conv._dy_rule's sqrt(C / O) term included)
    per_nnz, fixed, ratio, share = 0.4, 0.05, 0.75, 0.7
    per_shape = []
    for (N, C, H, W, O), u, a in [
        ((16, 64, 32, 32, 64), 2e-6, 3e-6),
        ((16, 64, 16, 16, 128), 5e-6, 4e-6),
        ((16, 128, 16, 16, 64), 1e-6, 6e-6),
    ]:
        acc = {k: [] for k in cost_fits_refit._LIST_TIMINGS}
        numel_x, numel_g = N * C * H * W, N * O * H * W
        for dx in (0.1, 0.25, 0.5):
            nnz_x = int(dx * numel_x)
            acc["x_work"].append(nnz_x * O)
            acc["x_t"].append(u * nnz_x * O)
            acc["dwx_work"].append(nnz_x * O)
            acc["dwx_t"].append(a * nnz_x * O)
            acc["both_share"].append(share)
            for dg in (0.1, 0.25, 0.5):
                nnz_g = int(dg * numel_g)
                row = cost_fits_refit._dy_row(nnz_g, numel_g, C, O)
                acc["dy_rows"].append(row)
                acc["dy_t"].append(u * (per_nnz * row[0] + fixed * row[1]))
                acc["dwdy_work"].append(nnz_g * C)
                acc["dwdy_t"].append(a / ratio * nnz_g * C)
        per_shape.append(acc)
    fits = cost_fits_refit._fit_list(per_shape)
    dx_dy, rel = fits["conv_list.dx.dy"]
    assert dx_dy["per_nnz"] == pytest.approx(per_nnz, rel=1e-6) and dx_dy["fixed"] == pytest.approx(fixed, rel=1e-6)
    assert dx_dy["margin_with_dw"] == pytest.approx(dx_dy["margin"] * share) and rel < 1e-6
    (dw_dy, rel_dw) = fits["conv_list.dw.dy"]
    assert dw_dy["ratio"] == pytest.approx(ratio) and rel_dw < 1e-6
    # a C > O row carries the factor sqrt(C / O)
    assert cost_fits_refit._dy_row(10, 100, 128, 32) == [pytest.approx(2 * 10 * 128), pytest.approx(2 * 100 * 32)]


def test_the_union_refit_procedure_runs_on_the_fallbacks(tmp_path):
    # the union kernels' PyTorch fallbacks stand in where AVX-512 is missing: the timings mean nothing, the
    # procedure (cases, fits, what is stored) is what is tested
    cm = CostModel(tmp_path / "t.json")
    names = [n for n, f in cost_fits.COST_FITS.items() if f.kernels == "union"]
    fitted, skipped = cost_fits_refit.refit(
        cm, names=names, shape=(2, 16, 8, 8), rounds=1, force=["union"], max_residual=float("inf")
    )
    assert sorted(fitted) == sorted(names) and not skipped
    for name in names:
        defaults = cost_fits.COST_FITS[name].defaults
        assert set(fitted[name]) == set(defaults)
        for k in ("big_weight", "small_c"):  # size classes are not varied by the measurement
            if k in defaults:
                assert fitted[name][k] == defaults[k]
        assert cost_fits.coefficients(name, cm) == fitted[name]


def test_cli_lists_the_models_and_refits_them(table, monkeypatch, capsys):
    assert cli.main(["cost"]) == 0
    out = capsys.readouterr().out
    for name in cost_fits.COST_FITS:
        assert f"cost fit {name}: " in out
    assert "cost fit conv_list.dx.dy: per_nnz 0.375, fixed 0.0625, margin 0.8, margin_with_dw 0.6 (default)" in out

    from sparsa.ops import crossover_refit

    monkeypatch.setattr(crossover_refit, "refit", lambda cm: {})

    def fake_refit(cm):
        cm.set_fit(cost_fits.PREFIX + "conv_list.dw.dy", {"ratio": 0.5})
        return {"conv_list.dw.dy": cost_fits.coefficients("conv_list.dw.dy", cm)}, {
            "conv_union.dx.x": "the union kernels need AVX-512",
            "conv_union.dw.x": "the union kernels need AVX-512",
        }

    monkeypatch.setattr(cost_fits_refit, "refit", fake_refit)
    assert cli.main(["cost", "--refit"]) == 0
    out = capsys.readouterr().out
    assert "cost fit conv_list.dw.dy: ratio 0.5 (default ratio 0.75)" in out
    assert "skipped conv_union.dx.x, conv_union.dw.x: the union kernels need AVX-512" in out
    assert "cost fit conv_list.dw.dy: ratio 0.5 (refitted)" in out
    assert "costfit|" not in out  # listed once, by name, not again as a raw fitted model


def test_the_list_refit_regresses_on_the_terms_the_rule_multiplies(tmp_path, monkeypatch):
    # conv_list.dx.dy's ``fixed`` multiplies numel(dY) * O in the rule; a refit that regressed on numel(dY)
    # alone stored an O-times larger ``fixed`` and turned the dY path off on every layer
    if cost_fits_refit.skip_reason("list") is not None:
        pytest.skip(cost_fits_refit.skip_reason("list"))
    seen = []
    real = cost_fits_refit._lstsq

    def spy(rows, ys):
        seen.append(rows)
        return real(rows, ys)

    monkeypatch.setattr(cost_fits_refit, "_lstsq", spy)
    N, C, H, W = shape = (2, 16, 8, 8)
    cost_fits_refit.refit(
        CostModel(tmp_path / "c.json"), names=["conv_list.dx.dy"], shape=shape, rounds=1, max_residual=float("inf")
    )
    dy_rows = [rows for rows in seen if len(rows[0]) == 2]
    assert dy_rows, "the dY path's two-term fit did not run"
    for sparse_work, dense_work in dy_rows[0]:
        assert dense_work == N * H * W * C * C  # numel(dY) * O, O == C in the refit's shape
        assert sparse_work % C == 0 and 0 < sparse_work <= N * H * W * C * C


def test_bf16_mode_prices_with_its_own_models_and_the_dense_bf16_gradients(table):
    # relative to the dense bf16 GEMM: a dense (masked) input gradient and a dense weight gradient are options
    cost = U._dx_costs(0.5, 0.5, 64, 64, True, bf16=True)
    assert set(cost) == {"x", "dy", "dense"} and cost["dense"] == cost_fits.coefficients("conv_union.dx.dense")["base"]
    fx = cost_fits.coefficients("conv_union_bf16.dx.x")
    assert cost["x"] == pytest.approx(fx["base"] + fx["per_dx"] * 0.5)
    assert set(U._dx_costs(0.5, 0.5, 64, 64, True)) == {"x", "dy"}  # fp32 mode: unchanged
    assert U._dw_costs(0.5, None, 64, 64, bf16=True)["dense"] == 1.0 and "dense" not in U._dw_costs(0.5, None, 64, 64)
    # a stored bf16 fit moves only the bf16 decision
    assert U._dx_side(0.9, None, 64, 64, True, bf16=True) == "dense"
    table.set_fit(cost_fits.PREFIX + "conv_union_bf16.dx.x", {"base": 0.0, "per_dx": 0.1, "big_weight": 0.0})
    assert U._dx_side(0.9, None, 64, 64, True, bf16=True) == "x"
    assert U._dx_without_dy(0.9, 64, 64, bf16=True) == "x"
    table.set_fit(cost_fits.PREFIX + "conv_union_bf16.dx.x", {"base": 5.0, "per_dx": 0.1, "big_weight": 0.0})
    assert U._dx_without_dy(0.9, 64, 64, bf16=True) is None  # a sparse enough dY may still win: it decides
    table.set_fit(cost_fits.PREFIX + "conv_union_bf16.dx.dy", {"base": 5.0, "per_dg": 0.1})
    assert U._dx_without_dy(0.9, 64, 64, bf16=True) == "dense"  # neither sparse side can beat the dense one


def test_the_bf16_union_refit_procedure_runs_on_the_fallbacks(tmp_path):
    cm = CostModel(tmp_path / "t.json")
    names = [n for n, f in cost_fits.COST_FITS.items() if f.kernels == "union_bf16"]
    assert len(names) == 6
    fitted, skipped = cost_fits_refit.refit(
        cm, names=names, shape=(2, 16, 8, 8), rounds=1, force=["union_bf16"], max_residual=float("inf")
    )
    assert sorted(fitted) == sorted(names) and not skipped
    for name in names:
        assert set(fitted[name]) == set(cost_fits.COST_FITS[name].defaults)
        assert cost_fits.coefficients(name, cm) == fitted[name]
    why = cost_fits_refit.skip_reason("union_bf16")
    assert (why is None) == cost_fits_refit._b.union_dpbf16()
