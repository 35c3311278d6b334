"""The one way to sparsify: ``sparsa.sparsify(model, config, filter_fn)`` returns the model for every
config kind, method configs match the old functions, any object with ``mask()`` is a sparsifier,
the old entry points warn, and one parser reads every pattern name."""

import warnings

import pytest
import torch
from torch import nn

import sparsa
from sparsa import frontier, prune
from sparsa.methods import Gradual, OneShot, SparseGPT, Wanda, WandaSparsifier, named_pattern
from sparsa.methods.recover import pattern_sparsifier
from sparsa.sparsifiers import (
    NM,
    CubicSchedule,
    GroupedNM,
    Magnitude,
    PATTERN_SPELLINGS,
    RowGroupSparsifier,
    parse_pattern,
)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(24, 16, generator=g) for _ in range(2)]


class TopHalf:
    """A duck-typed sparsifier: no sparsa base class, just ``mask``."""

    def mask(self, dense):
        return dense.abs() >= dense.abs().median()


def _masks(model):
    return {n: p.pattern() for n, p in model.named_parameters() if isinstance(p, sparsa.SparseTensor)}


CONFIGS = {
    "rule": lambda: sparsa.Rule(sparsifier=Magnitude(0.5), module_types=nn.Linear),
    "rules": lambda: [
        sparsa.Rule(sparsifier=NM(2, 4), layout="nm", names="0"),
        sparsa.Rule(sparsifier=Magnitude(0.5), names="2"),
    ],
    "sparsifier": lambda: Magnitude(0.5),
    "duck_sparsifier": lambda: TopHalf(),
    "one_shot_pattern": lambda: OneShot(pattern="2:4"),
    "one_shot_layout": lambda: OneShot(0.75, layout="row_group", layout_params={"group": 8}),
    "one_shot_sparsifier": lambda: OneShot(sparsifier=TopHalf()),
    "gradual": lambda: Gradual(CubicSchedule(0.0, 0.5, start_step=0, end_step=10)),
    "wanda": lambda: Wanda(0.5, calibration=_batches()),
    "wanda_duck_sparsifier": lambda: Wanda(sparsifier=TopHalf(), calibration=_batches()),
    "sparsegpt": lambda: SparseGPT(pattern="2:4", calibration=_batches()),
}


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_sparsify_returns_the_model(kind):
    model = _model()
    out = sparsa.sparsify(model, CONFIGS[kind]())
    assert out is model
    assert _masks(model), "something became sparse"
    copy_out = sparsa.sparsify(_model(), CONFIGS[kind](), inplace=False)
    assert isinstance(copy_out, nn.Module)


def test_filter_fn_restricts_every_config_kind():
    for kind in ("rule", "sparsifier", "one_shot_pattern", "wanda", "sparsegpt", "gradual"):
        model = sparsa.sparsify(_model(), CONFIGS[kind](), lambda m, name: name == "2")
        assert list(_masks(model)) == ["2.weight"], kind


def test_filter_fn_that_accepts_nothing_raises():
    with pytest.raises(ValueError, match="filter_fn"):
        sparsa.sparsify(_model(), Magnitude(0.5), lambda m, name: False)
    with pytest.raises(ValueError, match="filter_fn"):
        sparsa.sparsify(_model(), Wanda(0.5, calibration=_batches()), lambda m, name: False)
    with pytest.raises(TypeError, match="filter_fn"):
        sparsa.sparsify(_model(), Magnitude(0.5), "0")


def test_bad_config_names_the_argument():
    with pytest.raises(TypeError, match="config must be a method config"):
        sparsa.sparsify(_model(), "magnitude")
    with pytest.raises(TypeError, match="calibration"):
        Wanda(0.5)
    with pytest.raises(ValueError, match="calibration is empty"):
        SparseGPT(0.5, calibration=[])
    with pytest.raises(ValueError, match="not both"):
        sparsa.sparsify(_model(), OneShot(pattern="2:4", sparsifier=NM(2, 4)))


# ----------------------------------------------------------------------------- same result as the old calls
def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return fn(*args, **kwargs)


def _same(a, b):
    ma, mb = _masks(a), _masks(b)
    assert ma.keys() == mb.keys() and ma
    for n in ma:
        assert torch.equal(ma[n], mb[n]), n
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(sparsa.to_dense(pa), sparsa.to_dense(pb)), na
        assert getattr(pa, "layout_name", "dense") == getattr(pb, "layout_name", "dense"), na


@pytest.mark.parametrize("pattern", ["unstructured", "2:4", "row_group8"])
def test_wanda_config_equals_wanda_function(pattern):
    sp, layout = named_pattern(pattern, 0.5)
    old = _quiet(sparsa.methods.wanda, _model(), _batches(), sp, layout=layout)
    new = sparsa.sparsify(_model(), Wanda(0.5, pattern=pattern, calibration=_batches()))
    _same(old, new)


@pytest.mark.parametrize("pattern", ["unstructured", "2:4"])
def test_sparsegpt_config_equals_sparsegpt_function(pattern):
    sp, layout = named_pattern(pattern, 0.5)
    old = _quiet(sparsa.methods.sparsegpt, _model(), _batches(), sp, layout=layout)
    new = sparsa.sparsify(_model(), SparseGPT(0.5, pattern=pattern, calibration=_batches()))
    _same(old, new)


def test_one_shot_config_equals_one_shot_and_sparsify_linears():
    old = _quiet(sparsa.methods.one_shot, _model(), NM(2, 4), layout="nm")
    _same(old, sparsa.sparsify(_model(), OneShot(sparsifier=NM(2, 4), layout="nm")))
    old = _model()
    rows = _quiet(sparsa.sparsify_linears, old, "row_group", 0.75, group=8)
    new = sparsa.sparsify(_model(), OneShot(0.75, layout="row_group", layout_params={"group": 8}))
    _same(old, new)
    assert rows == sparsa.sparsity_report(new)
    assert [r["path"] for r in rows if r["name"].endswith("weight")] == ["sparse", "sparse"]


def test_only_if_faster_decisions_reach_sparsity_report():
    model = sparsa.sparsify(_model(), OneShot(0.75, layout="row_group", layout_params={"group": 8}, only_if_faster=16))
    rows = {r["name"]: r for r in sparsa.sparsity_report(model)}
    for name in ("0.weight", "2.weight"):
        assert rows[name]["path"] in ("sparse", "dense") and rows[name]["ratio_vs_dense"] > 0
    assert "path" not in rows["0.bias"]
    sparsa.densify(model)
    assert all("path" not in r for r in sparsa.sparsity_report(model))


def test_gradual_config_drives_the_schedule():
    cfg = Gradual(CubicSchedule(0.0, 0.75, start_step=0, end_step=20, every=5))
    model = sparsa.sparsify(_model(), cfg)
    assert model[0].weight.sparsity == 0.0
    pruner = cfg.pruner(model)
    for step in range(21):
        pruner.step(step)
    assert model[0].weight.sparsity == pytest.approx(0.75) and model[2].weight.sparsity == pytest.approx(0.75)
    with pytest.raises(TypeError, match="sparsity"):
        Gradual(CubicSchedule(0.0, 0.5, start_step=0, end_step=10), sparsifier=NM(2, 4))


# ----------------------------------------------------------------------------- what is a sparsifier
def test_duck_typed_sparsifier_accepted_by_rule_and_to_sparse_alike():
    lin = nn.Linear(16, 8)
    w = lin.weight.detach().clone()
    direct = sparsa.to_sparse(w, "masked", sparsifier=TopHalf())
    model = sparsa.sparsify(lin, sparsa.Rule(sparsifier=TopHalf(), inline=TopHalf()))
    assert torch.equal(direct.pattern(), TopHalf().mask(w))
    assert torch.equal(model.weight.pattern(), direct.pattern())
    assert sparsa.sparsify(nn.Linear(16, 8), TopHalf()).weight.layout_name == "masked"
    assert WandaSparsifier(TopHalf(), torch.ones(16)).mask(w).sum() == TopHalf().mask(w).sum()


def test_non_sparsifier_rejected_by_rule():
    with pytest.raises(TypeError, match=r"sparsifier must be a sparsifier: .* mask\(dense\) -> bool tensor"):
        sparsa.Rule(sparsifier=0.5)
    with pytest.raises(TypeError, match="inline"):
        sparsa.Rule(sparsifier=Magnitude(0.5), inline="yes")
    with pytest.raises(TypeError, match="base must be a sparsifier"):
        WandaSparsifier(0.5, torch.ones(4))


def _rejection(call):
    with pytest.raises(Exception) as e:
        call()
    return type(e.value), str(e.value)


def test_non_sparsifier_rejected_by_rule_and_to_sparse_with_the_same_message():
    by_rule = _rejection(lambda: sparsa.Rule(sparsifier=0.5))
    by_to_sparse = _rejection(lambda: sparsa.to_sparse(torch.randn(4, 4), "masked", sparsifier=0.5))
    assert by_rule == by_to_sparse


# ----------------------------------------------------------------------------- deprecated entry points
SHIMS = {
    "sparsify_linears": lambda: sparsa.sparsify_linears(_model(), "nm", 0.5),
    "one_shot": lambda: sparsa.methods.one_shot(_model(), Magnitude(0.5)),
    "wanda": lambda: sparsa.methods.wanda(_model(), _batches(), Magnitude(0.5, per="row")),
    "sparsegpt": lambda: sparsa.methods.sparsegpt(_model(), _batches(), Magnitude(0.5, per="row")),
    "report=True": lambda: sparsa.sparsify(_model(), Magnitude(0.5), report=True),
}


@pytest.mark.parametrize("name", sorted(SHIMS))
def test_old_entry_points_warn_and_name_the_new_call(name):
    with pytest.warns(DeprecationWarning, match=r"sparsa\.sparsify\(model, "):
        SHIMS[name]()


def test_old_return_shapes_are_kept():
    with pytest.warns(DeprecationWarning):
        model, rows = sparsa.sparsify(_model(), Magnitude(0.5), report=True)
    assert isinstance(model, nn.Module) and rows == sparsa.sparsity_report(model)
    with pytest.warns(DeprecationWarning):
        rows = sparsa.sparsify_linears(_model(), "nm", 0.5)
    assert isinstance(rows, list) and rows[0]["layout"] == "nm"


def test_old_wanda_sparsifier_spelling_warns_and_still_works():
    w, norm = torch.randn(4, 8), torch.rand(8)
    with pytest.warns(DeprecationWarning, match="WandaSparsifier"):
        old = Wanda(Magnitude(0.5), norm)
    assert isinstance(old, WandaSparsifier)
    assert torch.equal(old.mask(w), WandaSparsifier(Magnitude(0.5), norm).mask(w))


# ----------------------------------------------------------------------------- the pattern parser
SPELLINGS = [  # (spelling, sparsity, layout, expected sparsifier, natural layout, stored sparsity, canonical)
    ("unstructured", 0.7, None, Magnitude(0.7, per="row"), "masked", 0.7, "unstructured"),
    ("2:4", 0.9, None, NM(2, 4), "nm", 0.5, "2:4"),
    ("4:8", 0.5, None, NM(4, 8), "nm", 0.5, "4:8"),
    ("1:4", 0.5, None, NM(1, 4), "nm", 0.75, "1:4"),
    ("2:4", 0.5, "grouped_nm", GroupedNM(2, 4, 4), "grouped_nm", 0.5, "grouped_2:4"),
    ("grouped_2:4", 0.5, None, GroupedNM(2, 4, 4), "grouped_nm", 0.5, "grouped_2:4"),
    ("grouped_1:4", 0.5, None, GroupedNM(1, 4, 4), "grouped_nm", 0.75, "grouped_1:4"),
    ("grouped_nm", 0.8, None, GroupedNM(1, 5, 4), "grouped_nm", 0.8, "grouped_1:5"),
    ("grouped_nm", 0.5, None, GroupedNM(2, 4, 4), "grouped_nm", 0.5, "grouped_2:4"),
    ("row_group16", 0.6, None, RowGroupSparsifier(0.6, group=16), "row_group", 0.6, "row_group16"),
    ("row_group4", 0.6, None, RowGroupSparsifier(0.6, group=4), "row_group", 0.6, "row_group4"),
    ("row_group", 0.6, None, RowGroupSparsifier(0.6, group=16), "row_group", 0.6, "row_group16"),
]


@pytest.mark.parametrize("spelling,sparsity,layout,sparsifier,natural,stored,canonical", SPELLINGS)
def test_parse_pattern_every_spelling(spelling, sparsity, layout, sparsifier, natural, stored, canonical):
    p = parse_pattern(spelling, sparsity, layout)
    assert (p.sparsifier, p.layout, p.sparsity, p.canonical) == (sparsifier, natural, stored, canonical)
    # every old entry point is the one parser
    assert pattern_sparsifier(spelling, sparsity, layout) == (sparsifier, layout or natural)
    assert prune._pattern_sparsifier(spelling, sparsity, layout)[0] == sparsifier
    if layout is None:
        assert named_pattern(spelling, sparsity) == (sparsifier, natural)
        cfg = frontier.pattern_config(spelling, sparsity)
        assert (cfg.sparsifier, cfg.sparsity, cfg.recover_pattern) == (sparsifier, stored, canonical)
    # and the parsed pattern prunes a model through sparsify
    model = sparsa.sparsify(nn.Linear(32, 16), OneShot(sparsity, pattern=spelling, layout=layout))
    assert model.weight.layout_name == (layout or natural)


@pytest.mark.parametrize("bad", ["blocky", "2:x", "a:b", "row_groupX", "rowgroup16", "grouped_2", "2:4:8", ""])
def test_unknown_pattern_lists_every_spelling(bad):
    for call in (
        lambda: parse_pattern(bad),
        lambda: named_pattern(bad),
        lambda: frontier.pattern_config(bad, 0.5),
        lambda: pattern_sparsifier(bad, 0.5),
    ):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == f"pattern must be one of {', '.join(PATTERN_SPELLINGS)}; got {bad!r}"
    with pytest.raises(ValueError, match="--pattern must be one of"):
        prune.check_pattern_layout(bad, 0.5, "masked")


@pytest.mark.parametrize(
    "bad,needle",
    [
        ("5:4", "n must be smaller than m"),
        ("0:4", "n must be a positive int"),
        ("row_group0", "group size"),
        ("grouped_4:4", "n must be smaller"),
    ],
)
def test_bad_numbers_name_the_pattern(bad, needle):
    with pytest.raises(ValueError, match=f"pattern {bad!r}: .*{needle}"):
        parse_pattern(bad)


def test_pattern_must_be_a_string():
    with pytest.raises(TypeError, match="pattern must be a string"):
        parse_pattern(24)


def test_every_config_shares_the_parser():
    for cfg in (
        OneShot(pattern="grouped_nm", sparsity=0.75),
        Wanda(0.75, pattern="grouped_nm", calibration=[torch.randn(8, 32)]),
    ):
        model = sparsa.sparsify(nn.Sequential(nn.Linear(32, 16)), cfg)
        assert model[0].weight.layout_name == "grouped_nm"
        assert model[0].weight.sparsity == pytest.approx(0.75)
