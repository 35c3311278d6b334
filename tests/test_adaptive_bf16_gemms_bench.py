"""benchmarks/adaptive_bf16_gemms.py: each GEMM of the bf16 activation-sparse conv against dense bf16.

Runs the script on one small shape (no timing assertions): its rows, the CPU record, the per-GEMM choice
and the pair densities; on a CPU without the bf16 union kernels, that it says so and writes nothing.
"""

import json
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import adaptive_bf16_gemms as G  # noqa: E402
import tables  # noqa: E402
from sparsa.kernels import adaptive_union_bf16 as B  # noqa: E402


def test_rows_time_every_gemm_against_dense_bf16(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(G, "SHAPES", [(16, 8), (32, 4)])
    out = tmp_path / "g.json"
    threads = torch.get_num_threads()
    try:
        G.main(["--quick", "--threads", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    if not B.union_dpbf16():
        assert "AVX512-BF16" in capsys.readouterr().out and not out.exists()
        return
    d = json.loads(out.read_text())
    assert d["cpu"]["flags"]["avx512_bf16"] and d["quick"]
    assert [(r["shape"][1], r["sparsity"], r["dy"]) for r in d["rows"]] == [
        (16, 0.5, "dense"),
        (16, 0.5, "maxpool"),
        (16, 0.9, "dense"),
        (16, 0.9, "maxpool"),
        (32, 0.5, "dense"),
        (32, 0.5, "maxpool"),
        (32, 0.9, "dense"),
        (32, 0.9, "maxpool"),
    ]
    for r in d["rows"]:
        for gemm in ("fwd", "dx", "dw"):
            ways = {k[: -len("_ms")]: v for k, v in r.items() if k.startswith(gemm + "_") and k.endswith("_ms")}
            assert ways[r["best_" + gemm]] == min(ways.values())  # by the rounded times: ties are possible
            ratio = r[f"dense_{gemm}_ms"] / ways[r["best_" + gemm]]
            assert abs(r[gemm + "_vs_dense"] - ratio) <= 0.05 * ratio + 0.01  # the times are rounded to 1 µs
        assert r["x_elem"] <= r["x_pair_g1"] <= r["x_pair_g2"] <= r["x_pair_g4"] <= 1
    s = tables.SECTIONS["adaptive_bf16_gemms"](d)
    assert "32x16x8x8" in s and "x_pair_g4" in s


def test_pair_densities_count_a_pair_set_by_either_channel_in_any_pixel_of_the_group():
    t = torch.zeros(1, 4, 1, 4)
    t[0, 0, 0, 0] = 1.0  # pair (0, 1) in pixel 0 only
    t[0, 3, 0, 2] = 2.0  # pair (2, 3) in pixel 2 only
    d = G.pair_densities(t, "x")
    assert d == {"x_elem": 2 / 16, "x_pair_g1": 2 / 8, "x_pair_g2": 2 / 4, "x_pair_g4": 2 / 2}
