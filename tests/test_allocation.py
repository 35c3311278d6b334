"""Per-layer sparsity allocation: OWL keeps the overall target exactly, gives layers with outliers
less sparsity, and plugs into Wanda and SparseGPT; bad arguments are named."""

import copy

import pytest
import torch
import torch.nn as nn

import sparsa
from sparsa.methods import SparseGPT, Wanda, owl_sparsities, outlier_ratios, uniform_sparsities, weighted_mean_sparsity
from sparsa.methods.allocation import MAX_SPARSITY
from sparsa.sparsifiers import NM, Magnitude

NAMES = ["0", "2", "4"]


def _model(outliers=True):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 16))
    if outliers:
        with torch.no_grad():
            m[2].weight[:, :2] *= 40.0  # a few huge input columns: many outlier scores in layer "2"
            m[4].weight[:, :1] *= 10.0
    return m


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(32, 32, generator=g) for _ in range(2)]


@pytest.mark.parametrize("target", [0.0, 0.3, 0.5, 0.7, 0.9, 0.95, 0.99])
def test_owl_weighted_mean_is_the_target(target):
    model = _model()
    s = owl_sparsities(model, NAMES, _batches(), target)
    assert sorted(s) == NAMES
    assert weighted_mean_sparsity(model, s) == pytest.approx(target, abs=1e-9)
    assert all(0.0 <= v <= MAX_SPARSITY for v in s.values())


def test_owl_gives_outlier_layers_less_sparsity_within_lam():
    model = _model()
    ratios = outlier_ratios(model, NAMES, _batches())
    assert ratios["2"] > ratios["4"] > ratios["0"]
    s = owl_sparsities(model, NAMES, _batches(), 0.7, lam=0.08)
    assert s["2"] < s["4"] < s["0"]
    assert max(s.values()) - min(s.values()) == pytest.approx(0.16, abs=1e-9)  # the spread is 2 * lam
    wider = owl_sparsities(model, NAMES, _batches(), 0.7, lam=0.2)
    assert wider["0"] - wider["2"] > s["0"] - s["2"]


def test_owl_without_outlier_differences_is_uniform_and_uniform_helper():
    model = _model(outliers=False)
    s = owl_sparsities(model, NAMES, _batches(), 0.6, M=1000.0)  # nothing is an outlier
    assert s == pytest.approx(uniform_sparsities(NAMES, 0.6))
    assert uniform_sparsities(NAMES, 0.6) == {"0": 0.6, "2": 0.6, "4": 0.6}


def test_owl_names_none_means_every_linear_used():
    s = owl_sparsities(_model(), None, _batches(), 0.5)
    assert sorted(s) == NAMES


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_one_shot_methods_take_per_layer_sparsities(method):
    model = _model()
    alloc = owl_sparsities(model, NAMES, _batches(), 0.75)
    config = Wanda if method == "wanda" else SparseGPT
    in_names = lambda m, name: name in NAMES  # noqa: E731
    sparsa.sparsify(
        model,
        config(sparsifier=Magnitude(0.75, per="row"), layout="masked", calibration=_batches(), sparsities=alloc),
        in_names,
    )
    for n in NAMES:
        w = model.get_submodule(n).weight
        cols = w.shape[1]
        assert w.sparse_layout.mask().sum(1).eq(cols - round(alloc[n] * cols)).all(), n
    # layers left out of sparsities keep the sparsifier's own
    other = _model()
    sparsa.sparsify(
        other,
        config(sparsifier=Magnitude(0.5, per="row"), layout="masked", calibration=_batches(), sparsities={"2": 0.25}),
        in_names,
    )
    assert other[2].weight.sparsity == pytest.approx(0.25) and other[0].weight.sparsity == pytest.approx(0.5)


def test_per_layer_sparsities_errors():
    with pytest.raises(ValueError, match="sparsities"):
        sparsa.sparsify(
            _model(),
            Wanda(sparsifier=Magnitude(0.5), layout="masked", calibration=_batches(), sparsities={"1": 0.5}),
            lambda m, name: name in NAMES,
        )
    with pytest.raises(ValueError, match="sparsities"):
        sparsa.sparsify(
            _model(),
            SparseGPT(sparsifier=NM(2, 4), layout="nm", calibration=_batches(), sparsities={"0": 0.5}),
            lambda m, name: name in NAMES,
        )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(target=1.0), "target"),
        (dict(target=0.995), "target"),
        (dict(target=0.5, lam=-0.1), "lam"),
        (dict(target=0.5, M=0), "M"),
        (dict(target=0.5, names=["1"]), "names"),
        (dict(target=0.5, names=[]), "names"),
        (dict(target=0.5, calibration_batches=[]), "calibration_batches"),
    ],
)
def test_owl_bad_arguments(kwargs, match):
    args = dict(names=NAMES, calibration_batches=_batches())
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        owl_sparsities(_model(), args.pop("names"), args.pop("calibration_batches"), **args)


def test_owl_on_a_pruned_model_and_recover_dict():
    model = sparsa.sparsify(_model(), sparsa.Rule(sparsifier=Magnitude(0.5), module_types=nn.Linear))
    s = owl_sparsities(model, NAMES, _batches(), 0.8)
    assert weighted_mean_sparsity(model, s) == pytest.approx(0.8, abs=1e-9)
    teacher = _model()
    student = copy.deepcopy(teacher)
    rep = sparsa.recover(student, teacher, _batches(), target_sparsity=0.8, allocation=s, steps=3, progress=False)
    assert rep.targets == s


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for b in self.layers:
            x = b(x)
        return self.head(x)


def test_owl_per_block_shares_one_sparsity_per_block():
    torch.manual_seed(0)
    net = _Net()
    with torch.no_grad():
        net.layers[1].fc2.weight[:, :2] *= 40.0
    xs = [torch.randn(32, 16)]
    per_layer = owl_sparsities(net, None, xs, 0.6)
    s = owl_sparsities(net, None, xs, 0.6, per="block")
    assert weighted_mean_sparsity(net, s) == pytest.approx(0.6, abs=1e-9)
    for i in range(3):
        assert s[f"layers.{i}.fc1"] == s[f"layers.{i}.fc2"]
    assert per_layer["layers.1.fc1"] != per_layer["layers.1.fc2"]
    assert s["layers.1.fc1"] < s["layers.0.fc1"]  # the block with outliers keeps more
    ratios = outlier_ratios(net, None, xs, per="block")
    assert ratios["layers.1.fc1"] == ratios["layers.1.fc2"] and "head" in ratios
    with pytest.raises(ValueError, match="per"):
        owl_sparsities(net, None, xs, 0.6, per="row")
