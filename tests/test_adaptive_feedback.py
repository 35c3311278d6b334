"""sparsa.adaptive.feedback: measured forward+backward times correcting a layer's cost model."""

import time

import pytest
import torch
from torch import nn

import sparsa.adaptive as sa
from sparsa.adaptive import modules
from sparsa.adaptive.calibration import CostEntry
from sparsa.adaptive.feedback import Feedback, time_backward

real_relu_conv2d = modules.relu_conv2d  # before any test patches it


def test_kappa_needs_two_samples_a_side_and_drops_the_first():
    fb = Feedback()
    fb.add("dense", 100.0, 10.0)  # first call: dropped
    fb.add("dense", 10.0, 10.0)
    fb.add("sparse", 100.0, 5.0)
    fb.add("sparse", 10.0, 5.0)
    assert fb.kappa() is None and fb.measured_speedup() is None
    fb.add("dense", 10.0, 10.0)
    fb.add("sparse", 10.0, 5.0)
    assert fb.kappa() == pytest.approx(0.5)  # predicted 2x, measured 1x
    assert fb.measured_speedup() == pytest.approx(1.0)
    for _ in range(5):
        fb.add("sparse", 100.0, 5.0)
    assert fb.kappa() == pytest.approx(0.5)  # clamped (really 0.05)
    for _ in range(5):
        fb.add("sparse", 1.0, 5.0)
    assert fb.kappa() == pytest.approx(2.0)  # clamped (really 5)
    fb.add("dense", 1.0, None)  # no prediction: not recorded
    assert len(fb.errors["dense"]) == 2


def test_probe_schedule_and_bad_arguments():
    fb = Feedback(every=2, probe_every=4)
    assert [fb.due() for _ in range(5)] == [True, False, True, False, True]
    # twice as often until the dense side has 2 samples, then every 4th timed call
    assert [fb.probe_now() for _ in range(4)] == [False, True, False, True]
    fb.errors["dense"].extend([1.0, 1.0])
    assert [fb.probe_now() for _ in range(8)] == [False, False, False, True, False, False, False, True]
    assert fb.probes == 4
    with pytest.raises(ValueError, match="every"):
        Feedback(every=0)
    with pytest.raises(ValueError, match="path"):
        fb.add("fast", 1.0, 1.0)
    with pytest.raises(ValueError, match="verify_below"):
        sa.Policy(verify_below=-1.0)


def test_time_backward_times_the_layer_backward_only():
    x = torch.randn(4, 8, requires_grad=True)
    h = x * 2
    got = []

    class Slow(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 3

        @staticmethod
        def backward(ctx, g):
            time.sleep(0.02)
            return g * 3

    y = Slow.apply(h)
    assert time_backward(h, y, got.append)
    (y.sum() * 1).backward()
    assert len(got) == 1 and 15.0 < got[0] < 1000.0
    with torch.no_grad():
        assert not time_backward(h, h * 3, got.append)
    assert not time_backward(torch.randn(3), torch.randn(3, requires_grad=True), got.append)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))


def _slow_sparse(monkeypatch, seconds):
    real = modules.relu_conv2d

    def slow(*a, **k):
        time.sleep(seconds)
        return real(*a, **k)

    monkeypatch.setattr(modules, "relu_conv2d", slow)


def test_feedback_moves_a_mispredicted_layer_back_to_dense(monkeypatch):
    net = _net()
    rt = sa.enable(
        net, every=1, policy=sa.Policy(enter=1.1, exit=1.02, verify_below=1.3), guard=False
    )  # per-layer feedback alone (the step guard would take the whole model dense)
    st = rt.layers["2"]
    st.cost = CostEntry(dense_ms=1.0, fixed_ms=0.8, slope_ms=0.0)  # predicts 1.25x at any sparsity
    _slow_sparse(monkeypatch, 0.01)  # but the sparse path is slow
    x = torch.randn(2, 3, 8, 8)
    ref = _net()
    for _ in range(30):
        net(x).sum().backward()
        ref(x).sum().backward()
    assert st.switches >= 2 and st.path == "dense"  # went sparse on the model, back on the measurements
    assert st.feedback.probes >= 1 and st.feedback.kappa() < 0.9
    assert st.speedup == pytest.approx(st.model_speedup * st.feedback.kappa())
    row = next(r for r in rt.report() if r["layer"] == "2")
    assert row["kappa"] == st.feedback.kappa() and row["measured_speedup"] < 1.0 and row["probes"] >= 1
    assert "kappa" in rt.format().splitlines()[0]
    # probes and timing change nothing in the numbers
    torch.testing.assert_close(net[2].weight.grad, ref[2].weight.grad, atol=1e-3, rtol=1e-4)
    # the vetoed layer stays timed, its probes on the sparse path: once sparse is the faster one it comes back
    probes, kappa_slow = st.feedback.probes, st.feedback.kappa()
    monkeypatch.setattr(modules, "relu_conv2d", real_relu_conv2d)
    slow_dense = modules.AdaptiveConv2d._conv_forward

    def slow(self, *a):
        time.sleep(0.02)
        return slow_dense(self, *a)

    monkeypatch.setattr(modules.AdaptiveConv2d, "_conv_forward", slow)
    for _ in range(120):
        net(x).sum().backward()
        if st.path == "sparse":
            break
    # it returns once the corrected speedup clears `enter` (kappa >= 1.1 / 1.25), whatever the host's load
    assert st.feedback.probes > probes and st.path == "sparse" and st.feedback.kappa() > kappa_slow
    assert st.speedup >= 1.1


def test_no_timing_when_turned_off_or_confident(monkeypatch):
    for policy, model in ((sa.Policy(verify_below=0.0), (1.0, 0.8)), (sa.Policy(), (1.0, 0.2))):
        net = _net()
        rt = sa.enable(net, every=1, policy=policy)
        st = rt.layers["2"]
        st.cost = CostEntry(dense_ms=model[0], fixed_ms=model[1], slope_ms=0.0)
        x = torch.randn(2, 3, 8, 8)
        for _ in range(12):
            net(x).sum().backward()
        assert st.path == "sparse" and st.feedback.probes == 0 and st.feedback.calls == 0


def test_an_underrated_dense_layer_is_explored_and_goes_sparse(monkeypatch):
    """Predicted 1.0x (dense), really much faster sparse: the sparse probes find it."""
    net = _net()
    rt = sa.enable(
        net, every=1, policy=sa.Policy(enter=1.1, exit=1.02, verify_below=1.3, explore_above=0.85), guard=False
    )
    st = rt.layers["2"]
    st.cost = CostEntry(dense_ms=1.0, fixed_ms=1.0, slope_ms=0.0)  # predicts 1.0x: below enter
    slow_dense = modules.AdaptiveConv2d._conv_forward

    def slow(self, *a):
        time.sleep(0.02)
        return slow_dense(self, *a)

    monkeypatch.setattr(modules.AdaptiveConv2d, "_conv_forward", slow)
    x = torch.randn(2, 3, 8, 8)
    for _ in range(150):
        net(x).sum().backward()
        if st.path == "sparse":
            break
    assert st.path == "sparse" and st.feedback.probes >= 3 and st.feedback.kappa() > 1.1
    assert st.model_speedup == pytest.approx(1.0)


@pytest.mark.parametrize("policy", [sa.Policy(explore_above=0.95), sa.Policy(verify_below=0.0)])
def test_no_exploring_far_below_break_even_or_when_off(policy):
    net = _net()
    rt = sa.enable(net, every=1, policy=policy, guard=False)
    st = rt.layers["2"]
    st.cost = CostEntry(dense_ms=1.0, fixed_ms=1.1, slope_ms=0.0)  # predicts 0.91x
    x = torch.randn(2, 3, 8, 8)
    for _ in range(12):
        net(x).sum().backward()
    assert st.path == "dense" and st.feedback.calls == 0 and st.sparse_calls == 0


def test_explore_above_must_be_positive():
    with pytest.raises(ValueError, match="explore_above"):
        sa.Policy(explore_above=0.0)
