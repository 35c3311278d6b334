"""The step guard: whole-step timing that sends an adaptive model back to dense when it is slower."""

import pytest
import torch
from torch import nn

import sparsa.adaptive as sa
from sparsa.adaptive.step_guard import StepGuard

SPARSE = sa.Policy(enter=1e-6, exit=1e-6, verify_below=0)  # sparse wherever the input is a ReLU output, untimed


def _feed(g: StepGuard, ms: float, n: int) -> None:
    for _ in range(n):
        g.record(ms)


def _pairs(g: StepGuard, adaptive_ms: float, dense_ms: float, n: int) -> None:
    """``n`` steps, each timed on the path the guard has set for it."""
    for _ in range(n):
        g.record(dense_ms if g.suspended else adaptive_ms)


class TestStateMachine:
    def test_warmup_then_alternating_steps(self):
        g = StepGuard(warmup=2, window=3, recheck=10)
        _feed(g, 50.0, 2)
        assert g.phase == "adaptive" and not g.suspended
        seen = []
        for _ in range(5):
            seen.append(g.suspended)
            g.record(10.0 if not g.suspended else 12.0)
        assert seen == [False, True, False, True, False]  # adaptive and dense steps interleave
        assert g.phase == "dense" and g.suspended and g.decision is None

    def test_adaptive_slower_goes_dense(self):
        g = StepGuard(warmup=0, window=3, recheck=10)
        _pairs(g, 12.0, 10.0, 6)
        assert g.decision == "dense" and g.suspended and g.phase == "hold"
        assert g.speedup == pytest.approx(10.0 / 12.0)

    def test_adaptive_faster_stays_adaptive(self):
        g = StepGuard(warmup=0, window=3, recheck=10)
        _pairs(g, 8.0, 10.0, 6)
        assert g.decision == "adaptive" and not g.suspended
        assert g.speedup == pytest.approx(1.25)

    def test_a_drift_falls_on_both_paths(self):
        # the machine is 20% slower for the first half: an adaptive window then a dense one would
        # compare 11.4 against 10 ms and send a faster adaptive model dense
        g = StepGuard(warmup=0, window=4, recheck=10, tie=0.0)
        for i in range(8):
            scale = 1.2 if i < 4 else 1.0
            g.record((10.0 if g.suspended else 9.5) * scale)
        assert g.decision == "adaptive"
        assert g.speedup == pytest.approx(10.0 / 9.5)

    def test_median_ignores_one_outlier(self):
        g = StepGuard(warmup=0, window=3, recheck=10)
        for ms in (8.0, 10.0, 500.0, 10.0, 8.0, 10.0):  # adaptive, dense, ...: a garbage-collection pause
            g.record(ms)
        assert g.decision == "adaptive"

    def test_recheck_measures_again_and_doubles(self):
        g = StepGuard(warmup=0, window=2, recheck=4, max_recheck=6)
        _pairs(g, 12.0, 10.0, 4)
        assert g.decision == "dense"
        _feed(g, 10.0, 4)  # hold, dense
        assert g.phase == "adaptive" and not g.suspended
        _pairs(g, 7.0, 10.0, 4)  # sparsity rose: adaptive got faster
        assert g.decision == "adaptive" and not g.suspended
        assert len(g.comparisons) == 2
        _feed(g, 7.0, 5)
        assert g.phase == "hold"  # the next hold is min(2 * 4, 6) = 6 steps
        g.record(7.0)
        assert g.phase == "adaptive"

    def test_a_dropped_step_keeps_the_paths_balanced(self):
        g = StepGuard(warmup=0, window=2, recheck=10)
        g.record(8.0)  # adaptive
        assert g.suspended
        g.suspended = False  # as if a step ran adaptive while the guard had set dense: one more adaptive
        g._phase = "adaptive"
        g.record(8.0)
        assert g.suspended and g.phase == "dense"  # dense has fewer samples: it runs next
        g.record(10.0)
        assert g.suspended  # still fewer dense samples
        g.record(10.0)
        assert g.decision == "adaptive" and g.comparisons[-1]["rounds"] == 1

    def test_margin(self):
        g = StepGuard(warmup=0, window=1, recheck=10, margin=1.1)
        g.record(10.5)
        g.record(10.0)
        assert g.decision == "adaptive"  # within 10% of dense is kept

    def test_listeners_see_each_switch(self):
        g = StepGuard(warmup=0, window=1, recheck=10)
        seen = []
        g.on_change(seen.append)
        g.record(12.0)
        g.record(10.0)
        assert seen == [True]  # the dense step; the verdict keeps it dense, no second switch

    def test_a_close_comparison_times_more_rounds(self):
        g = StepGuard(warmup=0, window=3, recheck=10)  # tie 3%, up to 3 rounds
        _pairs(g, 10.2, 10.0, 6)  # 2% apart: no verdict yet
        assert g.decision is None and g.phase == "adaptive" and not g.suspended
        _pairs(g, 9.0, 10.0, 6)  # medians over both rounds: 9.6 against 10.0, 4% apart
        assert g.decision == "adaptive" and g.phase == "hold"
        assert g.comparisons[-1]["rounds"] == 2
        assert g.adaptive_ms == pytest.approx(9.6) and g.dense_ms == pytest.approx(10.0)

    def test_a_tie_is_decided_after_max_rounds(self):
        g = StepGuard(warmup=0, window=2, recheck=10, max_rounds=2)
        _pairs(g, 10.1, 10.0, 8)
        assert g.decision == "dense" and g.comparisons[-1]["rounds"] == 2
        # the next comparison starts afresh: its samples are not mixed with these
        _feed(g, 10.0, 10)  # hold
        _pairs(g, 5.0, 10.0, 4)
        assert g.decision == "adaptive" and g.adaptive_ms == pytest.approx(5.0)
        assert g.comparisons[-1]["rounds"] == 1

    def test_tie_zero_decides_on_one_round(self):
        g = StepGuard(warmup=0, window=1, recheck=10, tie=0.0)
        g.record(10.1)
        g.record(10.0)
        assert g.decision == "dense"

    @pytest.mark.parametrize(
        "kw",
        [
            dict(window=0),
            dict(warmup=-1),
            dict(recheck=0),
            dict(margin=0.0),
            dict(window=2.5),
            dict(tie=-0.1),
            dict(tie=1.0),
            dict(max_rounds=0),
        ],
    )
    def test_bad_arguments(self, kw):
        with pytest.raises(ValueError, match=next(iter(kw))):
            StepGuard(**kw)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 8 * 8, 10),
    )


class TestWiring:
    def test_steps_are_training_forwards(self):
        net = _net()
        g = StepGuard(warmup=100, window=1)
        rt = sa.enable(net, guard=g, policy=SPARSE)
        x = torch.randn(2, 3, 8, 8)
        for _ in range(4):
            net(x).sum().backward()
        # 4 forwards = 3 intervals; the first interval ran calibration (dropped)
        assert g.steps == 2
        net.eval()
        with torch.no_grad():
            net(x)
        net.train()
        net(x).sum().backward()  # the chain was broken by the evaluation: no step
        assert g.steps == 2
        net(x).sum().backward()
        assert g.steps == 3
        rt.disable()
        net(x).sum().backward()
        assert g.steps == 3

    def test_suspended_layers_run_dense_and_match(self):
        net = _net()
        ref = _net()
        g = StepGuard(warmup=100, window=1)
        rt = sa.enable(net, guard=g, policy=SPARSE)
        x = torch.randn(4, 3, 8, 8)
        for _ in range(3):
            net(x).sum().backward()
        st = rt.layers["2"]
        assert st.path == "sparse" and st.sparse_calls > 0
        g._set_suspended(True)
        before = st.sparse_calls
        y = net(x)
        assert st.sparse_calls == before
        torch.testing.assert_close(y, ref(x), rtol=1e-5, atol=1e-5)
        g._set_suspended(False)
        net(x)
        assert st.sparse_calls == before + 1

    def test_slow_adaptive_ends_dense_in_report(self):
        net = _net()
        g = StepGuard(warmup=0, window=1, recheck=100)
        rt = sa.enable(net, guard=g)
        g.record(12.0)
        g.record(10.0)
        assert g.suspended and "step guard: dense" in rt.format()
        assert rt.guard.summary()["decision"] == "dense"

    def test_forced_policy_has_no_guard(self):
        rt = sa.enable(_net(), policy=sa.Policy(force="sparse"))
        assert rt.guard is None

    def test_guard_false_and_bad_guard(self):
        assert sa.enable(_net(), guard=False).guard is None
        with pytest.raises(TypeError, match="guard"):
            sa.enable(_net(), guard="yes")

    def test_guard_cannot_attach_twice(self):
        g = StepGuard()
        sa.enable(_net(), guard=g)
        with pytest.raises(RuntimeError, match="already attached"):
            sa.enable(_net(), guard=g)


def test_a_slow_sparse_path_ends_dense_end_to_end(monkeypatch):
    """Every layer predicted faster, every step slower: the guard measures it and the model runs dense."""
    import time
    from sparsa.adaptive import modules

    real = modules.relu_conv2d

    def slow(*a, **k):
        time.sleep(0.03)
        return real(*a, **k)

    monkeypatch.setattr(modules, "relu_conv2d", slow)
    net = _net()
    g = StepGuard(warmup=2, window=3, recheck=1000)
    rt = sa.enable(net, guard=g, policy=SPARSE)
    x = torch.randn(2, 3, 8, 8)
    for _ in range(12):
        net(x).sum().backward()
    assert g.decision == "dense" and g.suspended and g.speedup < 1.0
    st = rt.layers["2"]
    before = st.sparse_calls
    for _ in range(3):
        net(x).sum().backward()
    assert st.sparse_calls == before and st.path == "sparse"  # the layer's own choice stands, suspended
    monkeypatch.setattr(modules, "relu_conv2d", real)


def test_a_fast_sparse_path_stays_adaptive_end_to_end(monkeypatch):
    import time

    net = _net()
    real_forward = nn.Conv2d._conv_forward

    def slow_dense(self, *a):
        time.sleep(0.03)
        return real_forward(self, *a)

    g = StepGuard(warmup=2, window=3, recheck=1000)
    rt = sa.enable(net, guard=g, policy=SPARSE)
    monkeypatch.setattr(nn.Conv2d, "_conv_forward", slow_dense)  # only the conv fed by a ReLU has a sparse path
    x = torch.randn(2, 3, 8, 8)
    for _ in range(12):
        net(x).sum().backward()
    assert g.decision == "adaptive" and not g.suspended and g.speedup > 1.0
    assert rt.layers["2"].sparse_calls > 0


def test_step_time_is_forward_and_backward_only():
    """Time spent between backward and the next forward (optimizer, data, other work) is not counted."""
    import time

    class Recording(StepGuard):
        def record(self, ms):
            self.seen.append(ms)
            super().record(ms)

    g = Recording(warmup=100, window=1)
    g.seen = []
    net = _net()
    sa.enable(net, guard=g, policy=SPARSE)
    x = torch.randn(2, 3, 8, 8)
    for _ in range(5):
        net(x).sum().backward()
        time.sleep(0.2)  # e.g. loading the next batch
    assert len(g.seen) == 3 and max(g.seen) < 150, g.seen
    # a frozen model has no gradient hooks: the step runs to the next forward
    frozen = _net().requires_grad_(False)
    g2 = Recording(warmup=100, window=1)
    g2.seen = []
    sa.enable(frozen, guard=g2, policy=SPARSE)
    for _ in range(3):
        frozen(x.requires_grad_(True)).sum().backward()
        time.sleep(0.2)
    assert len(g2.seen) == 1 and g2.seen[0] >= 190
