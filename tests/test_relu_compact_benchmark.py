"""benchmarks/relu_compact_ops.py: every route computes the same gradients, the JSON has its schema and
tables.py renders it. No timing assertions."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import relu_compact_ops  # noqa: E402
import tables  # noqa: E402


@pytest.mark.parametrize("op", ["conv2d", "linear"])
def test_every_route_computes_the_same_gradients(op):
    gen = torch.Generator().manual_seed(0)
    if op == "conv2d":
        x, w, kw = torch.randn(2, 16, 5, 5, generator=gen), torch.randn(8, 16, 3, 3, generator=gen), {"padding": 1}
    else:
        x, w, kw = torch.randn(7, 24, generator=gen), torch.randn(8, 24, generator=gen), {}
    fns = relu_compact_ops._routes(op, x, w, kw)
    assert set(fns) >= {"fp32", "bf16", "relu_kernels", "op", "op_from_dense", "op_via_dense"}
    grads = {name: fn() for name, fn in fns.items()}  # each route returns the gradients of its (x, w)
    ref = grads["fp32"]
    for name, g in grads.items():
        tol = 5e-2 if name == "bf16" else 1e-3
        for got, want in zip(g, ref):
            torch.testing.assert_close(got.contiguous(), want.contiguous(), atol=tol, rtol=tol)


def test_the_json_has_its_schema_and_renders(tmp_path):
    out = tmp_path / "relu_compact_ops.json"
    relu_compact_ops.main(["--tiny", "--threads", "1", "--out", str(out)])
    d = json.loads(out.read_text())
    assert d["cpu"]["class"] and d["rows"]
    for r in d["rows"]:
        assert r["best_dense"] in relu_compact_ops.DENSE
        for k in ("relu_kernels", "op", "op_from_dense", "op_via_dense"):
            assert r[f"{k}_ms"] > 0 and r[f"{k}_speedup_vs_best_dense"] > 0
    md = tables.relu_compact_section(d)
    assert md.startswith("| op | shape | sparsity | best_dense |") and "relu_kernels x" in md
