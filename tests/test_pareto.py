"""benchmarks/pareto.py and sparsa.frontier: the grid's pieces on a tiny random BERT, the frontier on
hand-made points, the pattern configurations and the README text domain. No timing assertions."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import pareto  # noqa: E402
import tables  # noqa: E402

from sparsa.frontier import (  # noqa: E402
    DenseBaselines,
    grouped_nm_for,
    highest_passing,
    pareto_frontier,
    pattern_config,
    prune_copy,
    top1_agreement,
)


# ----------------------------------------------------------------------------- pure functions
def test_frontier_on_hand_made_points():
    pts = [(1.0, 0.99), (2.0, 0.90), (1.5, 0.80), (3.0, 0.50), (0.8, 0.995), (2.0, 0.85), (3.0, 0.50)]
    # (1.5, 0.80) and (2.0, 0.85) are beaten by (2.0, 0.90); the duplicate (3.0, 0.5) points do not beat each other
    assert pareto_frontier(pts) == [0, 1, 3, 4, 6]
    assert pareto_frontier([]) == [] and pareto_frontier([(1.0, 1.0)]) == [0]


def test_mark_frontier_counts_the_best_dense_point():
    rows = [
        {"speedup_vs_best_dense": 0.9, "quality_cosine": 0.99},  # slower than dense and worse: off
        {"speedup_vs_best_dense": 2.0, "quality_cosine": 0.80},
        {"speedup_vs_best_dense": 1.5, "quality_cosine": 0.70},
    ]
    assert [r["on_frontier"] for r in pareto.mark_frontier(rows)] == [False, True, False]


def test_highest_passing_bisects():
    grid = [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    for limit in (0.25, 0.3, 0.55, 0.9, 0.95):
        calls = []
        got = highest_passing(grid, lambda s: calls.append(s) or s <= limit)
        want = max((s for s in grid if s <= limit), default=None)
        assert got == want and len(calls) <= 4
    with pytest.raises(ValueError, match="ascending"):
        highest_passing([0.5, 0.3], lambda s: True)


def test_top1_agreement():
    ref = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
    assert top1_agreement(ref, ref) == 1.0
    swapped = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.9, 0.1], [0.1, 0.9]])  # 0's neighbour is now 2, 1's is 3 ...
    assert 0.0 <= top1_agreement(ref, swapped) < 1.0
    with pytest.raises(ValueError):
        top1_agreement(ref, ref[:3])


def test_pattern_configs():
    assert [grouped_nm_for(s) for s in (0.5, 0.6, 0.7, 0.8, 0.9)] == [(2, 4), (2, 5), (2, 7), (1, 5), (1, 10)]
    c = pattern_config("unstructured", 0.7)
    assert (c.layout, c.sparsity, c.recover_pattern) == ("sliced_ell", 0.7, "unstructured")
    assert pattern_config("4:8", 0.9).sparsity == 0.5 and pattern_config("4:8", 0.9).layout == "nm"
    g = pattern_config("grouped_nm", 0.8)
    assert (g.label, g.sparsity, g.recover_pattern) == ("grouped_nm1:5", 0.8, "grouped_1:5")
    assert pattern_config("row_group8", 0.6).sparsifier.group == 8
    for bad in ("nope", "row_groupX", "a:b"):
        with pytest.raises(ValueError):
            pattern_config(bad, 0.5)
    cfgs = pareto.configs(["2:4", "unstructured", "grouped_nm"], [0.5, 0.6])
    assert [(c.label, c.sparsity) for c in cfgs] == [
        ("2:4", 0.5),
        ("sliced_ell", 0.5),
        ("sliced_ell", 0.6),
        ("grouped_nm2:4", 0.5),
        ("grouped_nm2:5", 0.6),
    ]


def test_readme_domain_is_deterministic_and_apart_from_docstrings():
    from sparsa.data.text import readme_sentences, stdlib_sentences

    a, b = readme_sentences(), readme_sentences()
    assert a == b and len(a) >= 50
    assert set(a).isdisjoint(stdlib_sentences())
    assert all(40 <= len(s) <= 200 and "http" not in s and ">>>" not in s for s in a)
    cal, distill, held = pareto.texts(16, 20, 24)
    assert set(held) == {"docstrings", "readme"} and all(len(v) == 20 for v in held.values())
    assert set(cal).isdisjoint(held["docstrings"]) and set(distill).isdisjoint(held["docstrings"])
    assert set(cal).isdisjoint(held["readme"]) and set(distill).isdisjoint(held["readme"])
    assert distill[:16] == cal and len(distill) > 1000  # the pool first, then the extra docstrings


# ----------------------------------------------------------------------------- the grid on a tiny BERT
@pytest.fixture(scope="module")
def tiny():
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer, BertConfig, BertModel

    from sparsa.models.minilm import model_dir

    torch.manual_seed(0)
    model = BertModel(
        BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    ).eval()
    return model, AutoTokenizer.from_pretrained(str(model_dir()), local_files_only=True)


@pytest.fixture(autouse=True)
def _keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_grid_rows_on_a_tiny_bert(tiny, tmp_path):
    model, tok = tiny
    cfgs = pareto.configs(["unstructured", "row_group4"], [0.5])
    assert len(cfgs) == 2
    cal, _, held = pareto.texts(16, 8)
    calibration = pareto._batches(tok, cal, 8)
    base = DenseBaselines(model, torch.randint(0, 1000, (2, 16)), use_compile=False, reps=1, log=lambda s: None)
    assert set(base.ms) == {"fp32", "bf16"} and base.best in base.ms
    speed = pareto.speed_rows(model, cfgs, base, log=lambda s: None)
    assert set(speed) == {("sliced_ell", 0.5), ("row_group4", 0.5)}
    assert all(v["sparse_dtype"] in ("float32", "bfloat16") for v in speed.values())
    # the unstructured mask is timed in each layout that computes with it, the fastest kept
    assert set(speed[("sliced_ell", 0.5)]["layouts"]) == {"sliced_ell", "bitmask"}
    assert speed[("row_group4", 0.5)]["sparse_layout"] == "row_group"
    quality, skipped = pareto.quality_rows(
        model, tok, cfgs, ["magnitude", "wanda"], calibration, held, log=lambda s: None
    )
    assert len(quality) == 4 and skipped == []
    rows = pareto.merge(quality, speed, "test-cpu")
    for r in rows:
        for k in pareto.ROW_KEYS + (
            "cosine_docstrings",
            "cosine_readme",
            "top1_docstrings",
            "top1_readme",
            "on_frontier",
            "label",
        ):
            assert k in r, k
        assert r["cpu"] == "test-cpu" and r["recovered"] is False and -1.0 <= r["quality_cosine"] <= 1.0
        assert 0.0 <= r["quality_top1"] <= 1.0 and r["speedup_vs_best_dense"] > 0
        assert r["sparse_dtype"] == speed[(r["label"], r["sparsity"])]["sparse_dtype"]
        assert r["layout"] == speed[(r["label"], r["sparsity"])]["sparse_layout"]
        assert abs(r["quality_cosine"] - (r["cosine_docstrings"] + r["cosine_readme"]) / 2) < 1e-3
    json.dumps(rows)
    pareto.plot(rows, tmp_path / "p.png", "tiny")
    assert (tmp_path / "p.png").stat().st_size > 1000
    # a row the method cannot make is skipped with its reason; so is one past the budget
    gnm = pareto.configs(["grouped_nm"], [0.75])
    q2, sk2 = pareto.quality_rows(model, tok, gnm, ["sparsegpt"], calibration, held, log=lambda s: None)
    assert q2 == [] and "grouped_nm" in sk2[0]["reason"]
    q3, sk3 = pareto.quality_rows(model, tok, cfgs, ["magnitude"], calibration, held, deadline=0.0, log=lambda s: None)
    assert q3 == [] and len(sk3) == 2 and all(s["reason"] == "--budget spent" for s in sk3)


def test_best_path_tries_every_way_and_keeps_the_fastest(tiny, monkeypatch):
    # speeds are made up (by what each way runs), so the choice is checked, not the machine's timing
    from torch._dynamo.eval_frame import OptimizedModule

    from sparsa.nn.fuse import LinearGELU
    from sparsa.nn.fused_mlp import FusedMLP

    model, _ = tiny
    base = DenseBaselines(model, torch.randint(0, 1000, (2, 16)), use_compile=False, reps=1, log=lambda s: None)
    sparse = pattern_config("row_group4", 0.5)
    pruned = pareto.prune_copy(model, "magnitude", sparse)

    def speed(m):
        inner = m._orig_mod if isinstance(m, OptimizedModule) else m
        bf16 = next(inner.parameters()).dtype == torch.bfloat16
        fused = any(isinstance(x, (LinearGELU, FusedMLP)) for x in inner.modules())
        v = 1.0 + bf16 + 0.5 * fused + isinstance(m, OptimizedModule)
        return {"speedup_vs_best_dense": v, "speedup_vs_dense": v, "best_dense": "fp32", "sparse_ms": 1.0}

    monkeypatch.setattr(DenseBaselines, "speedup", lambda self, m, reps=None: speed(m))
    out = base.best_path(pruned)
    assert (out["sparse_dtype"], out["sparse_path"]) == ("bfloat16", "fused")  # no compiled baseline: no compile
    assert out["paths"] == {"float32/eager": 1.0, "bfloat16/eager": 2.0, "bfloat16/fused": 2.5}
    assert next(pruned.parameters()).dtype == torch.float32  # the model itself is untouched
    assert not any(isinstance(x, (LinearGELU, FusedMLP)) for x in pruned.modules())
    base.compile_s = 0.0  # as if the dense side had been compiled: the sparse side is compiled too
    out = base.best_path(pruned)
    assert (out["sparse_dtype"], out["sparse_path"], out["speedup_vs_best_dense"]) == ("bfloat16", "compiled", 3.5)


def test_sparsegpt_cannot_make_grouped_nm(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="grouped_nm"):
        prune_copy(model, "sparsegpt", pattern_config("grouped_nm", 0.5), [{"input_ids": torch.ones(1, 4).long()}])


@pytest.mark.skipif(pareto.recover is None, reason="sparsa.methods.recover is not available")
def test_recovered_row_on_a_tiny_bert(tiny):
    model, tok = tiny
    cfgs = pareto.configs(["row_group4"], [0.5])
    cal, distill, held = pareto.texts(8, 6, 16)
    q, sk = pareto.quality_rows(
        model,
        tok,
        cfgs,
        [],
        pareto._batches(tok, cal, 8),
        held,
        [("row_group4", 0.5)],
        ["magnitude"],
        pareto._batches(tok, distill[:16], 8, 32),
        2.0,
        log=lambda s: None,
    )
    assert sk == [] and len(q) == 1 and q[0]["recovered"] is True and q[0]["recover_steps"] >= 1


def test_tables_render_a_pareto_section(tmp_path):
    cls = tmp_path / "test-cpu"
    cls.mkdir()
    rows = [
        dict(
            method="wanda",
            pattern="unstructured",
            layout="sliced_ell",
            label="sliced_ell",
            sparsity=0.5,
            recovered=False,
            quality_cosine=0.9,
            quality_top1=0.8,
            cosine_docstrings=0.91,
            cosine_readme=0.89,
            top1_docstrings=0.8,
            top1_readme=0.8,
            speedup_vs_best_dense=1.2,
            speedup_vs_dense=1.2,
            best_dense="fp32",
            cpu="test-cpu",
            on_frontier=True,
        )
    ]
    (cls / "pareto.json").write_text(
        json.dumps(
            {
                "benchmark": "pareto",
                "cpu": {"class": "test-cpu"},
                "rows": rows,
                "skipped": [],
                "quick": True,
                "seconds": 1.0,
                "threads": 2,
            }
        )
    )
    text = tables.render(tmp_path)
    assert "python benchmarks/pareto.py" in text and "sliced_ell" in text and "0.900" in text
    # the label names the pattern; a run from before sparse_path was recorded ran eagerly
    assert "| wanda | unstructured | 0.50 |" in text and "| sliced_ell | float32 | eager |" in text
    assert "test-cpu" in tables.readme_summary(tmp_path)


def test_tables_render_the_recovery_runs(tmp_path):
    cls = tmp_path / "test-cpu"
    cls.mkdir()
    old = dict(pattern="unstructured", sparsity=0.75, budget_s=360.0, lr=2e-4, steps=520, recovered_cosine=0.8575)
    new = dict(old, lr=1e-3, dropout=0.0, n_distil=5732, recovered_cosine=0.9312, recovered_cosine_readme=0.8123)
    (cls / "recover.json").write_text(
        json.dumps({"cpu": {"class": "test-cpu"}, "model": "all-MiniLM-L6-v2", "rows": [old, new]})
    )
    text = tables.render(tmp_path)
    assert "Recovery to high sparsity on MiniLM (`python benchmarks/recover.py`)" in text
    lines = [ln for ln in text.splitlines() if ln.startswith("| unstructured | 0.75 |")]
    assert len(lines) == 2
    assert "| 0.0002 | 0.1 | - |" in lines[0] and "0.8575 | - |" in lines[0]  # an old run: dropout 0.1, no readme
    assert "| 0.001 | 0.0 | 5732 |" in lines[1] and "0.9312 | 0.8123 |" in lines[1]
