"""benchmarks/bitmask_prefill.py: every bitmask strategy on one weight against dense F.linear.

Runs the script on one small shape, one round (no timing assertions): its rows, the CPU record and the
errors for bad arguments.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from sparsa.kernels import bitmask as bm

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import bitmask_prefill  # noqa: E402


@pytest.mark.parametrize(
    "args", [["--sparsities", "1.0"], ["--sparsities", "3:4x"], ["--tokens", "0"], ["--rounds", "0"]]
)
def test_bad_arguments_are_named(args, tmp_path):
    with pytest.raises((SystemExit, ValueError)):
        bitmask_prefill.main(args + ["--out", str(tmp_path / "x.json")])


def test_rows_strategies_and_cpu(monkeypatch, tmp_path):
    if bm.native_library() is None:
        pytest.skip("no native bitmask kernel here")
    monkeypatch.setitem(bitmask_prefill.SHAPES, "tiny", [(40, 96)])
    out = tmp_path / "bp.json"
    bitmask_prefill.main(
        ["--models", "tiny", "--tokens", "4", "40", "--sparsities", "0.5", "2:4", "--rounds", "1", "--threads", "1"]
        + ["--out", str(out)]
    )
    res = json.loads(out.read_text())
    assert res["benchmark"] == "bitmask_prefill" and isinstance(res["cpu"], dict) and res["cpu"]
    assert len(res["rows"]) == 2 * 2 * 2  # sparsities x dtypes x tokens
    for r in res["rows"]:
        assert r["max_rel_err"] < (1e-4 if r["dtype"] == "float32" else 2e-2)
        assert ("stream_ms" in r) == (r["tokens"] <= bitmask_prefill.STREAM_MAX) and "expand_whole_ms" in r
        has_panel = bm.has_panel_bf16() if r["dtype"] == "bfloat16" else bm.has_panel_f32()
        assert ("panel_ms" in r) == has_panel
        assert r["best_dense"] in ("float32", "bfloat16")
        assert r["auto_vs_best_dense"] == r[f"{r['auto_strategy']}_vs_best_dense"]
        if r["tokens"] <= bm.stream_max_tokens(getattr(torch, r["dtype"])):
            assert r["auto_strategy"] == "stream"
