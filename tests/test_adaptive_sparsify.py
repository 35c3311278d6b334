"""``sparsa.sparsify(model, ActivationSparsity(...))``: the adaptive runtime as a sparsify config."""

import copy

import pytest
import torch
from torch import nn

import sparsa
import sparsa.adaptive as sa
from sparsa import ActivationSparsity
from sparsa.adaptive.calibration import Calibration


def _net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 6 * 6, 16),
        nn.ReLU(),
        nn.Linear(16, 8),
    )


def _steps(model, x, y, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_sparsify_turns_the_runtime_on_and_returns_the_model(tmp_path):
    dense, model = _net(), _net()
    assert sa.runtime_of(model) is None
    cfg = ActivationSparsity(policy=sa.Policy(force="sparse"), every=2, calibration=Calibration(tmp_path / "c.json"))
    out = sparsa.sparsify(model, cfg)
    assert out is model
    rt = sa.runtime_of(model)
    assert isinstance(rt, sa.AdaptiveRuntime) and list(rt.layers) == ["0", "2", "5", "7"]
    assert type(model[2]) is sa.AdaptiveConv2d and type(model[7]) is sa.AdaptiveLinear
    x, y = torch.randn(4, 3, 6, 6), torch.randint(0, 8, (4,))
    assert _steps(model, x, y) == pytest.approx(_steps(dense, x, y), rel=1e-3, abs=1e-4)
    rows = {r["layer"]: r for r in rt.report()}
    assert rows["2"]["sparse_calls"] == 3 and rows["7"]["sparse_calls"] == 3
    assert rows["0"]["paired_calls"] == 0  # the image is not a ReLU output
    rt.disable()
    assert sa.runtime_of(model) is None and type(model[2]) is nn.Conv2d


def test_the_config_carries_enables_settings(tmp_path):
    cal = Calibration(tmp_path / "c.json")
    model = sparsa.sparsify(_net(), ActivationSparsity(every=3, slice=32, pixels=64, calibration=cal, guard=False))
    rt = sa.runtime_of(model)
    st = rt.layers["2"]
    assert st.monitor.every == 3 and st.slice == 32 and st.monitor.pixels == 64
    assert st.calibration is cal and rt.guard is None and st.policy == sa.Policy()
    with_guard = sa.runtime_of(sparsa.sparsify(_net(), ActivationSparsity(calibration=cal)))
    assert with_guard.guard is not None


def test_filter_fn_selects_the_layers(tmp_path):
    cal = Calibration(tmp_path / "c.json")
    model = sparsa.sparsify(_net(), ActivationSparsity(calibration=cal), filter_fn=lambda m, name: name == "2")
    assert list(sa.runtime_of(model).layers) == ["2"] and type(model[5]) is nn.Linear
    with pytest.raises(ValueError, match="filter_fn accepts none"):
        sparsa.sparsify(_net(), ActivationSparsity(calibration=cal), filter_fn=lambda m, name: False)


def test_enable_is_the_lower_level_call_and_is_found_too(tmp_path):
    model = _net()
    rt = sa.enable(model, calibration=Calibration(tmp_path / "c.json"))
    assert sa.runtime_of(model) is rt
    with pytest.raises(ValueError, match="already adaptive"):
        sparsa.sparsify(model, ActivationSparsity())
    rt.disable()
    assert sa.runtime_of(model) is None
    with pytest.raises(TypeError, match="model"):
        sa.runtime_of("not a model")


def test_not_inplace_and_deepcopy(tmp_path):
    cal = Calibration(tmp_path / "c.json")
    model = _net()
    twin = sparsa.sparsify(model, ActivationSparsity(calibration=cal, policy=sa.Policy(force="sparse")), inplace=False)
    assert twin is not model and sa.runtime_of(model) is None and type(model[2]) is nn.Conv2d
    assert sa.runtime_of(twin) is not None and type(twin[2]) is sa.AdaptiveConv2d
    # a deep copy keeps the adaptive layers (and their hooks) but not the runtime handle of the original
    third = copy.deepcopy(twin)
    assert sa.runtime_of(third) is None and type(third[2]) is sa.AdaptiveConv2d
    x = torch.randn(2, 3, 6, 6)
    torch.testing.assert_close(third(x), twin(x))


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        (dict(every=0), ValueError, "every"),
        (dict(pixels=-1), ValueError, "pixels"),
        (dict(slice=0), ValueError, "slice"),
        (dict(policy="sparse"), TypeError, "policy"),
        (dict(calibration="c.json"), TypeError, "calibration"),
        (dict(guard="yes"), TypeError, "guard"),
    ],
)
def test_bad_settings_are_named(kwargs, err, match):
    with pytest.raises(err, match=match):
        ActivationSparsity(**kwargs)


@pytest.mark.parametrize("where", ["file", "memory", "default"])
def test_torch_save_and_load_an_activation_sparse_model(tmp_path, monkeypatch, where):
    # the cost table is the machine's: it is not pickled, the loaded model uses the loading side's table
    monkeypatch.setenv("SPARSA_COST_DIR", str(tmp_path / "cost"))
    from sparsa.cost_model import CostModel

    cal = {"file": Calibration(tmp_path / "c.json"), "memory": Calibration(cost_model=CostModel()), "default": None}[
        where
    ]
    model = sparsa.sparsify(_net(), ActivationSparsity(calibration=cal, policy=sa.Policy(force="sparse")))
    x, y = torch.randn(2, 3, 6, 6), torch.tensor([1, 5])
    _steps(model, x, y, steps=1)
    torch.save(model, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    assert type(loaded[2]) is sa.AdaptiveConv2d
    state, state_l = model[2].sparsa_state, loaded[2].sparsa_state
    if where == "file":
        assert state_l.calibration.path == tmp_path / "c.json"
    elif where == "default":
        assert state_l.calibration is sa.calibration.default_calibration()
    before = state_l.sparse_calls
    torch.testing.assert_close(_steps(loaded, x, y, steps=2), _steps(model, x, y, steps=2))
    assert state_l.sparse_calls > before and state.sparse_calls > 0
