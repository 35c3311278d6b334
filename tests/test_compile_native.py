"""``torch.compile`` runs the native kernels through the same ``sparsa::`` ops as eager, with the same results:
a sparse ``F.linear`` forward and training step (fullgraph where the layout allows), and the adaptive conv /
linear training steps (behind a graph break: their kernel choices are data-dependent)."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from sparsa.adaptive import conv as aconv
from sparsa.adaptive import relu_conv2d, relu_linear
from sparsa.kernels import loader

ROOT = Path(__file__).resolve().parents[1]
# (layout, params, fullgraph forward, fullgraph training step). The SlicedELL and Bitmask backwards pick their
# products from the weight's density.
LINEAR = [
    ("row_group", dict(group=8, sparsity=0.5), True, True),
    ("sliced_ell", dict(sparsity=0.8), True, False),
    ("bitmask", dict(sparsity=0.5), True, False),
    ("grouped_nm", dict(n=2, m=4, g=2), True, True),
    ("nm", dict(n=2, m=4), True, False),
    ("csr", {}, True, False),
    ("bsr", dict(blocksize=(4, 4)), True, False),
    ("coo", {}, True, False),
    ("masked", {}, True, False),
]
# Run in a child process: under pytest's log capture torch formats trace records whose payloads hold a
# SparseTensor's repr, and its nnz reads data, which fails inside the trace.
CHILD = """
import json, sys, warnings
import torch, torch.nn.functional as F
import sparsa
warnings.simplefilter("ignore")
out = {}
for layout, params, fullgraph, step_fullgraph in json.loads(sys.argv[1]):
    gen = torch.Generator().manual_seed(0)
    w = sparsa.to_sparse(torch.randn(16, 32, generator=gen), layout, **params)
    b = torch.randn(16, generator=gen)
    x = torch.randn(5, 32, generator=gen)
    fwd = lambda x: F.linear(x, w, b)
    torch._dynamo.reset()
    y = torch.compile(fwd, backend="aot_eager", fullgraph=fullgraph)(x)
    step = lambda x: F.linear(x, w, b).square().sum()
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    step(xe).backward()
    torch._dynamo.reset()
    torch.compile(step, backend="aot_eager", fullgraph=step_fullgraph)(xc).backward()
    out[layout] = [float((y - fwd(x)).abs().max()), float((xc.grad - xe.grad).abs().max())]
print(json.dumps(out))
"""


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    torch._dynamo.reset()


def test_sparse_linear_forward_and_step_match_eager():
    if not loader.native_enabled():
        pytest.skip("native kernels disabled")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(LINEAR)], env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    diffs = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(diffs) == {p[0] for p in LINEAR}
    for layout, (dy, dgrad) in diffs.items():
        assert dy == 0.0 and dgrad <= 1e-6, (layout, dy, dgrad)


def _grads(fn, *leaves):
    for t in leaves:
        t.grad = None
    y = fn(*leaves)
    y.square().sum().backward()
    return [y.detach()] + [t.grad.clone() for t in leaves]


@pytest.mark.parametrize("stride", [1, 2])
def test_adaptive_conv_step_matches_eager(stride):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 8, 8, generator=gen).requires_grad_()
    w = torch.randn(32, 16, 3, 3, generator=gen).requires_grad_()
    b = torch.randn(32, generator=gen).requires_grad_()

    def step(x, w, b):
        return relu_conv2d(x, w, b, stride=stride, padding=1)

    before = dict(aconv.backward_paths)
    ref = _grads(step, x, w, b)
    eager_paths = {k: v - before.get(k, 0) for k, v in aconv.backward_paths.items()}
    before = dict(aconv.backward_paths)
    got = _grads(torch.compile(step, backend="aot_eager"), x, w, b)
    compiled_paths = {k: v - before.get(k, 0) for k, v in aconv.backward_paths.items()}
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=0, atol=0)
    assert compiled_paths == eager_paths  # the same kernels ran


def test_adaptive_linear_step_matches_eager():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 16, generator=gen).requires_grad_()
    w = torch.randn(24, 16, generator=gen).requires_grad_()
    b = torch.randn(24, generator=gen).requires_grad_()

    def step(x, w, b):
        return relu_linear(x, w, b)

    ref = _grads(step, x, w, b)
    got = _grads(torch.compile(step, backend="aot_eager"), x, w, b)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=0, atol=0)
