"""The benchmark scripts compare against the best dense path and record the CPU; tables render per CPU class.

Pure functions (ratios against the best dense baseline, which baseline that is) and the JSON schema of a
tiny linear_kernels grid, rendered by tables.py into a fake per-class results tree. No timing assertions.
"""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import bert_inference  # noqa: E402
import linear_kernels  # noqa: E402
import tables  # noqa: E402


def test_dense_labels_round_trip():
    for dtype in ("float32", "bfloat16"):
        for compiled in (False, True):
            assert linear_kernels.parse_dense_label(linear_kernels.dense_label(dtype, compiled)) == (dtype, compiled)
    assert linear_kernels.dense_label("bfloat16", True) == "compiled_bf16"
    assert bert_inference.dense_label("float32", True) == "compiled_fp32"


@pytest.mark.parametrize("ratios", [linear_kernels.sparse_ratios, bert_inference.speedups])
def test_best_dense_ratio_is_against_the_fastest_dense(ratios):
    key = "ratio" if ratios is linear_kernels.sparse_ratios else "speedup"
    r = ratios({"fp32": 10.0, "compiled_fp32": 8.0, "sparse": 2.0})
    assert r["best_dense"] == "compiled_fp32"
    assert r[f"{key}_vs_dense"] == pytest.approx(5.0)
    assert r[f"{key}_vs_best_dense"] == pytest.approx(4.0)
    # a "best" baseline that came out slower than fp32 in this timing: fp32 is the best then
    r = ratios({"fp32": 10.0, "bf16": 12.0, "sparse": 5.0})
    assert r["best_dense"] == "fp32" and r[f"{key}_vs_best_dense"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="fp32"):
        ratios({"bf16": 1.0, "sparse": 1.0})


def test_pick_best_and_dense_rows():
    ms = {"fp32": 4.0, "bf16": 2.0, "compiled_bf16": 1.0}
    assert linear_kernels.pick_best(ms) == "compiled_bf16" == bert_inference.best_dense(ms)
    with pytest.raises(ValueError):
        linear_kernels.pick_best({})
    rows = linear_kernels.dense_rows(
        ms, {"fp32": 1e-7, "bf16": 1e-3, "compiled_bf16": 0.5}, dict(out_features=8, in_features=8, tokens=2, threads=1)
    )
    by = {linear_kernels.dense_label(r["dtype"], r["compiled"]): r for r in rows}
    assert by["fp32"]["ratio_vs_dense"] == 1.0 and by["fp32"]["ratio_vs_best_dense"] == pytest.approx(0.25)
    assert by["compiled_bf16"]["ratio_vs_best_dense"] == 1.0 and by["compiled_bf16"]["ratio_vs_dense"] == 4.0
    assert by["bf16"]["accurate"] and not by["compiled_bf16"]["accurate"]  # 0.5 is far above bf16's tolerance
    assert all(r["layout"] == "dense" and r["sparsity"] == 0.0 for r in rows)


def test_rel_err_is_relative_to_the_largest_reference_value():
    ref = torch.tensor([1.0, -4.0], dtype=torch.float64)
    assert linear_kernels.rel_err(torch.tensor([1.0, -3.0]), ref) == pytest.approx(0.25)
    assert linear_kernels.rel_err(torch.empty(0), torch.empty(0, dtype=torch.float64)) == 0.0


@pytest.fixture(scope="module")
def tiny_grid():
    """A real (tiny) linear_kernels run: one 32x32 shape, fp32 and bf16 rows, no torch.compile."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    try:
        rows = linear_kernels.run(
            [(32, 32)],
            [4],
            [0.5],
            [1],
            reps=1,
            layouts=["row_group"],
            dtypes=("float32", "bfloat16"),
            use_compile=False,
        )
    finally:
        torch.set_num_threads(threads)
    return rows


def test_linear_rows_schema(tiny_grid):
    rows = json.loads(json.dumps(tiny_grid))  # survives JSON (no tensors, no NaN surprises)
    for r in rows:
        missing = [k for k in linear_kernels.ROW_KEYS if k not in r]
        assert not missing, (r, missing)
        assert r["dtype"] in ("float32", "bfloat16") and r["ratio_vs_best_dense"] > 0
        assert r["ratio_vs_best_dense"] <= r["ratio_vs_dense"] + 1e-9
    dense = {(r["dtype"], r["compiled"]) for r in rows if r["layout"] == "dense"}
    assert dense == {("float32", False), ("bfloat16", False)}
    sparse = [r for r in rows if r["layout"] != "dense"]
    assert {(r["layout"], r["dtype"]) for r in sparse} >= {
        ("row_group", "float32"),
        ("row_group", "bfloat16"),
        ("torch_csr", "float32"),
        ("torch_bsr", "float32"),
    }
    for r in sparse:
        assert all(k in r for k in linear_kernels.SPARSE_KEYS), r
        assert r["best_dense"] in ("fp32", "bf16")
        assert r["rel_tol"] == linear_kernels.REL_TOL[r["dtype"]]
    rg = {r["dtype"]: r for r in sparse if r["layout"] == "row_group"}
    assert rg["float32"]["max_rel_err"] < 1e-5 and rg["float32"]["accurate"]
    assert 0 < rg["bfloat16"]["max_rel_err"] < linear_kernels.REL_TOL["bfloat16"] and rg["bfloat16"]["accurate"]


def _fake_cpu(cls):
    flags = {f: False for f in tables.KEY_FLAGS}
    flags.update(avx2=True, fma=True)
    return {
        "model": "Fake CPU 9000",
        "class": cls,
        "flags": flags,
        "cores": 2,
        "threads": 2,
        "isa": "avx2",
        "torch": torch.__version__,
        "onednn": "x",
        "mkl": "y",
    }


def test_tables_render_per_cpu_class(tiny_grid, tmp_path):
    new = tmp_path / "fake-avx2"
    new.mkdir()
    (new / "linear_kernels.json").write_text(
        json.dumps({"cpu": _fake_cpu("fake-avx2"), "meta": {"quick": True}, "rows": tiny_grid})
    )
    legacy = tmp_path / "legacy-avx512"
    legacy.mkdir()
    old = [
        dict(
            layout="row_group",
            out_features=32,
            in_features=32,
            tokens=4,
            threads=1,
            sparsity=0.5,
            ratio_vs_dense=3.0,
            max_abs_err=1e-6,
        )
    ]
    (legacy / "linear_kernels.json").write_text(json.dumps({"meta": {}, "rows": old}))
    (legacy / "cpu.json").write_text(json.dumps({"model": "Old CPU", "flags": {"avx512f": True}}))
    assert [d.name for d in tables.class_dirs(tmp_path)] == ["fake-avx2", "legacy-avx512"]

    doc = tables.render(tmp_path)
    new_part, legacy_part = doc.split("## legacy-avx512")
    assert "## fake-avx2" in new_part and "CPU class `fake-avx2`: Fake CPU 9000, 2 cores" in new_part
    assert "flags: avx2, fma; lacks avx512f, avx512_bf16" in new_part
    assert "ratio_vs_best_dense" in new_part and "| bfloat16 |" in new_part
    assert "Dense baselines" in new_part and "Not measured on this CPU class yet" in new_part
    assert "CPU class `legacy-avx512`: Old CPU" in legacy_part and "not recorded: avx2" in legacy_part
    assert "ratio_vs_best_dense" not in legacy_part.split("###")[1]  # old results: no such column

    # the README summary takes measured classes over legacy ones and names the class
    summary = tables.readme_summary(tmp_path)
    assert "CPU class `fake-avx2`" in summary and "legacy" not in summary
    head = next(l for l in summary.splitlines() if l.startswith("| out_features"))
    assert "ratio_vs_best_dense" in head and "dtype" in head


def test_bert_section_columns():
    d = {
        "model": "BertModel(BertConfig()) (BERT-base, random weights)",
        "rows": [
            {
                "layout": "dense",
                "dtype": "float32",
                "compiled": False,
                "sparsity": 0.0,
                "batch": 1,
                "seq": 128,
                "threads": 2,
                "speedup_vs_dense": 1.0,
                "speedup_vs_best_dense": 0.5,
                "max_rel_err": 0.0,
                "ms": 10.0,
            },
            {
                "layout": "dense",
                "dtype": "float32",
                "compiled": True,
                "sparsity": 0.0,
                "batch": 1,
                "seq": 128,
                "threads": 2,
                "speedup_vs_dense": 2.0,
                "speedup_vs_best_dense": 1.0,
                "max_rel_err": 0.0,
                "ms": 5.0,
            },
            {
                "layout": "row_group16",
                "dtype": "bfloat16",
                "compiled": False,
                "sparsity": 0.9,
                "batch": 1,
                "seq": 128,
                "threads": 2,
                **bert_inference.speedups({"fp32": 10.0, "compiled_fp32": 5.0, "sparse": 2.0}),
                "max_rel_err": 1e-2,
            },
        ],
    }
    s = tables.bert_section(d)
    table = s.split("\n\nDense baselines")[0]
    assert "| row_group16 | bfloat16 | False | 0.9 |" in table and "| 5.00 | 2.50 | compiled_fp32 |" in table
    assert "| compiled_fp32 | 1 |" in s  # the dense baselines table
    assert not math.isnan(d["rows"][2]["speedup_vs_best_dense"])


def test_bert_dense_baselines_keep_their_batch():
    # the baseline functions are timed again per sparse model: each must still run its own batch
    import torch.nn as nn

    seen = []

    class Probe(nn.Module):
        def forward(self, ids):
            seen.append(ids.shape[0])
            return type("Out", (), {"last_hidden_state": ids.float()})()

    fns, _, _ = bert_inference.dense_baselines(Probe(), [8, 1], threads=1, reps=1, use_compile=False)
    seen.clear()
    fns[8]["fp32"]()
    fns[1]["fp32"]()
    assert seen == [8, 1]


def test_every_result_of_a_measured_class_has_a_section():
    """A JSON that a benchmark writes into a measured class's directory must appear in docs/benchmarks.md."""
    known = {name for name, _, _ in tables.BENCHES}
    assert known == set(tables.SECTIONS)
    for d in tables.class_dirs():
        if d.name.startswith("legacy"):
            continue
        names = {p.stem for p in d.glob("*.json")} - {"cpu"}
        assert names <= known, f"{d.name}: no tables.py section for {sorted(names - known)}"


@pytest.mark.parametrize("name", ["bitmask_prefill", "bf16_paths", "adaptive_bf16"])
def test_the_kernel_sections_render_their_rows(name):
    d = {"threads": 2, "rows": [], "thresholds": {"stream_max_tokens float32": 8}}
    row = {
        "bitmask_prefill": {
            "model": "m",
            "shape": [4, 8],
            "dtype": "bfloat16",
            "sparsity": "0.5",
            "tokens": 128,
            "dense_ms": 1.0,
            "panel_vs_dense": 1.25,
            "auto_strategy": "panel",
            "best_dense": "bfloat16",
            "auto_vs_best_dense": 1.25,
        },
        "bf16_paths": {
            "kernel": "row_group16",
            "out_features": 4,
            "in_features": 8,
            "tokens": 128,
            "sparsity": 0.5,
            "dp_ms": 1.0,
            "below_path": "SPARSA_ISA=avx2",
            "below_ms": 2.0,
            "speedup_vs_below": 2.0,
            "speedup_vs_best_dense": 1.25,
        },
        "adaptive_bf16": {
            "shape": [32, 64, 32, 32],
            "sparsity": 0.9,
            "threads": 2,
            "bf16_kernels_ms": 1.0,
            "best_dense": "dense_bf16_cl",
            "speedup_vs_best_dense": 1.17,
        },
    }[name]
    d["rows"] = [row]
    s = tables.SECTIONS[name](d)
    line = next(
        l
        for l in s.splitlines()
        if l.startswith("| ")
        and "---" not in l
        and not l.startswith("| model")
        and not l.startswith("| kernel")
        and not l.startswith("| shape")
    )
    assert ("4x8" in line or "32x64x32x32" in line or "row_group16" in line) and "1.25" in line or "1.17" in line, s
