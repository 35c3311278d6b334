"""KernelOp calls: eager calls on plain tensors run the implementation directly; anything that must
see the op (autograd on its inputs, dispatch modes, fake tensors, jit tracing) gets the op."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sparsa.kernels.opdef import KernelOp, kernel_op

_CALLS = []


def _impl(x: torch.Tensor, k: int) -> torch.Tensor:
    _CALLS.append(type(x))
    return x * k


def _fake(x, k):
    return torch.empty_like(x)


PROBE = kernel_op("test_direct_call_probe(Tensor x, int k) -> Tensor", _impl, _fake)


class _Seen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _profiled_op_names(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, {e.name for e in prof.events()}


def test_kernel_op_is_a_kernelop_exposing_the_op():
    assert isinstance(PROBE, KernelOp)
    assert PROBE.op is torch.ops.sparsa.test_direct_call_probe.default
    assert "test_direct_call_probe" in str(PROBE._schema)


def test_plain_eager_call_skips_the_dispatcher():
    x = torch.arange(4.0)
    out, names = _profiled_op_names(lambda: PROBE(x, 3))
    assert torch.equal(out, x * 3)
    assert not any("test_direct_call_probe" in n for n in names), names
    # the op itself still works and agrees
    out2, names2 = _profiled_op_names(lambda: PROBE.op(x, 3))
    assert torch.equal(out2, out)
    assert any("test_direct_call_probe" in n for n in names2), names2


def test_parameter_is_a_plain_tensor_but_its_grad_still_takes_the_op():
    # a module's weight or bias is an nn.Parameter: under no_grad the direct call is safe for it
    p = torch.nn.Parameter(torch.arange(3.0))
    with torch.no_grad():
        out, names = _profiled_op_names(lambda: PROBE(p, 2))
    assert torch.equal(out, torch.arange(3.0) * 2)
    assert not any("test_direct_call_probe" in n for n in names), names
    _, names = _profiled_op_names(lambda: PROBE(p, 2))  # grad mode and requires_grad: autograd must see it
    assert any("test_direct_call_probe" in n for n in names), names


def test_kwargs_reach_the_implementation():
    x = torch.ones(2)
    assert torch.equal(PROBE(x, k=5), torch.full((2,), 5.0))


def test_input_requiring_grad_takes_the_op_and_backward_warns():
    x = torch.ones(3, requires_grad=True)
    out, names = _profiled_op_names(lambda: PROBE(x, 2))
    assert any("test_direct_call_probe" in n for n in names), names
    with pytest.warns(UserWarning, match="autograd kernel was not registered"):
        out.sum().backward()
    with torch.no_grad():  # no autograd to record: the direct call is safe again
        _, names = _profiled_op_names(lambda: PROBE(x, 2))
    assert not any("test_direct_call_probe" in n for n in names)


def test_dispatch_mode_sees_the_op():
    x = torch.ones(3)
    with _Seen() as mode:
        out = PROBE(x, 4)
    assert any("test_direct_call_probe" in o for o in mode.ops), mode.ops
    assert torch.equal(out, torch.full((3,), 4.0))


def test_fake_tensors_get_the_fake_implementation():
    from torch._subclasses.fake_tensor import FakeTensorMode

    _CALLS.clear()
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.ones(5))
        out = PROBE(x, 2)
    assert out.shape == (5,)
    assert _CALLS == []  # the real implementation never saw a fake tensor


def test_jit_trace_records_the_op():
    graph = torch.jit.trace(lambda x: PROBE(x, 2), torch.ones(3)).graph
    assert "test_direct_call_probe" in str(graph)


def test_compiled_call_matches_eager():
    fn = torch.compile(lambda x: PROBE(x, 3) + 1, backend="eager", fullgraph=True)
    x = torch.randn(6)
    assert torch.equal(fn(x), x * 3 + 1)


_EVENTS = []


def _frame_probe_impl(x: torch.Tensor) -> torch.Tensor:
    _EVENTS.append("impl")
    return x + 1


FRAME_PROBE = kernel_op("test_eval_frame_probe(Tensor x) -> Tensor", _frame_probe_impl, lambda x: torch.empty_like(x))


def test_the_dispatcher_runs_the_implementation_with_dynamos_frame_evaluation_reset(monkeypatch):
    # inside a compiled graph the implementation's Python frames run several times slower until the frame
    # evaluation is reset (kernels/opdef.py); the op resets it around the implementation and sets it back
    import sparsa.kernels.opdef as opdef

    real = opdef._set_eval_frame

    def recording(callback):
        _EVENTS.append(("set", callback))
        return real(callback)

    monkeypatch.setattr(opdef, "_set_eval_frame", recording)
    torch._dynamo.reset()
    try:
        f = torch.compile(lambda x: FRAME_PROBE(x * 2) - 1, fullgraph=True)
        x = torch.ones(3)
        f(x)  # compiles
        _EVENTS.clear()
        assert torch.equal(f(x), torch.full((3,), 2.0))
        assert _EVENTS[0] == ("set", None) and _EVENTS[1] == "impl" and _EVENTS[2][0] == "set" and len(_EVENTS) == 3
        _EVENTS.clear()
        assert torch.equal(FRAME_PROBE.op(x), x + 1)  # an eager call of the op takes the same path
        assert _EVENTS[:2] == [("set", None), "impl"] and len(_EVENTS) == 3
    finally:
        torch._dynamo.reset()
