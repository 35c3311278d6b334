"""benchmarks/row_group_mlp.py: the fused MLP op against its two products and dense, one tiny shape, one round
(no timing assertions): its rows, the CPU record, the path taken and the errors for bad arguments."""

import json
import sys
from pathlib import Path

import pytest

from sparsa.kernels import row_group as rg

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import row_group_mlp  # noqa: E402


@pytest.mark.parametrize(
    "args", [["--sparsities", "1.0"], ["--sparsities", "0"], ["--tokens", "0"], ["--rounds", "0"], ["--models", "x"]]
)
def test_bad_arguments_are_named(args, tmp_path):
    with pytest.raises(SystemExit):
        row_group_mlp.main(args + ["--out", str(tmp_path / "x.json")])


def test_rows_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setitem(row_group_mlp.SHAPES, "bert-base", (48, 96, 32))
    out = tmp_path / "mlp.json"
    row_group_mlp.main(
        ["--sparsities", "0.5", "--tokens", "8", "64", "--rounds", "1", "--threads", "1", "--out", str(out)]
    )
    res = json.loads(out.read_text())
    assert res["benchmark"] == "row_group_mlp" and isinstance(res["cpu"], dict) and res["cpu"]
    assert [r["tokens"] for r in res["rows"]] == [8, 64]
    for r in res["rows"]:
        assert r["max_rel_err"] < 2e-2
        assert r["best_dense"] in row_group_mlp.DENSE
        assert r["dense_compiled_bfloat16_ms"] > 0
        assert r["fused_ms"] > 0 and r["two_products_ms"] > 0 and r["dense_bfloat16_ms"] > 0
        # 8 tokens never take the one-call path; 64 take it where the AMX tiles run
        assert r["fused_path"] == ("native" if rg.has_amx() and r["tokens"] >= 16 else "two_products")
