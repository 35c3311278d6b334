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
    assert [(r["shape"][1], r["sparsity"], r["dy"]) for r in d["rows"]] == [
        (32, 0.7, "dense"),
        (32, 0.7, "maxpool"),
        (32, 0.9, "dense"),
        (32, 0.9, "maxpool"),
    ]
    for r in d["rows"]:
        dense = {k[: -len("_ms")]: v for k, v in r.items() if k.startswith("dense_") and k.endswith("_ms")}
        assert set(dense) == {"dense_bf16_nchw", "dense_bf16_cl", "dense_fp32_nchw", "dense_fp32_cl"}
        # the best is picked on unrounded times; rounding keeps their order but can make two tie
        assert dense[r["best_dense"]] == min(dense.values())
        assert abs(r["speedup_vs_best_dense"] - dense[r["best_dense"]] / r["bf16_kernels_ms"]) < 0.01
        assert abs(r["speedup_fp32_kernels_vs_best_dense"] - dense[r["best_dense"]] / r["fp32_kernels_ms"]) < 0.01


def test_maxpool_dy_keeps_at_most_one_pixel_per_window():
    gen = torch.Generator().manual_seed(0)
    g = adaptive_bf16.maxpool_dy(2, 8, 7, 6, 1.0, gen)
    assert g.shape == (2, 8, 7, 6)
    per_window = (torch.nn.functional.pad(g, (0, 0, 0, 1)) != 0).float().unfold(2, 2, 2).unfold(3, 2, 2).sum((-1, -2))
    assert per_window.max() == 1 and per_window[:, :, :3].min() == 1  # full windows keep exactly one (keep=1)
    kept = adaptive_bf16.maxpool_dy(4, 16, 8, 8, 0.55, gen)
    assert 0.10 < float((kept != 0).float().mean()) < 0.18  # about 0.55 / 4 nonzero
