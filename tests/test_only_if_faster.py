"""sparsify_linears(only_if_faster=...): per-layer sparse-vs-dense choice, report fields, arguments.

The decision is tested with a fake timer (``sparsa.nn.linears.linear_costs`` monkeypatched); real
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
    """linear_costs stand-in: a speed-up over dense (a float) by the weight's (out, in) shape; records its calls."""

    def __init__(self, by_shape, default=2.0):
        self.by_shape, self.default, self.calls = by_shape, default, []

    def __call__(self, weight, bias, tokens):
        assert isinstance(weight, sparsa.SparseTensor)
        self.calls.append((tuple(weight.shape), tokens, bias is not None))
        return self.by_shape.get(tuple(weight.shape), self.default)


def _weight_rows(rows):
    return {r["name"]: r for r in rows if r["name"].endswith("weight")}


def test_default_off_rows_say_sparse_unmeasured(monkeypatch):
    monkeypatch.setattr(linears, "linear_costs", lambda *a: pytest.fail("timed without only_if_faster"))
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
    monkeypatch.setattr(linears, "linear_costs", timer)
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
    monkeypatch.setattr(linears, "linear_costs", timer)
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)], nn.Linear(64, 32))
    rows = _weight_rows(sparsa.sparsify_linears(m, "row_group", 0.5, group=8, only_if_faster=True))
    assert sorted(c[0] for c in timer.calls) == [(32, 64), (64, 64)]
    assert all(r["path"] == "dense" and r["ratio_vs_dense"] == 0.5 for r in rows.values())


def test_names_only_time_selected_layers(monkeypatch):
    timer = FakeTimer({}, default=0.5)
    monkeypatch.setattr(linears, "linear_costs", timer)
    m = _model()
    rows = _weight_rows(sparsa.sparsify_linears(m, "row_group", 0.75, names=["4"], group=8, only_if_faster=True))
    assert timer.calls == [((16, 64), 128, True)]
    assert rows["4.weight"]["path"] == "dense"
    assert "path" not in rows["0.weight"] and rows["0.weight"]["layout"] == "dense"  # never sparsified


def test_tied_weights_stay_tied(monkeypatch):
    monkeypatch.setattr(linears, "linear_costs", FakeTimer({}, default=0.5))
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


@pytest.mark.parametrize(
    "bad, exc", [(0, ValueError), (-3, ValueError), (1.5, TypeError), ("yes", TypeError), (None, TypeError)]
)
def test_bad_only_if_faster_names_the_argument(bad, exc):
    m = _model()
    with pytest.raises(exc, match="only_if_faster"):
        sparsa.sparsify_linears(m, "row_group", 0.75, group=8, only_if_faster=bad)
    assert not any(isinstance(p, sparsa.SparseTensor) for p in m.parameters())  # checked before converting


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tokens=0), "tokens"),
        (dict(tokens=True), "tokens"),
        (dict(margin=-0.1), "margin"),
        (dict(margin=float("nan")), "margin"),
    ],
)
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


def _costs(sparse, f32, bf16):
    return lambda w, b, t: {"sparse": sparse, "dense_float32": f32, "dense_bfloat16": bf16}


def test_best_dense_is_reported_and_a_dtype_switch_is_opt_in():
    # dense bf16 (1 ms) beats sparse (2 ms), which beats dense fp32 (3 ms)
    plain, m = _model(), _model()
    sparsa.sparsify_linears(plain, "row_group", 0.75, group=8)
    sparsa.sparsify_linears(m, "row_group", 0.75, group=8)
    chosen = linears.dense_where_slower(m, 16, timer=_costs(2.0, 3.0, 1.0))
    for d in chosen.values():  # default: the model's own dtype only, so sparse stays
        assert d["path"] == "sparse" and d["ratio_vs_dense"] == 1.5
        assert d["best_dense"] == "dense_bfloat16" and d["ratio_vs_best_dense"] == 0.5
    chosen = linears.dense_where_slower(m, 16, timer=_costs(2.0, 3.0, 1.0), dtypes=(torch.float32, torch.bfloat16))
    assert {d["path"] for d in chosen.values()} == {"dense_bfloat16"}
    for i in (0, 2, 4):
        assert type(m[i]) is sparsa.nn.cast_linear.CastLinear and m[i].weight.dtype == torch.bfloat16
    with torch.no_grad():
        y = m(_x())
        assert y.dtype == torch.float32
        torch.testing.assert_close(y, plain(_x()), rtol=0.05, atol=0.05)  # bf16 weights: close, not equal


def test_fastest_allowed_dense_dtype_wins_over_a_slower_sparse():
    m = _model()
    sparsa.sparsify_linears(m, "row_group", 0.75, group=8)
    chosen = linears.dense_where_slower(m, 16, timer=_costs(2.0, 1.5, 4.0), dtypes=(torch.float32, torch.bfloat16))
    assert {d["path"] for d in chosen.values()} == {"dense"}
    assert all(type(p) is nn.Parameter and p.dtype == torch.float32 for p in m.parameters())


@pytest.mark.parametrize("bad", [(), (torch.int8,), (torch.float16,)])
def test_bad_dtypes_names_the_argument(bad):
    with pytest.raises(ValueError, match="dtypes"):
        linears.dense_where_slower(_model(), 16, dtypes=bad)


def test_real_costs_are_cached_per_cpu_and_shape(tmp_path, monkeypatch):
    from sparsa import cost_model

    monkeypatch.setenv("SPARSA_COST_DIR", str(tmp_path))
    w = sparsa.to_sparse(torch.randn(16, 32), "row_group", sparsity=0.5, group=4)
    first = linears.linear_costs(w, None, 4)
    assert set(first) == {"sparse", "dense_float32", "dense_bfloat16"} and min(first.values()) > 0
    assert cost_model.cost_path().is_file()
    cost_model._DEFAULT.clear()  # a new process: the table comes from the file, nothing is timed
    monkeypatch.setattr(cost_model, "round_robin_ms", lambda *a, **k: pytest.fail("timed again"))
    assert linears.linear_costs(w, None, 4) == first


@pytest.mark.parametrize("flag, tokens", [(True, linears.DECODE_TOKENS), (8, 8)])
def test_a_generative_model_is_timed_at_decode_width(monkeypatch, flag, tokens):
    # a causal LM spends its time decoding one token per step: True times it there, a count still wins
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    timer = FakeTimer({}, default=3.0)
    monkeypatch.setattr(linears, "linear_costs", timer)
    only_blocks = lambda m, n: n.startswith("model.layers.")  # noqa: E731
    sparsa.sparsify(model, sparsa.methods.OneShot(0.5, layout="bitmask", only_if_faster=flag), only_blocks)
    assert timer.calls and {t for _, t, _ in timer.calls} == {tokens}
    timer.calls.clear()
    sparsa.sparsify(_model(), sparsa.methods.OneShot(0.5, layout="bitmask", only_if_faster=True))
    assert {t for _, t, _ in timer.calls} == {linears.DEFAULT_TOKENS}


def test_cached_linear_costs_are_remeasured_after_a_kernel_change(monkeypatch):
    # a cost table measured with older kernels must not answer for the new ones: the key names the
    # kernels' source digest
    from sparsa import cost_model
    from sparsa.kernels import loader

    cm = cost_model.CostModel(None)
    monkeypatch.setattr(linears, "default_cost_model", lambda: cm)
    w = sparsa.to_sparse(torch.randn(16, 32), "sliced_ell", sparsity=0.5)
    measured = []
    real_measure = cm.measure
    monkeypatch.setattr(cm, "measure", lambda key, options: measured.append(key) or real_measure(key, options))
    linears.linear_costs(w, None, 4)
    linears.linear_costs(w, None, 4)
    assert len(measured) == 1, "the second call is answered from the table"
    assert f"|k{loader.kernels_digest()}" in measured[0]
    monkeypatch.setattr(loader, "kernels_digest", lambda: "000000000000")
    linears.linear_costs(w, None, 4)
    assert len(measured) == 2 and measured[1].endswith("|k000000000000")


class LayoutTimer:
    """linear_costs stand-in: ms per option by the weight's layout (dense always 1 ms); records layouts."""

    def __init__(self, sparse_ms):
        self.sparse_ms, self.seen = sparse_ms, []

    def __call__(self, weight, bias, tokens):
        self.seen.append(weight.layout_name)
        return {"sparse": self.sparse_ms[weight.layout_name], "dense_float32": 1.0, "dense_bfloat16": 1.5}


def _masked_model():
    m = _model()
    sparsa.sparsify_linears(m, "masked", 0.75)
    return m


@pytest.mark.parametrize(
    "sparse_ms, path, layout",
    [
        ({"masked": 1.2, "sliced_ell": 0.5, "bitmask": 0.8}, "sparse", "sliced_ell"),
        ({"masked": 1.2, "sliced_ell": 0.9, "bitmask": 0.4}, "sparse", "bitmask"),
        ({"masked": 0.5, "sliced_ell": 0.9, "bitmask": 0.8}, "sparse", "masked"),
        ({"masked": 1.2, "sliced_ell": 1.1, "bitmask": 0.99}, "dense", "dense"),
    ],
)
def test_the_fastest_layout_on_the_same_pattern_is_kept(sparse_ms, path, layout):
    """With layouts=, each weight is timed in its layout and in every listed one that stores its pattern;
    the fastest sparse one is compared with dense and stored, with the same values and pattern."""
    plain, m = _masked_model(), _masked_model()
    timer = LayoutTimer(sparse_ms)
    chosen = linears.dense_where_slower(m, 16, timer=timer, layouts=linears.SAME_PATTERN_LAYOUTS)
    assert set(timer.seen) == {"masked", "sliced_ell", "bitmask"}
    best = min(sparse_ms, key=sparse_ms.get)
    for name, d in chosen.items():
        assert d["path"] == path and d["sparse_layout"] == best
        w = m.get_parameter(name)
        assert (w.layout_name if isinstance(w, sparsa.SparseTensor) else "dense") == layout
        ref = plain.get_parameter(name)
        assert torch.equal(sparsa.to_dense(w).detach(), ref.sparse_layout.to_dense())
        if layout != "dense":
            assert torch.equal(w.pattern(), ref.pattern()) and w.requires_grad
    with torch.no_grad():
        torch.testing.assert_close(m(_x()), plain(_x()))


def test_a_layout_that_cannot_hold_the_pattern_is_not_timed():
    """grouped_nm stores only its own pattern: an unstructured mask is never moved there."""
    m = _masked_model()
    timer = LayoutTimer({"masked": 1.2, "grouped_nm": 0.1})
    chosen = linears.dense_where_slower(m, 16, timer=timer, layouts=("grouped_nm",))
    assert set(timer.seen) == {"masked"} and all(d["path"] == "dense" for d in chosen.values())


@pytest.mark.parametrize("bad, exc", [("sliced_ell", TypeError), (("no_such_layout",), ValueError)])
def test_bad_layouts_name_the_argument(bad, exc):
    with pytest.raises(exc, match="layout"):
        linears.dense_where_slower(_masked_model(), 16, timer=LayoutTimer({"masked": 1.0}), layouts=bad)


def test_same_pattern_weights_are_exact():
    w = _masked_model()[2].weight
    alts = linears.same_pattern_weights(w, ("masked", "sliced_ell", "bitmask", "csr", "dense", "row_group"))
    # masked is its own; dense accepts the values but not the pattern; row_group refuses the mask
    assert set(alts) == {"sliced_ell", "bitmask", "csr"}
    for sp in alts.values():
        assert torch.equal(sp.pattern(), w.pattern()) and torch.equal(sp.to_dense(), w.sparse_layout.to_dense())


def test_real_timing_picks_among_layouts_and_outputs_match():
    plain, m = _masked_model(), _masked_model()
    chosen = linears.dense_where_slower(m, 8, layouts=linears.SAME_PATTERN_LAYOUTS)
    assert all(d["sparse_layout"] in ("masked", "sliced_ell", "bitmask") for d in chosen.values())
    with torch.no_grad():
        torch.testing.assert_close(m(_x()), plain(_x()), rtol=1e-5, atol=1e-5)
