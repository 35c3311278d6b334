"""Adaptive training under bf16 autocast: the sparse path returns what autocast's own ops return."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sparsa.adaptive as sa
from sparsa.adaptive.autocast import autocast_bf16, sparse_under_autocast
from sparsa.adaptive.calibration import Calibration
from sparsa.adaptive.conv_union import union_path_supported_for, union_paths
from sparsa.kernels import adaptive as K

SPARSE = sa.Policy(enter=1e-6, exit=1e-6, verify_below=0)  # sparse wherever the input is a ReLU output


def _net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 64),
        nn.ReLU(),
        nn.Linear(64, 16),
    )


def _grads(net):
    return {n: p.grad.detach().clone() for n, p in net.named_parameters()}


def _train_step(net, x, y):
    net.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = net(x)
        loss = F.cross_entropy(out, y)
    loss.backward()  # outside autocast, as PyTorch recommends
    return out


def test_autocast_helpers():
    assert not autocast_bf16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_bf16()
        seen = []
        y = sparse_under_autocast(
            lambda t: seen.append((t.dtype, autocast_bf16())) or t + 1, torch.zeros(3, dtype=torch.bfloat16)
        )
        assert seen == [(torch.float32, False)] and y.dtype == torch.bfloat16
        y = sparse_under_autocast(
            lambda t: seen.append((t.dtype, autocast_bf16())) or t + 1,
            torch.zeros(3, dtype=torch.bfloat16),
            bf16_operands=True,
        )
        assert seen[1:] == [(torch.bfloat16, False)] and y.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.float16):
        assert not autocast_bf16()


class _Fp32UnderAutocast(nn.Module):
    """The sparse path's numerics with dense kernels: fp32 math on the (bf16) input, one rounding at the end."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return sparse_under_autocast(self.inner, x)


class _Bf16OperandsUnderAutocast(nn.Module):
    """The numerics of the bf16 union kernels (AVX512-BF16) with dense kernels: the conv of the bf16 input with
    the bf16-rounded weight in fp32, one rounding at the end; the weight gradient in fp32 (straight through the
    rounding), the input gradient rounded to bf16."""

    def __init__(self, inner: nn.Conv2d):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        w = self.inner.weight
        w_rounded = w + (w.detach().bfloat16().float() - w.detach())
        with torch.autocast("cpu", enabled=False):
            y = F.conv2d(x.float(), w_rounded, self.inner.bias, padding=self.inner.padding)
        return y.bfloat16()


def _emulation(conv: nn.Module) -> nn.Module:
    """The dense emulation of the sparse path that runs for ``conv`` here."""
    if isinstance(conv, nn.Conv2d) and union_path_supported_for(torch.bfloat16, torch.device("cpu"), conv.weight, None):
        return _Bf16OperandsUnderAutocast(conv)
    return _Fp32UnderAutocast(conv)


def _adaptive_grads(tmp_path, x, y):
    net = _net()
    rt = sa.enable(net, policy=SPARSE, guard=False, calibration=Calibration(tmp_path / "cal.json"))
    for _ in range(2):
        out = _train_step(net, x, y)
    for name in ("2", "5", "7"):
        assert rt.layers[name].sparse_calls > 0, name
    assert rt.layers["0"].sparse_calls == 0  # its input is no ReLU output
    return out, _grads(net)


@pytest.mark.parametrize("seed", [0, 9, 15])
def test_sparse_path_under_autocast_matches_its_dense_emulation(tmp_path, seed):
    # Seeds 9 and 15 once looked like a bug: their gradients are 11-14% off fp32. The cause is one hidden
    # unit whose pre-activation sits within bf16 rounding of 0 and flips its ReLU. Against a dense model
    # with the same numerics (fp32 math on bf16 inputs) the sparse path agrees to fp32 accuracy.
    torch.manual_seed(seed)
    x = torch.randn(4, 3, 8, 8)
    y = torch.randint(0, 16, (4,))
    emu = _net()
    for name in ("2", "5", "7"):
        emu[int(name)] = _emulation(emu[int(name)])
    out_e = _train_step(emu, x, y)
    ge = {n.replace(".inner", ""): g for n, g in _grads(emu).items()}
    dx_sides = ("dx_x", "dx_dy", "dx_dense")
    before = union_paths["bf16_fwd"], sum(union_paths[k] for k in dx_sides)
    out_a, ga = _adaptive_grads(tmp_path, x, y)
    if isinstance(emu[2], _Bf16OperandsUnderAutocast):  # the bf16 path ran: its forward, and an input gradient
        assert union_paths["bf16_fwd"] > before[0] and sum(union_paths[k] for k in dx_sides) > before[1]
    assert out_a.dtype == out_e.dtype == torch.bfloat16
    torch.testing.assert_close(out_a, out_e, rtol=1e-2, atol=1e-2)
    for n, g in ge.items():
        assert ga[n].dtype == torch.float32
        torch.testing.assert_close(ga[n], g, rtol=1e-3, atol=1e-4, msg=n)


def test_sparse_path_under_autocast_is_as_accurate_as_dense_bf16(tmp_path):
    # Over several inputs, because one ReLU flip near 0 can move a single seed's gradient by >10% either way.
    errs_a, errs_d = [], []
    for seed in range(4):
        torch.manual_seed(seed)
        x = torch.randn(4, 3, 8, 8)
        y = torch.randint(0, 16, (4,))
        ref32 = _net()
        F.cross_entropy(ref32(x), y).backward()
        g32 = _grads(ref32)
        dense = _net()
        out_d = _train_step(dense, x, y)
        gd = _grads(dense)
        out_a, ga = _adaptive_grads(tmp_path / str(seed), x, y)
        torch.testing.assert_close(out_a.float(), out_d.float(), rtol=0.05, atol=0.05)
        for n in g32:
            errs_a.append(float((ga[n] - g32[n]).norm() / g32[n].norm()))
            errs_d.append(float((gd[n] - g32[n]).norm() / g32[n].norm()))
    med_a, med_d = sorted(errs_a)[len(errs_a) // 2], sorted(errs_d)[len(errs_d) // 2]
    assert med_a <= 1.5 * med_d + 0.005, (med_a, med_d)


def test_calibration_under_autocast_has_its_own_entries(tmp_path):
    cal = Calibration(tmp_path / "cal.json")
    net = _net()
    rt = sa.enable(net, guard=False, calibration=cal)
    x = torch.randn(2, 3, 8, 8)
    y = torch.randint(0, 16, (2,))
    _train_step(net, x, y)
    keys = list(cal._table)
    assert len(keys) == 3 and all(k.endswith("|autocast=bf16") for k in keys)  # the dense side timed in bf16
    assert all(r["dense_ms"] is not None for r in rt.report() if r["layer"] in ("2", "5", "7"))
    # the conv's input is bf16 here: its dY-driven backward is timed as for an fp32 input
    (conv,) = [e for k, e in cal._table.items() if "|conv2d|" in k]
    assert conv.dy_path == K.native_available() and (conv.dy_slope_ms is not None) == conv.dy_path


def test_bf16_model_without_autocast_runs_dense():
    net = _net().to(torch.bfloat16)
    rt = sa.enable(net, policy=SPARSE, guard=False)
    out = net(torch.randn(2, 3, 8, 8, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16
    assert all(st.sparse_calls == 0 for st in rt.layers.values())


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
def test_autocast_both_memory_formats(fmt, tmp_path):
    net = _net().to(memory_format=fmt)
    rt = sa.enable(net, policy=SPARSE, guard=False, calibration=Calibration(tmp_path / "cal.json"))
    x = torch.randn(2, 3, 8, 8).contiguous(memory_format=fmt)
    out = _train_step(net, x, torch.randint(0, 16, (2,)))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    assert rt.layers["2"].sparse_calls > 0
