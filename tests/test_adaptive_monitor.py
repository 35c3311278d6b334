"""One SparsityMonitor for CPU and GPU, one public compaction; the old import paths still work."""

import pytest
import torch

import sparsa.adaptive as sa
from sparsa.adaptive.monitor import sampled_counts, sampled_density


def test_one_monitor_class_everywhere():
    import sparsa.gpu
    import sparsa.gpu.monitor as gm

    assert sparsa.gpu.SparsityMonitor is sa.SparsityMonitor and gm.SparsityMonitor is sa.SparsityMonitor
    assert gm.sampled_counts is sampled_counts and gm.sampled_density is sampled_density
    assert "compact" not in sparsa.gpu.__all__  # the panel compaction is private; sparsa.adaptive.compact is public


def test_the_gpu_monitors_calls_keep_their_meaning():
    """What the GPU monitor promised: None before the first refresh, a refresh every ``every`` calls."""
    mon = sa.SparsityMonitor(every=2, samples=64)
    assert mon.density is None and mon.density_tensor is None
    mon.observe(torch.zeros(100))
    assert mon.density == 0.0 and float(mon.density_tensor) == 0.0
    mon.observe(torch.ones(100))  # not due: keeps the old estimate
    assert mon.density == 0.0 and mon.steps == 2
    mon.observe(torch.ones(100))
    assert mon.density == 1.0 and mon.sparsity == 0.0
    with pytest.raises(ValueError, match="every"):
        sa.SparsityMonitor(every=0)
    with pytest.raises(ValueError, match="samples"):
        sa.SparsityMonitor(samples=0)


def test_sampled_counts_is_a_strided_sample():
    x = torch.relu(torch.randn(3001, generator=torch.Generator().manual_seed(0)))
    assert float(sampled_density(x, samples=10_000)) == pytest.approx(float((x != 0).float().mean()))
    c = sampled_counts(x, samples=500, offset=3)
    stride = 3001 // 500
    want = x[3 % stride :: stride][:500]
    assert c.dtype == torch.int32 and c.tolist() == [int((want != 0).sum()), 500]
    out = sampled_counts(x, samples=500, offset=3, out=c)  # accumulates
    assert out is c and c.tolist()[1] == 1000
    with pytest.raises(ValueError, match="samples"):
        sampled_counts(x, samples=0)
    with pytest.raises(TypeError, match="torch.Tensor"):
        sampled_counts([1.0, 0.0])


def test_a_device_tensor_is_counted_on_its_device_without_a_sync():
    """Off the CPU the monitor keeps the sample's counts on the tensor's device (a meta tensor here, which
    holds no values: any host read would fail) until ``sparsity`` is read."""
    mon = sa.SparsityMonitor(every=1, samples=64)
    assert mon.observe(torch.empty(4, 16, 8, 8, device="meta"))
    assert mon.source == "sample" and mon.empty_slices is None
    assert mon.density_tensor.device.type == "meta"
    # a CPU activation takes the CPU path again (pixel sample, exact empty-slice fraction)
    mon.observe(torch.relu(torch.randn(4, 16, 8, 8)))
    assert mon.density_tensor.device.type == "cpu" and mon.empty_slices is not None
    assert 0.3 < mon.sparsity < 0.7


def test_the_fused_count_refresh_still_sets_the_estimate():
    mon = sa.SparsityMonitor(every=1, slice=4)
    assert mon.tick()
    a = sa.compact(torch.relu(torch.randn(2, 8, 3, 3)), slice=4)
    mon.record_count(a.cnt, a.numel)
    assert mon.source == "count" and mon.sparsity == pytest.approx(1.0 - a.density)
