"""sparsa.adaptive runtime: monitor, policy, calibration, enable/report, models."""

import pytest
import torch
from torch import nn

import sparsa.adaptive as sa
from sparsa.adaptive.calibration import Calibration, CostEntry
from examples.convnets import alexnet, resnet18, vgg16


def test_monitor_sample_close_to_exact_and_refresh_period():
    torch.manual_seed(0)
    x = torch.relu(torch.randn(8, 64, 16, 16) - 0.5)
    m = sa.SparsityMonitor(every=3, pixels=1024)
    assert [m.observe(x) for _ in range(7)] == [True, False, False, True, False, False, True]
    exact = 1 - float((x != 0).float().mean())
    assert abs(m.sparsity - exact) < 0.03
    assert m.source == "sample" and m.refreshes == 3
    m.record_count(torch.tensor([0, 3, 0, 1], dtype=torch.int32), numel=16)
    assert m.sparsity == pytest.approx(0.75) and m.empty_slices == pytest.approx(0.5) and m.source == "count"


def test_monitor_rejects_bad_arguments():
    with pytest.raises(ValueError, match="every"):
        sa.SparsityMonitor(every=0)


def test_policy_hysteresis_and_force():
    p = sa.Policy(enter=1.2, exit=1.0)
    assert p.choose("dense", 1.1) == "dense"
    assert p.choose("sparse", 1.1) == "sparse"
    assert p.choose("sparse", 0.9) == "dense"
    assert p.choose("dense", None) == "dense"
    assert sa.Policy(force="sparse").choose("dense", 0.1) == "sparse"
    with pytest.raises(ValueError, match="force"):
        sa.Policy(force="fast")
    with pytest.raises(ValueError, match="enter"):
        sa.Policy(enter=0.9, exit=1.0)


def test_calibration_measures_caches_and_clears(tmp_path):
    cal = Calibration(tmp_path / "cal.json", reps=1)
    x = torch.relu(torch.randn(2, 16, 6, 6))
    w = torch.randn(16, 16, 3, 3)
    e = cal.entry("conv2d", x, w, None, dict(stride=(1, 1), padding=(1, 1), dilation=(1, 1)), 64)
    assert e.dense_ms > 0 and e.fixed_ms >= 0 and e.slope_ms >= 0
    assert Calibration(tmp_path / "cal.json").get(next(iter(cal._table))) == e  # persisted
    cal.clear()
    assert len(cal) == 0 and not (tmp_path / "cal.json").exists()
    assert CostEntry(10.0, 1.0, 12.0).speedup(0.25) == pytest.approx(2.5)
    # an entry whose dY path was never measured assumes nothing about it: a sparse dY changes nothing
    unmeasured = CostEntry(10.0, 1.0, 12.0, dy_path=True)
    assert unmeasured.sparse_ms(0.5, 0.01) == unmeasured.sparse_ms(0.5) == pytest.approx(7.0)
    # a stride-1 conv with C, O multiples of 8 also gets the dY-driven model (native only)
    e = cal.entry("conv2d", x, w, None, dict(stride=(1, 1), padding=(1, 1), dilation=(1, 1)), 64)
    if sa.conv.dy_path_supported(x, w):
        assert e.dy_path and e.dy_fixed_ms >= 0 and e.dy_slope_ms >= 0
        assert e.sparse_ms(0.5, 0.1) <= e.sparse_ms(0.5) + 1e-9  # the cheaper of the two paths
        assert e.sparse_ms(0.5, 0.1) == pytest.approx(
            min(e.fixed_ms + e.slope_ms * 0.5, e.dy_fixed_ms + e.slope_ms * 0.5 / 3 + e.dy_slope_ms * 0.1)
        )
    else:
        assert not e.dy_path and e.sparse_ms(0.5, 0.1) == e.sparse_ms(0.5)
    e2 = cal.entry(
        "conv2d", x, torch.randn(16, 16, 3, 3), None, dict(stride=(2, 2), padding=(1, 1), dilation=(1, 1)), 64
    )
    assert not e2.dy_path and e2.dy_fixed_ms is None


def _train_steps(model, x, y, steps, lr=0.05):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize(
    "factory",
    [
        lambda: vgg16(width=0.125),
        lambda: vgg16(width=0.125, batch_norm=True),
        lambda: resnet18(width=0.125),
        lambda: alexnet(width=0.125),
    ],
)
def test_forced_sparse_training_matches_dense(factory, tmp_path):
    torch.manual_seed(0)
    dense = factory()
    adaptive = factory()
    adaptive.load_state_dict(dense.state_dict())
    rt = sa.enable(adaptive, policy=sa.Policy(force="sparse"), every=2, calibration=Calibration(tmp_path / "c.json"))
    x = torch.randn(4, 3, 32, 32)
    y = torch.randint(0, 10, (4,))
    ld = _train_steps(dense, x, y, 3)
    la = _train_steps(adaptive, x, y, 3)
    assert la == pytest.approx(ld, rel=1e-3, abs=1e-4)
    rows = rt.report()
    assert any(r["path"] == "sparse" and r["sparse_calls"] == 3 for r in rows)
    first = rows[0]
    assert first["paired_calls"] == 0 and first["path"] == "dense"  # the image input is not a ReLU output
    assert all(r["sparsity"] is not None for r in rows if r["paired_calls"])
    assert "layer" in sa.format_report(rows)


def test_untagged_or_modified_inputs_stay_dense(tmp_path):
    net = nn.Sequential(nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    rt = sa.enable(net, policy=sa.Policy(force="sparse"), calibration=Calibration(tmp_path / "c.json"))
    conv = net[1]
    x = torch.randn(1, 8, 4, 4)
    conv(x)  # not a ReLU output: dense even though forced sparse
    assert rt.layers["1"].paired_calls == 0
    r = net[0](x)
    r.sub_(1.0)  # modified in place after the ReLU: no longer known to be nonnegative
    torch.testing.assert_close(conv(r), nn.functional.conv2d(r, conv.weight, conv.bias, padding=1))
    assert rt.layers["1"].paired_calls == 0
    net(x)
    assert rt.layers["1"].sparse_calls == 1


def test_policy_uses_calibration_and_disable_restores(tmp_path):
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32))
    orig = net[2]
    cal = Calibration(tmp_path / "c.json", reps=1)
    rt = sa.enable(net, every=1, calibration=cal)
    x = torch.randn(16, 16)
    net(x).sum().backward()
    st = rt.layers["2"]
    assert st.cost is not None and st.speedup is not None and len(cal) == 1
    assert st.path == ("sparse" if st.speedup >= rt.layers["2"].policy.enter else "dense")
    # a fake cost table drives the decision with hysteresis
    st.cost = CostEntry(dense_ms=1.0, fixed_ms=0.0, slope_ms=2.0)  # speedup = 0.5 / density
    st.path = "dense"
    net(x)
    expected = "sparse" if 0.5 / (1 - st.monitor.sparsity) >= 1.1 else "dense"
    assert st.path == expected
    rt.disable()
    assert net[2] is orig and type(net[2]) is nn.Linear
    with pytest.raises(TypeError, match="model"):
        sa.enable("not a model")


def test_enable_twice_is_an_error(tmp_path):
    net = nn.Sequential(nn.ReLU(), nn.Linear(8, 8))
    sa.enable(net, calibration=Calibration(tmp_path / "c.json"))
    with pytest.raises(ValueError, match="already adaptive"):
        sa.enable(net)


def test_enable_leaves_the_allocator_alone_unless_asked(tmp_path, monkeypatch):
    """glibc mallopt (retain_freed_memory) is opt-in: enable() does not call it by default (issue #17)."""
    import importlib

    mod = importlib.import_module("sparsa.adaptive.enable")  # the module (sa.enable is the function)
    calls = []
    monkeypatch.setattr(mod, "retain_freed_memory", lambda: calls.append(1) or True)
    sa.enable(nn.Sequential(nn.ReLU(), nn.Linear(8, 8)), calibration=Calibration(tmp_path / "c.json"))
    assert calls == []
    sa.enable(
        nn.Sequential(nn.ReLU(), nn.Linear(8, 8)), calibration=Calibration(tmp_path / "c.json"), retain_memory=True
    )
    assert calls == [1]


def test_compact_helper():
    x = torch.randn(2, 3, 4, 5)
    a = sa.compact(x, slice=2)
    assert a.nnz == int((x > 0).sum()) and torch.equal(a.to_dense(), x.relu())
    m = sa.compact_matrix(torch.randn(6, 7))
    assert m.shape == (1, 7, 6, 1)
    with pytest.raises(ValueError, match="slice"):
        sa.compact(x, slice=0)


def test_output_gradient_sparsity_is_monitored_and_drives_the_policy(tmp_path):
    # conv -> ReLU -> conv -> ReLU -> maxpool: dY of the second conv is zero wherever its ReLU was
    # inactive or the pool did not pick the pixel; the monitor samples it in backward on refresh calls
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 8 * 8, 10),
    )
    cal = Calibration(tmp_path / "c.json", reps=1)
    rt = sa.enable(net, every=2, calibration=cal)
    x = torch.randn(8, 3, 16, 16)
    grads = {}

    def keep(m, i, out):
        if out.requires_grad:
            out.register_hook(lambda g: grads.__setitem__("dy", g.detach().clone()))

    net[2].register_forward_hook(keep)
    net(x).sum().backward()
    st = rt.layers["2"]
    exact = float((grads["dy"] == 0).float().mean())
    assert exact > 0.7  # ReLU zeros and 3 of every 4 pixels dropped by the pool
    assert st.grad_sparsity is not None and abs(st.grad_sparsity - exact) < 0.05
    row = next(r for r in rt.report() if r["layer"] == "2")
    assert row["dy_sparsity"] == st.grad_sparsity
    # the next refresh (call 3) re-samples; call 2 is not a refresh and leaves the estimate alone
    st.grad_sparsity = -1.0
    net(x).sum().backward()
    assert st.grad_sparsity == -1.0
    net(x).sum().backward()
    assert abs(st.grad_sparsity - exact) < 0.05
    # the policy reads it: with a dY-driven backward a sparse dY raises the predicted speedup
    st.cost = CostEntry(dense_ms=1.0, fixed_ms=0.0, slope_ms=1.5, dy_path=True, dy_fixed_ms=0.0, dy_slope_ms=1.0)
    st.path = "dense"
    st.monitor.calls = 0  # make the next call a refresh
    with torch.no_grad():
        net(x)
    d, g = 1 - st.monitor.sparsity, 1 - st.grad_sparsity
    assert st.speedup == pytest.approx(1.0 / min(1.5 * d, 1.5 * d / 3 + 1.0 * g))
    assert st.speedup > CostEntry(1.0, 0.0, 1.5).speedup(d)
    # no output gradient under no_grad: nothing sampled, no error
    assert abs(st.grad_sparsity - exact) < 0.05
