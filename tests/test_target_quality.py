"""`sparsa prune --target-quality Q` and sparsa.prune.search_target_quality on a tiny random BERT.

The search's choices are checked with quality and speed replaced by known functions (so the test
says which candidate must win); one run measures for real (no timed assertions).
"""

import json
import os
import shutil

import pytest
import torch

import sparsa.frontier as frontier
from sparsa import cli
from sparsa.prune import SEARCH_SPARSITIES, TargetNotReached, load_pruned, search_target_quality, split_texts


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import BertConfig, BertModel

    from sparsa.models.minilm import model_dir

    d = tmp_path_factory.mktemp("tiny_bert_tq")
    torch.manual_seed(0)
    BertModel(
        BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    ).save_pretrained(str(d))
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy2(model_dir() / f, d / f)
    return d


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    from sparsa.data.text import stdlib_sentences

    p = tmp_path_factory.mktemp("data") / "texts.txt"
    p.write_text("\n".join(stdlib_sentences()[:40]) + "\n\n", encoding="utf-8")
    return p


@pytest.fixture(autouse=True)
def _keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _main(args, capsys):
    try:
        rc = cli.main(args)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


# ----------------------------------------------------------------------------- the data split
def test_split_is_disjoint_deterministic_and_deduplicated():
    texts = [f"passage number {i}" for i in range(30)] + ["passage number 3"] * 5
    cal, ev = split_texts(texts, 16)
    assert (cal, ev) == split_texts(texts, 16)
    assert set(cal).isdisjoint(ev) and len(set(cal)) == len(cal) and len(set(ev)) == len(ev)
    assert len(cal) == 16 and len(ev) == 14 and set(cal) | set(ev) == set(texts)
    cal2, ev2 = split_texts([f"t{i}" for i in range(400)], 64)
    assert (len(cal2), len(ev2)) == (64, 128)
    cal3, ev3 = split_texts([f"t{i}" for i in range(12)], 64)  # small data: a quarter held out, the rest calibrates
    assert len(ev3) >= 3 and len(cal3) + len(ev3) == 12


def test_split_needs_enough_text():
    with pytest.raises(ValueError, match="at least 8"):
        split_texts(["a", "b", "a", "c"], 16)


# ----------------------------------------------------------------------------- the search, with known quality/speed
@pytest.fixture
def known(monkeypatch):
    """Quality = 1 - sparsity (row_group: minus 0.1 more); speed = 1 + 2 * sparsity (row_group: 1.5x that).
    Records every (label, sparsity) evaluated."""
    seen = []

    def quality(model, tok, texts, ref, max_length=128):
        ws = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and hasattr(m.weight, "layout_name")]
        s = round(sum(w.numel() - w.nnz for w in ws) / sum(w.numel() for w in ws) / 0.05) * 0.05  # the grid value
        rg = ws[0].layout_name == "row_group"
        seen.append((ws[0].layout_name, round(s, 2)))
        return {
            "cosine_data": 1 - s - 0.1 * rg,
            "top1_data": 1.0,
            "quality_cosine": round(1 - s - 0.1 * rg, 4),
            "quality_top1": 1.0,
        }

    def speedup(self, model, reps=None):
        w = next(m.weight for m in model.modules() if hasattr(getattr(m, "weight", None), "layout_name"))
        s = 1 - w.nnz / w.numel()
        v = round((1 + 2 * s) * (1.5 if w.layout_name == "row_group" else 1.0), 3)
        return {
            "speedup_vs_dense": v,
            "speedup_vs_best_dense": v,
            "best_dense": "fp32",
            "dense_ms": 1.0,
            "best_dense_ms": 1.0,
            "sparse_ms": 1.0 / v,
        }

    monkeypatch.setattr(frontier, "embedding_quality", quality)
    monkeypatch.setattr(frontier.DenseBaselines, "speedup", speedup)
    return seen


def _search(tiny_dir, out, target, **kw):
    """search_target_quality on the tiny model, quickly: no torch.compile baseline, one timing repetition."""
    return search_target_quality(str(tiny_dir), str(out), target, use_compile=False, reps=1, log=None, **kw)


def test_search_picks_the_fastest_passing_by_bisection(tiny_dir, data_file, tmp_path, known):
    out = tmp_path / "out"
    res = _search(tiny_dir, out, 0.62, method="wanda", data=data_file, patterns=["unstructured", "row_group4", "2:4"])
    # unstructured passes up to 0.35 (1 - s >= 0.62 -> s <= 0.38), row_group4 up to 0.25 (below the grid:
    # none), 2:4 at 0.5 fails; so unstructured at 0.35 wins
    assert res.chosen is not None and (res.chosen["label"], res.chosen["sparsity"]) == ("sliced_ell", 0.35)
    assert res.chosen["passes"] and res.chosen["quality_cosine"] >= 0.62
    passing = [c for c in res.candidates if c["passes"]]
    assert res.chosen["speedup_vs_best_dense"] == max(c["speedup_vs_best_dense"] for c in passing)
    # bisection: a few evaluations per pattern, not the whole grid
    per = {lay: sum(1 for s in known if s[0] == lay) for lay in ("sliced_ell", "row_group", "nm")}
    assert 1 <= per["sliced_ell"] <= 5 and 1 <= per["row_group"] <= 5 and per["nm"] == 1
    assert len(SEARCH_SPARSITIES) > 10
    # the fastest passing candidate was written
    w = load_pruned(str(out)).encoder.layer[0].attention.self.query.weight
    assert w.layout_name == "sliced_ell" and abs(w.sparsity - 0.35) < 0.02
    assert res.n_evaluation + res.n_calibration <= 40 and res.n_evaluation >= 2
    text = res.table()
    assert "<-" in text and "row_group4" in text and "cosine" in res.summary()


def test_speed_decides_among_passing(tiny_dir, tmp_path, known):
    res = _search(tiny_dir, tmp_path / "o", 0.35, method="magnitude", patterns=["unstructured", "row_group4"])
    # unstructured up to 0.65 (speed 2.3), row_group4 up to 0.55 (speed 1.5 * 2.1 = 3.15): row_group4 wins
    assert (res.chosen["label"], res.chosen["sparsity"]) == ("row_group4", 0.55)


def test_an_unstructured_mask_is_saved_in_its_fastest_layout(tiny_dir, tmp_path, known, monkeypatch):
    # made-up speeds: the same mask runs twice as fast as bitmask in bfloat16, so that is what is saved
    timed = frontier.DenseBaselines.speedup  # the fixture's made-up speeds

    def bitmask_in_bf16_is_faster(self, model, reps=None):
        out = dict(timed(self, model, reps))
        w = next(m.weight for m in model.modules() if hasattr(getattr(m, "weight", None), "layout_name"))
        if w.layout_name == "bitmask" and w.dtype == torch.bfloat16:
            out["speedup_vs_best_dense"] *= 2
        return out

    monkeypatch.setattr(frontier.DenseBaselines, "speedup", bitmask_in_bf16_is_faster)
    out = tmp_path / "o"
    res = _search(tiny_dir, out, 0.62, method="magnitude", patterns=["unstructured"])
    c = res.chosen
    assert (c["label"], c["sparsity"], c["layout"]) == ("sliced_ell", 0.35, "bitmask")
    assert (c["sparse_dtype"], c["sparse_path"]) == ("bfloat16", "eager")
    assert "bitmask, bfloat16, eager" in res.summary() and "(bfloat16, eager)" in res.table()
    w = load_pruned(str(out)).encoder.layer[0].attention.self.query.weight
    assert w.layout_name == "bitmask" and abs(w.sparsity - 0.35) < 0.02


def test_unreachable_target_writes_nothing(tiny_dir, tmp_path, known):
    out = tmp_path / "never"
    with pytest.raises(TargetNotReached) as e:
        search_target_quality(
            str(tiny_dir), str(out), 0.99, patterns=["row_group4", "2:4"], use_compile=False, reps=1, log=None
        )
    assert not out.exists() and e.value.result.chosen is None
    assert "no configuration reached" in str(e.value) and e.value.result.candidates


def test_cli_unreachable_exits_1_without_out(tiny_dir, tmp_path, known, capsys):
    out = tmp_path / "never"
    rc, stdout, err = _main(
        ["prune", str(tiny_dir), "-o", str(out), "--target-quality", "0.99", "--pattern", "row_group4", "--no-compile"],
        capsys,
    )
    assert rc == 1 and not out.exists()
    assert "no configuration reached" in err and err.count("\n") == 1 and "row_group4" in stdout


def test_min_speedup_keeps_the_model_dense_when_no_passing_configuration_is_that_fast(tiny_dir, tmp_path, known):
    # unstructured passes up to 0.35 at about 1.7x (made-up speeds): a 2x floor leaves nothing to write
    out = tmp_path / "never"
    with pytest.raises(TargetNotReached) as e:
        _search(tiny_dir, out, 0.62, method="magnitude", patterns=["unstructured"], min_speedup=2.0)
    res = e.value.result
    assert not out.exists() and res.chosen is None and res.min_speedup == 2.0
    assert any(c["passes"] for c in res.candidates)
    msg = str(e.value)
    assert "at >= 2x the best dense path" in msg and "keep the model dense" in msg and "sliced_ell at 35%" in msg


def test_min_speedup_below_the_winner_changes_nothing(tiny_dir, tmp_path, known):
    res = _search(tiny_dir, tmp_path / "o", 0.62, method="magnitude", patterns=["unstructured"], min_speedup=1.6)
    assert (res.chosen["label"], res.chosen["sparsity"]) == ("sliced_ell", 0.35)
    assert (tmp_path / "o").is_dir()


def test_min_speedup_limits_recovery_to_configurations_that_fast(tiny_dir, data_file, tmp_path, recovery_adds):
    # with a floor above every candidate's speed nothing is worth recovering
    with pytest.raises(TargetNotReached):
        _search(
            tiny_dir,
            tmp_path / "o",
            0.62,
            method="magnitude",
            patterns=["unstructured"],
            data=data_file,
            recover_seconds=1.0,
            min_speedup=50.0,
        )
    assert recovery_adds == []


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "2"])
def test_bad_min_speedup(tiny_dir, tmp_path, bad):
    with pytest.raises(ValueError, match="--min-speedup"):
        search_target_quality(str(tiny_dir), str(tmp_path / "o"), 0.9, min_speedup=bad, log=None)


def test_cli_min_speedup_exits_1_saying_keep_dense(tiny_dir, tmp_path, known, capsys):
    out = tmp_path / "never"
    args = ["prune", str(tiny_dir), "-o", str(out), "--target-quality", "0.62", "--pattern", "unstructured"]
    rc, stdout, err = _main([*args, "--no-compile", "--min-speedup", "2"], capsys)
    assert rc == 1 and not out.exists()
    assert "keep the model dense" in err and err.count("\n") == 1 and "sliced_ell" in stdout


@pytest.fixture
def recovery_adds(monkeypatch, known):
    """On top of ``known``: a model that went through recovery scores 0.3 higher. The recovery itself
    is the real one (for a short budget); its keyword arguments are recorded."""
    import sparsa.prune_recovery as pr

    calls, real, quality = [], pr.recover_pruned, frontier.embedding_quality

    def recover_pruned(model, teacher, tok, **kw):
        calls.append(kw)
        rep = real(model, teacher, tok, **dict(kw, seconds=1.0, progress=False))
        model._recovered_for_test = True
        return rep

    def scored(model, tok, texts, ref, max_length=128):
        q = quality(model, tok, texts, ref, max_length)
        bonus = 0.3 if getattr(model, "_recovered_for_test", False) else 0.0
        return dict(q, quality_cosine=round(q["quality_cosine"] + bonus, 4))

    monkeypatch.setattr(pr, "recover_pruned", recover_pruned)
    monkeypatch.setattr(frontier, "embedding_quality", scored)
    return calls


def test_recovery_lets_a_faster_configuration_pass(tiny_dir, data_file, tmp_path, recovery_adds):
    """Target 0.62: one-shot, unstructured passes up to 0.35 (speed 1.7) and row_group4 nowhere. The two
    failed candidates faster than that and nearest the target are recovered, then pass (+0.3), and the
    faster of them wins. The held-out text is never distilled on; the written model is the winner."""
    out = tmp_path / "out"
    res = _search(
        tiny_dir,
        out,
        0.62,
        method="wanda",
        data=data_file,
        patterns=["unstructured", "row_group4"],
        recover_seconds=30.0,
        recover_candidates=2,
    )
    assert len(recovery_adds) == 2
    rec = [c for c in res.candidates if c.get("recovered")]
    assert len(rec) == 2 and all(c["recover_steps"] >= 1 for c in rec)
    one_shot = [c for c in res.candidates if not c.get("recovered") and "skipped" not in c]
    best_one_shot = max((c for c in one_shot if c["passes"]), key=lambda c: c["speedup_vs_best_dense"])
    nearest = sorted(
        (
            c
            for c in one_shot
            if not c["passes"] and c["speedup_vs_best_dense"] > best_one_shot["speedup_vs_best_dense"]
        ),
        key=lambda c: -c["quality_cosine"],
    )[:2]
    assert {(c["label"], c["sparsity"]) for c in rec} == {(c["label"], c["sparsity"]) for c in nearest}
    assert res.chosen.get("recovered") and res.chosen["passes"]
    assert res.chosen["speedup_vs_best_dense"] > best_one_shot["speedup_vs_best_dense"]
    assert "s of recovery" in res.summary() and "s of recovery" in res.table()
    for kw in recovery_adds:
        assert len(kw["exclude"]) == res.n_evaluation and kw["data"] == data_file and not kw["causal"]
    w = load_pruned(str(out)).encoder.layer[0].attention.self.query.weight
    assert w.layout_name == res.chosen["layout"] and abs(w.sparsity - res.chosen["sparsity"]) < 0.02


def test_no_recovery_when_the_fastest_passes(tiny_dir, tmp_path, recovery_adds):
    """Nothing faster than the one-shot winner failed: recovery has nothing to try."""
    res = _search(
        tiny_dir,
        tmp_path / "o",
        0.05,
        method="magnitude",
        patterns=["unstructured"],
        sparsities=(0.5, 0.7),
        recover_seconds=30.0,
    )
    assert recovery_adds == [] and res.chosen["sparsity"] == 0.7 and not res.chosen.get("recovered")


@pytest.mark.parametrize(
    "kw, needle", [(dict(recover_seconds=-1.0), "--recover"), (dict(recover_candidates=0), "recover_candidates")]
)
def test_bad_recovery_arguments(tiny_dir, tmp_path, kw, needle):
    with pytest.raises(ValueError, match=needle):
        search_target_quality(str(tiny_dir), str(tmp_path / "o"), 0.9, log=None, **kw)


# ----------------------------------------------------------------------------- for real (measured)
def test_cli_target_quality_end_to_end(tiny_dir, data_file, tmp_path, capsys):
    out = tmp_path / "real"
    rc, stdout, err = _main(
        [
            "prune",
            str(tiny_dir),
            "-o",
            str(out),
            "--target-quality",
            "0.3",
            "--method",
            "wanda",
            "--data",
            str(data_file),
            "--pattern",
            "unstructured,row_group4",
            "--no-compile",
            "--calib",
            "16",
        ],
        capsys,
    )
    assert rc == 0, err
    assert "chose" in stdout and "speedup" in stdout and "<-" in stdout and "saved" in stdout
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["hidden_size"] == 32
    m = load_pruned(str(out))
    # an unstructured mask is timed in sliced_ell and bitmask, so the fastest of the three layouts is saved
    saved = m.encoder.layer[1].output.dense.weight.layout_name
    assert saved in ("sliced_ell", "bitmask", "row_group") and saved in stdout


def test_search_rejects_causal_lms(tmp_path):
    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(ValueError, match="not supported for causal LMs yet"):
        search_target_quality(str(d), str(tmp_path / "o"), 0.9)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--target-quality", "0"], "--target-quality"),
        (["--target-quality", "1.5"], "--target-quality"),
        (["--target-quality", "x"], "--target-quality"),
        (["--target-quality", "0.9", "--sparsity", "0.5"], "--sparsity cannot be combined with --target-quality"),
        (["--target-quality", "0.9", "--layout", "masked"], "--layout cannot be combined"),
        (["--target-quality", "0.9", "--only-if-faster"], "--only-if-faster cannot be combined"),
        (["--target-quality", "0.9", "--pattern", "nope"], "--pattern"),
        (["--target-quality", "0.9", "--data", "/no/such/file.txt"], "does not exist"),
        (["--no-compile"], "--no-compile only applies with --target-quality"),
        (["--min-speedup", "1"], "--min-speedup only applies with --target-quality"),
        (["--target-quality", "0.9", "--min-speedup", "0"], "--min-speedup 0: give a positive"),
        (["--target-quality", "0.9", "--min-speedup", "-2"], "--min-speedup -2: give a positive"),
        (["--target-quality", "0.9", "--min-speedup", "fast"], "--min-speedup"),
    ],
)
def test_bad_target_quality_arguments(tiny_dir, tmp_path, capsys, args, needle):
    rc, _, err = _main(["prune", str(tiny_dir), "-o", str(tmp_path / "o"), *args], capsys)
    assert rc == 2, err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_cli_causal_lm_is_a_usage_error(tmp_path, capsys):
    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    rc, _, err = _main(["prune", str(d), "-o", str(tmp_path / "o"), "--target-quality", "0.9"], capsys)
    assert rc == 2 and "not supported for causal LMs yet" in err


def test_bad_data_is_one_line(tiny_dir, tmp_path, capsys):
    p = tmp_path / "few.txt"
    p.write_text("one line\ntwo lines\n")
    rc, _, err = _main(
        [
            "prune",
            str(tiny_dir),
            "-o",
            str(tmp_path / "o"),
            "--target-quality",
            "0.9",
            "--data",
            str(p),
            "--no-compile",
        ],
        capsys,
    )
    assert rc == 1 and err.count("\n") == 1 and "at least 8" in err and not (tmp_path / "o").exists()
