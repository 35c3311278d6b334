"""benchmarks/adaptive_bf16.py: activation-sparse convs on bf16 inputs against the dense paths.

Runs the script on one small shape (no timing assertions): its rows, the CPU record and the best dense
baseline; on a CPU without the bf16 union kernels, that it says so and writes nothing.
"""

import json
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import adaptive_bf16  # noqa: E402
from sparsa.kernels import adaptive_union_bf16 as B  # noqa: E402


def test_rows_compare_the_bf16_kernels_with_the_fastest_dense_path(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(adaptive_bf16, "SHAPES", [(16, 8), (32, 4)])
    out = tmp_path / "a.json"
    threads = torch.get_num_threads()
    try:
        adaptive_bf16.main(["--quick", "--threads", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)  # the script sets it for its process; later tests run with the default
    if not B.union_dpbf16():
        assert "AVX512-BF16" in capsys.readouterr().out and not out.exists()
        return
    d = json.loads(out.read_text())
    assert d["cpu"]["flags"]["avx512_bf16"] and d["quick"]
    assert [(r["shape"][1], r["sparsity"]) for r in d["rows"]] == [(32, 0.7), (32, 0.9)]
    for r in d["rows"]:
        dense = {k[: -len("_ms")]: v for k, v in r.items() if k.startswith("dense_") and k.endswith("_ms")}
        assert set(dense) == {"dense_bf16_nchw", "dense_bf16_cl", "dense_fp32_nchw", "dense_fp32_cl"}
        assert r["best_dense"] == min(dense, key=dense.get)
        assert abs(r["speedup_vs_best_dense"] - dense[r["best_dense"]] / r["bf16_kernels_ms"]) < 0.01
        assert abs(r["speedup_fp32_kernels_vs_best_dense"] - dense[r["best_dense"]] / r["fp32_kernels_ms"]) < 0.01
