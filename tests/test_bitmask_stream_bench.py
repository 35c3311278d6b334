"""benchmarks/bitmask_stream.py: the decode kernel over a decoder's block linears against dense F.linear.

Runs the script on one layer, one round (no timing assertions): its rows, the CPU record, the errors for
bad arguments, and the tables.py section rendered from its JSON.
"""

import json
import sys
from pathlib import Path

import pytest

from sparsa.kernels import bitmask as bm

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import bitmask_stream  # noqa: E402
import tables  # noqa: E402


def test_block_shapes_are_the_llama_block_linears():
    shapes = bitmask_stream.block_shapes("llama-0.5b", 2)
    assert len(shapes) == 14
    assert shapes[:7] == [
        (1536, 1536),
        (512, 1536),
        (512, 1536),
        (1536, 1536),
        (4096, 1536),
        (4096, 1536),
        (1536, 4096),
    ]


@pytest.mark.parametrize(
    "args",
    [["--sparsities", "1.0"], ["--tokens", "33"], ["--tokens", "0"], ["--layers", "0"], ["--rounds", "0"]],
)
def test_bad_arguments_are_named(args, tmp_path):
    with pytest.raises(SystemExit, match="bitmask_stream: need"):
        bitmask_stream.main([*args, "--out", str(tmp_path / "x.json")])


def test_one_layer_run_writes_rows_and_renders(tmp_path, monkeypatch):
    if bm.native_library() is None:
        pytest.skip("no native bitmask kernel here: the benchmark refuses to run")
    monkeypatch.delenv("SPARSA_NO_NATIVE", raising=False)
    out = tmp_path / "bitmask_stream.json"
    bitmask_stream.main(
        ["--layers", "1", "--dtypes", "float32", "bfloat16", "--sparsities", "0.7", "--tokens", "1", "2"]
        + ["--rounds", "1", "--out", str(out)]
    )
    res = json.loads(out.read_text())
    assert res["benchmark"] == "bitmask_stream" and "avx2" in res["cpu"]["flags"]
    rows = res["rows"]
    assert [(r["dtype"], r["tokens"]) for r in rows] == [
        ("float32", 1),
        ("float32", 2),
        ("bfloat16", 1),
        ("bfloat16", 2),
    ]
    for r in rows:
        assert r["stream_ms"] > 0 and r["dense_ms"] > 0
        assert r["speedup_vs_dense"] == pytest.approx(r["dense_ms"] / r["stream_ms"], rel=0.01)
        assert r["best_dense"] in ("float32", "bfloat16")
        assert r["speedup_vs_best_dense"] <= r["speedup_vs_dense"] + 1e-3
        assert 0.2 < r["weight_bytes_ratio"] < 0.5  # 70% sparse: values plus one bit per weight
        assert r["max_rel_err"] < (1e-5 if r["dtype"] == "float32" else 1e-2)
    text = tables.bitmask_stream_section(res)
    assert "| float32 | 0.7 | 1 |" in text and "llama-0.5b (1 layers)" in text


def test_the_faster_dense_dtype_is_the_baseline(tmp_path, monkeypatch):
    if bm.native_library() is None:
        pytest.skip("no native bitmask kernel here: the benchmark refuses to run")
    monkeypatch.delenv("SPARSA_NO_NATIVE", raising=False)
    seen = []

    def fixed(fns, rounds, min_seconds=0.003):  # each pass runs once; dense bf16 "reads half the bytes"
        seen.append(sorted(fns))
        for fn in fns.values():
            fn()
        return {"stream": 3.0, "float32": 9.0, "bfloat16": 4.5}

    monkeypatch.setattr(bitmask_stream, "round_robin_ms", fixed)
    out = tmp_path / "bitmask_stream.json"
    bitmask_stream.main(
        ["--layers", "1", "--dtypes", "float32", "--sparsities", "0.5", "--tokens", "1"]
        + ["--rounds", "1", "--out", str(out)]
    )
    assert seen == [["bfloat16", "float32", "stream"]]  # bf16 is timed although only fp32 was asked
    (row,) = json.loads(out.read_text())["rows"]
    assert row["speedup_vs_dense"] == 3.0
    assert row["best_dense"] == "bfloat16" and row["speedup_vs_best_dense"] == 1.5
