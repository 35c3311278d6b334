"""benchmarks/row_group_ab.py: an older commit's row_group kernel against this tree's, in one process.

Building an old commit's kernels takes a minute, so the timed run here pits this tree's library against
itself (the rows, the output comparison, the JSON); the commit lookup is checked on its error path.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import row_group_ab as A  # noqa: E402
from sparsa.kernels import row_group as rgk  # noqa: E402


def test_rows_compare_two_kernels_and_dense(tmp_path, monkeypatch):
    lib = rgk.native_library()
    if lib is None:
        pytest.skip("no native row_group kernels here (SPARSA_NO_NATIVE or no compiler)")
    monkeypatch.setattr(A, "old_library", lambda rev, where: ("0" * 40, lib))
    monkeypatch.setattr(A, "SHAPES", [(48, 40)])
    out = tmp_path / "ab.json"
    threads = torch.get_num_threads()
    try:
        A.main(["HEAD", "--quick", "--rounds", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    d = json.loads(out.read_text())
    assert d["benchmark"] == "row_group_ab" and d["old"] == "0" * 40 and "flags" in d["cpu"]
    assert [(r["out_features"], r["in_features"], r["tokens"], r["sparsity"]) for r in d["rows"]] == [
        (48, 40, 1024, 0.5),
        (48, 40, 1024, 0.9),
    ]
    for r in d["rows"]:
        assert r["max_abs_diff"] == 0.0  # the same library on both sides
        assert r["old_ms"] > 0 and r["new_ms"] > 0 and r["dense_bf16_ms"] > 0
        assert r["new_over_old"] == pytest.approx(r["old_ms"] / r["new_ms"], rel=0.01)
        assert r["new_vs_dense"] == pytest.approx(r["dense_bf16_ms"] / r["new_ms"], rel=0.01)
    assert rgk.native_library() is lib  # the library is put back after every timed call


def test_an_unknown_commit_is_named(tmp_path):
    with pytest.raises(SystemExit, match="'no-such-commit' is not a commit"):
        A.old_library("no-such-commit", tmp_path)
