"""benchmarks/sliced_ell_ab.py: an older commit's sliced_ell kernel against this tree's, in one process.

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

import sliced_ell_ab as A  # noqa: E402
from sparsa.kernels import sliced_ell as sek  # noqa: E402


def test_rows_compare_two_kernels_and_dense(tmp_path, monkeypatch):
    lib = sek.native_library()
    if lib is None:
        pytest.skip("no native sliced_ell kernels here (SPARSA_NO_NATIVE or no compiler)")
    monkeypatch.setattr(A, "old_library", lambda rev, where: ("0" * 40, lib))
    monkeypatch.setattr(A, "SHAPES", [(48, 40)])
    out = tmp_path / "ab.json"
    threads = torch.get_num_threads()
    try:
        A.main(["HEAD", "--quick", "--rounds", "1", "--runs", "70x1", "--rows", "fma", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    d = json.loads(out.read_text())
    assert d["benchmark"] == "sliced_ell_ab" and d["old"] == "0" * 40 and "flags" in d["cpu"]
    got = [(r["out_features"], r["in_features"], r["tokens"], r["sparsity"], r["dtype"], r["rows"]) for r in d["rows"]]
    assert got == [(48, 40, 70, 0.9, "float32", "fma"), (48, 40, 70, 0.9, "bfloat16", "fma")]
    for r in d["rows"]:
        assert r["max_abs_diff"] == 0.0  # the same library on both sides
        assert r["old_ms"] > 0 and r["new_ms"] > 0 and r["dense_bf16_ms"] > 0
        assert r["new_over_old"] == pytest.approx(r["old_ms"] / r["new_ms"], rel=0.01)
        assert r["new_vs_dense"] == pytest.approx(r["dense_bf16_ms"] / r["new_ms"], rel=0.01)


def test_bad_arguments_and_an_unknown_commit_are_named(tmp_path):
    for bad in ("0x1", "128", "64x0", "axb"):
        with pytest.raises(SystemExit):
            A.main(["HEAD", "--runs", bad])
    with pytest.raises(SystemExit, match="'no-such-commit' is not a commit"):
        A.old_library("no-such-commit", tmp_path)
