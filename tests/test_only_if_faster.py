"""sparsify_linears(only_if_faster=...): per-layer sparse-vs-dense choice, report fields, arguments.

The decision is tested with a fake timer (``sparsa.nn.linears.speedup_vs_dense`` monkeypatched); real
timing only runs to check that it returns a positive ratio, never how large it is.
"""
import copy

import pytest
import torch
import torch.nn as nn

import sparsa
import sparsa.nn.linears as linears

pytestmark = pytest.mark.filterwarnings("ignore::sparsa.SparseFallbackWarning")


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))


def _x():
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(1))


class FakeTimer:
    """speedup_vs_dense stand-in: the ratio by the weight's (out, in) shape; records its calls."""

    def __init__(self, by_shape, default=2.0):
        self.by_shape, self.default, self.calls = by_shape, default, []

    def __call__(self, weight, bias, tokens):
        assert isinstance(weight, sparsa.SparseTensor)
        self.calls.append((tuple(weight.shape), tokens, bias is not None))
        return self.by_shape.get(tuple(weight.shape), self.default)


def _weight_rows(rows):
    return {r["name"]: r for r in rows if r["name"].endswith("weight")}


def test_default_off_rows_say_sparse_unmeasured(monkeypatch):
    monkeypatch.setattr(linears, "speedup_vs_dense", lambda *a: pytest.fail("timed without only_if_faster"))
    m = _model()
    rows = _weight_rows(sparsa.sparsify_linears(m, "row_group", 0.75, group=8))
    assert set(rows) == {"0.weight", "2.weight", "4.weight"}
    for r in rows.values():
        assert r["layout"] == "row_group" and r["path"] == "sparse" and r["ratio_vs_dense"] is None
    bias_rows = [r for r in sparsa.sparsity_report(m) if r["name"].endswith("bias")]
    assert all("path" not in r for r in bias_rows)


@pytest.mark.parametrize("flag, tokens", [(True, 128), (16, 16)])
def test_choice_follows_timer_and_outputs_match(monkeypatch, flag, tokens):
    # (64, 32): slower -> dense; (64, 64): within the margin -> dense; (16, 64): faster -> sparse
    timer = FakeTimer({(64, 32): 0.6, (64, 64): 1.0 + linears.MARGIN / 2, (16, 64): 1.5})
    monkeypatch.setattr(linears, "speedup_vs_dense", timer)
    plain, fast = _model(), _model()
    sparsa.sparsify_linears(plain, "row_group", 0.75, group=8)
    rows = _weight_rows(sparsa.sparsify_linears(fast, "row_group", 0.75, group=8, only_if_faster=flag))
    assert {c[1] for c in timer.calls} == {tokens}
    assert rows["0.weight"]["path"] == "dense" and rows["0.weight"]["layout"] == "dense"
    assert rows["0.weight"]["ratio_vs_dense"] == 0.6
    assert rows["2.weight"]["path"] == "dense" and rows["2.weight"]["layout"] == "dense"
    assert rows["4.weight"]["path"] == "sparse" and rows["4.weight"]["layout"] == "row_group"
    assert rows["4.weight"]["ratio_vs_dense"] == 1.5
    for name in ("0.weight", "2.weight"):  # same pruned values, pattern kept as zeros
        assert abs(rows[name]["sparsity"] - 0.75) < 1e-6
        w = fast.get_parameter(name)
        assert type(w) is nn.Parameter and w.requires_grad
        assert torch.equal(w.detach(), plain.get_parameter(name).sparse_layout.to_dense())
    with torch.no_grad():
        torch.testing.assert_close(fast(_x()), plain(_x()))
    text = sparsa.format_report(sparsa.nn.linears.annotate_paths(sparsa.sparsity_report(fast), rows))
    assert "sparse was 0.60x" in text


def test_identical_layers_timed_once(monkeypatch):
    timer = FakeTimer({}, default=0.5)
    monkeypatch.setattr(linears, "speedup_vs_dense", timer)
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)], nn.Linear(64, 32))
    rows = _weight_rows(sparsa.sparsify_linears(m, "row_group", 0.5, group=8, only_if_faster=True))
    assert sorted(c[0] for c in timer.calls) == [(32, 64), (64, 64)]
    assert all(r["path"] == "dense" and r["ratio_vs_dense"] == 0.5 for r in rows.values())


def test_names_only_time_selected_layers(monkeypatch):
    timer = FakeTimer({}, default=0.5)
    monkeypatch.setattr(linears, "speedup_vs_dense", timer)
    m = _model()
    rows = _weight_rows(sparsa.sparsify_linears(m, "row_group", 0.75, names=["4"], group=8, only_if_faster=True))
    assert timer.calls == [((16, 64), 128, True)]
    assert rows["4.weight"]["path"] == "dense"
    assert "path" not in rows["0.weight"] and rows["0.weight"]["layout"] == "dense"  # never sparsified


def test_tied_weights_stay_tied(monkeypatch):
    monkeypatch.setattr(linears, "speedup_vs_dense", FakeTimer({}, default=0.5))
    a, b = nn.Linear(16, 16), nn.Linear(16, 16)
    b.weight = a.weight
    m = nn.Sequential(a, b)
    sparsa.sparsify_linears(m, "row_group", 0.5, group=4, only_if_faster=True)
    assert m[0].weight is m[1].weight and type(m[0].weight) is nn.Parameter
    assert len(list(m.parameters())) == 3


def test_dense_where_slower_injectable_timer_and_margin():
    m = _model()
    sparsa.sparsify_linears(m, "row_group", 0.75, group=8)
    chosen = linears.dense_where_slower(m, 32, timer=lambda w, b, t: 1.02, margin=0.0)
    assert {v["path"] for v in chosen.values()} == {"sparse"}
    chosen = linears.dense_where_slower(m, 32, timer=lambda w, b, t: 1.02)  # default 5% margin
    assert {v["path"] for v in chosen.values()} == {"dense"}
    assert not any(isinstance(p, sparsa.SparseTensor) for p in m.parameters())


@pytest.mark.parametrize("bad, exc", [(0, ValueError), (-3, ValueError), (1.5, TypeError), ("yes", TypeError),
                                      (None, TypeError)])
def test_bad_only_if_faster_names_the_argument(bad, exc):
    m = _model()
    with pytest.raises(exc, match="only_if_faster"):
        sparsa.sparsify_linears(m, "row_group", 0.75, group=8, only_if_faster=bad)
    assert not any(isinstance(p, sparsa.SparseTensor) for p in m.parameters())  # checked before converting


@pytest.mark.parametrize("kwargs, match", [(dict(tokens=0), "tokens"), (dict(tokens=True), "tokens"),
                                           (dict(margin=-0.1), "margin"), (dict(margin=float("nan")), "margin")])
def test_bad_dense_where_slower_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        linears.dense_where_slower(_model(), **kwargs)


@pytest.mark.parametrize("layout, kw", [("row_group", dict(group=8)), ("grouped_nm", {}), ("masked", {})])
def test_real_timing_runs_and_outputs_match(layout, kw):
    """The real timer runs (a positive ratio); whatever it decides, the model's outputs stay the same."""
    plain = _model()
    sparsa.sparsify_linears(plain, layout, 0.5, **kw)
    fast = _model()
    rows = _weight_rows(sparsa.sparsify_linears(fast, layout, 0.5, only_if_faster=4, **kw))
    for r in rows.values():
        assert r["ratio_vs_dense"] > 0 and r["path"] in ("sparse", "dense")
        assert r["layout"] == (layout if r["path"] == "sparse" else "dense")
    with torch.no_grad():
        torch.testing.assert_close(fast(_x()), plain(_x()))


def test_speedup_vs_dense_leaves_weight_alone():
    w = sparsa.to_sparse(torch.randn(16, 32), "row_group", sparsity=0.5, group=4)
    before = copy.deepcopy(w.sparse_layout.to_dense())
    assert linears.speedup_vs_dense(w, torch.randn(16), 4) > 0
    assert torch.equal(w.sparse_layout.to_dense(), before)
