"""sparsa.cost_model: side-by-side measurements cached per CPU model, feedback, persistence."""

import json

import pytest

from sparsa import cli, cost_model
from sparsa.cost_model import CostModel


def test_measure_caches_and_persists(tmp_path):
    p = tmp_path / "t.json"
    cm = CostModel(p)
    calls = []
    costs = cm.measure("k", {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=2)
    assert set(costs) == {"a", "b"} and calls
    n = len(calls)
    assert cm.measure("k", {"a": None, "b": None}) == costs and len(calls) == n  # nothing re-timed
    assert CostModel(p).lookup("k") == costs  # a new process reads the file
    assert json.loads(p.read_text())["cpu"]


def test_a_new_option_retimes_the_whole_key(tmp_path):
    cm = CostModel(None)
    cm.measure("k", {"a": lambda: None}, rounds=1)
    costs = cm.measure("k", {"a": lambda: None, "b": lambda: None}, rounds=1)
    assert set(costs) == {"a", "b"}


def test_missing_function_for_unknown_key_is_a_clear_error():
    with pytest.raises(ValueError, match="no stored cost"):
        CostModel(None).measure("k", {"a": None})
    with pytest.raises(ValueError, match="at least one"):
        CostModel(None).measure("k", {})


def test_observe_moves_the_estimate(tmp_path):
    cm = CostModel(tmp_path / "t.json")
    cm.observe("k", "sparse", 4.0)
    assert cm.lookup("k") == {"sparse": 4.0}
    cm.observe("k", "sparse", 2.0, weight=0.5)
    assert cm.lookup("k") == {"sparse": 3.0}
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="ms"):
            cm.observe("k", "sparse", bad)
    with pytest.raises(ValueError, match="weight"):
        cm.observe("k", "sparse", 1.0, weight=0)


def test_fastest_and_its_errors():
    assert CostModel.fastest({"a": 2.0, "b": 1.0}) == "b"
    assert CostModel.fastest({"a": 2.0, "b": 1.0}, ["a"]) == "a"
    with pytest.raises(ValueError, match="none of"):
        CostModel.fastest({"a": 2.0}, ["c"])


def test_damaged_table_is_ignored(tmp_path):
    p = tmp_path / "t.json"
    p.write_text("{not json")
    assert len(CostModel(p)) == 0
    p.write_text(json.dumps({"version": 1, "entries": {"k": "oops"}}))
    assert len(CostModel(p)) == 0


def test_path_per_cpu_and_off_switch(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSA_COST_DIR", str(tmp_path))
    p = cost_model.cost_path()
    assert p.parent == tmp_path and p.name.endswith(".json") and "torch" in p.name
    monkeypatch.setenv("SPARSA_COST_DIR", "off")
    assert cost_model.cost_path() is None and cost_model.default_cost_model().path is None


def test_cli_lists_and_clears(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPARSA_COST_DIR", str(tmp_path))
    cost_model.default_cost_model().observe("linear|x", "sparse", 1.5)
    assert cli.main(["cost"]) == 0
    out = capsys.readouterr().out
    assert "cpu:" in out and "linear|x: sparse 1.500 ms" in out
    assert cli.main(["cost", "--clear"]) == 0
    assert len(cost_model.default_cost_model()) == 0 and not cost_model.cost_path().exists()


def test_one_table_holds_the_adaptive_calibration(tmp_path, monkeypatch, capsys):
    from sparsa.adaptive import calibration

    monkeypatch.setenv("SPARSA_COST_DIR", str(tmp_path))
    cal = calibration.default_calibration()
    assert cal.store is cost_model.default_cost_model() and cal.path == cost_model.cost_path()
    cal._table["conv2d|x"] = calibration.CostEntry(dense_ms=2.0, fixed_ms=0.1, slope_ms=1.0)
    cal.save()
    assert json.loads(cost_model.cost_path().read_text())["fits"]["adaptive|conv2d|x"]["dense_ms"] == 2.0
    fresh = calibration.Calibration(cost_model=CostModel(cost_model.cost_path()))  # as a new process reads it
    assert fresh.get("conv2d|x") == cal.get("conv2d|x")
    assert cli.main(["cost"]) == 0
    out = capsys.readouterr().out
    assert "adaptive calibration: 1 layer models" in out and "adaptive|conv2d|x: dense_ms 2.000" in out
    assert cli.main(["cost", "--clear"]) == 0
    assert len(cal) == 0 and not cost_model.cost_path().exists()


def test_calibration_clear_keeps_the_other_timings(tmp_path):
    from sparsa.adaptive.calibration import Calibration, CostEntry

    cm = CostModel(tmp_path / "t.json")
    cm.observe("linear|x", "sparse", 1.0)
    cal = Calibration(cost_model=cm)
    cal._table["k"] = CostEntry(dense_ms=1.0, fixed_ms=0.1, slope_ms=1.0)
    cal.save()
    assert cm.fit_keys() == ["adaptive|k"] and len(cm) == 2
    cal.clear()
    assert cm.fit_keys() == [] and cm.lookup("linear|x") == {"sparse": 1.0}
    with pytest.raises(ValueError, match="not both"):
        Calibration(tmp_path / "c.json", cost_model=cm)


def test_fits_persist_and_bad_fits_are_rejected(tmp_path):
    p = tmp_path / "t.json"
    cm = CostModel(p)
    cm.set_fit("m|a", {"fixed_ms": 1.0, "slope_ms": 2.0})
    assert CostModel(p).fit("m|a") == {"fixed_ms": 1.0, "slope_ms": 2.0} and CostModel(p).fit("m|b") is None
    with pytest.raises(TypeError, match="params must be a dict"):
        cm.set_fit("m|a", [1.0])
    with pytest.raises(ValueError, match="prefix"):
        cm.forget("")
    assert cm.forget("m|") == 1 and not p.exists()  # an empty table leaves no file behind
    p.write_text(json.dumps({"version": 1, "entries": {}, "fits": {"k": "oops"}}))
    assert len(CostModel(p)) == 0


def test_adaptive_calibration_key_names_the_cpu():
    from sparsa import cpu
    from sparsa.adaptive.calibration import layer_key

    key = layer_key("conv2d", (1, 2, 3, 3), (2, 2, 3, 3), {"stride": (1, 1)}, False)
    assert key.startswith("-".join(cpu.cpu_model().split()) + "/" + cpu.isa() + "|conv2d|")
