"""benchmarks/llm_quality.py --append: a run of some rows merges into the committed results without
losing the others, and the recovered patterns of both runs are listed. No model is loaded."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import llm_quality  # noqa: E402


def _row(method, pattern, domain, ratio):
    return {"method": method, "pattern": pattern, "domain": domain, "ppl_ratio_vs_dense": ratio}


def _res(rows, recovered, seconds=1200.0, autocast=None):
    return {
        "seq_len": 256,
        "calibration": "mixed",
        "quick": False,
        "patterns": sorted({r["pattern"] for r in rows if r["pattern"] in llm_quality.PATTERNS}),
        "recovery": {"seconds": seconds, "patterns": recovered, "autocast": autocast},
        "rows": rows,
    }


def test_append_keeps_other_rows_and_lists_both_recovered_patterns(tmp_path):
    out = tmp_path / "llm_quality.json"
    old = [
        _row("dense", "dense", "prose", 1.0),
        _row("sparsegpt", "unstructured", "prose", 1.3),
        _row("sparsegpt+recover", "unstructured", "prose", 1.07),
        _row("wanda", "2:4", "prose", 4.1),
        _row("sparsegpt", "2:4", "prose", 2.0),
    ]
    out.write_text(json.dumps(_res(old, ["unstructured"])))
    new = [
        _row("dense", "dense", "prose", 1.0),
        _row("sparsegpt", "2:4", "prose", 1.9),
        _row("sparsegpt+recover", "2:4", "prose", 1.2),
    ]
    res = _res(new, ["2:4"])
    llm_quality._merge(out, res)
    got = {(r["method"], r["pattern"]): r["ppl_ratio_vs_dense"] for r in res["rows"]}
    assert got[("sparsegpt", "2:4")] == 1.9, "the new run's rows replace the old ones"
    assert got[("wanda", "2:4")] == 4.1 and got[("sparsegpt+recover", "unstructured")] == 1.07
    assert got[("sparsegpt+recover", "2:4")] == 1.2
    assert len(res["rows"]) == 6 and res["rows"][0]["method"] == "dense"
    assert res["recovery"]["patterns"] == ["unstructured", "2:4"]


def test_append_refuses_other_settings_and_another_recovery_budget(tmp_path):
    out = tmp_path / "llm_quality.json"
    out.write_text(json.dumps(_res([_row("dense", "dense", "prose", 1.0)], ["unstructured"])))
    with pytest.raises(SystemExit, match="budget of 1200.0 s"):
        llm_quality._merge(out, _res([_row("dense", "dense", "prose", 1.0)], ["2:4"], seconds=600.0))
    bad = _res([], [])
    bad["seq_len"] = 128
    with pytest.raises(SystemExit, match="another seq_len"):
        llm_quality._merge(out, bad)
    res = _res([_row("dense", "dense", "prose", 1.0)], [], seconds=0.0)  # no recovery in this run
    llm_quality._merge(out, res)
    assert res["recovery"] == {"seconds": 1200.0, "patterns": ["unstructured"], "autocast": None, "code_ratio": 1}


def test_append_refuses_another_recovery_autocast(tmp_path):
    out = tmp_path / "llm_quality.json"
    out.write_text(json.dumps(_res([_row("dense", "dense", "prose", 1.0)], ["unstructured"])))
    with pytest.raises(SystemExit, match="autocast None, this run with bfloat16"):
        llm_quality._merge(out, _res([_row("dense", "dense", "prose", 1.0)], ["2:4"], autocast="bfloat16"))


@pytest.mark.parametrize(
    "flags,want", [({"avx512_bf16": True}, "bfloat16"), ({"amx_bf16": True}, "bfloat16"), ({}, None)]
)
def test_recovery_autocast_auto_follows_the_bf16_hardware(monkeypatch, flags, want):
    import torch

    monkeypatch.setattr(llm_quality.sparsa.cpu, "cpu_flags", lambda: flags)
    got = llm_quality.recover_autocast("auto")
    assert (None if got is None else str(got).replace("torch.", "")) == want
    assert llm_quality.recover_autocast("none") is None and llm_quality.recover_autocast("bfloat16") is torch.bfloat16


def test_append_refuses_another_recovery_code_ratio(tmp_path):
    out = tmp_path / "q.json"
    out.write_text(json.dumps(_res([_row("sparsegpt+recover", "unstructured", "code", 1.2)], ["unstructured"])))
    new = _res([_row("sparsegpt+recover", "unstructured", "prose", 1.1)], ["unstructured"])
    new["recovery"]["code_ratio"] = 2
    with pytest.raises(SystemExit, match="code windows per prose window"):
        llm_quality._merge(out, new)
    new["recovery"]["code_ratio"] = 1  # a file from before the option recovered with one
    llm_quality._merge(out, new)


class _Chars:
    """A tokenizer of one token per character (what text_windows calls)."""

    def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
        import torch

        class _Out:
            input_ids = torch.tensor([[ord(c) % 5000 for c in text]])

        return _Out()


@pytest.mark.parametrize("ratio", [1, 3])
def test_recovery_windows_follow_each_prose_window_with_ratio_code_windows(ratio):
    prose = ["P" * 63] * 40  # one window of 64 characters per sentence and its separator
    held = llm_quality.code_files(max_chars=20000)
    w = llm_quality.recovery_windows(_Chars(), prose, 64, ratio, held)
    groups = w.view(-1, ratio + 1, 64)
    assert groups.shape[0] == 40  # the calibration modules' source alone holds more than 40 windows
    is_prose = (groups == ord("P")).float().mean(-1) > 0.9
    assert is_prose[:, 0].all() and not is_prose[:, 1:].any()
    code = {bytes(r.tolist()) for r in groups[:, 1:].reshape(-1, 64) if r.max() < 256}
    held_text = "".join(f.read_text(encoding="utf-8", errors="replace") for f in held)
    assert not any(c.decode("latin-1") in held_text for c in code)  # nothing from the held-out code
    with pytest.raises(ValueError, match="code_ratio"):
        llm_quality.recovery_windows(_Chars(), prose, 64, 0, held)


def test_wide_recovery_prose_adds_text_of_neither_held_out_domain():
    from sparsa.data.text import calibration_and_evaluation, stdlib_sentences

    pool = stdlib_sentences()
    calib, held_prose = calibration_and_evaluation(len(pool) - llm_quality.HELD_OUT_SENTENCES, 50)
    assert llm_quality.recovery_prose(calib, "calibration") == list(calib)
    held = llm_quality.code_files(20000)
    wide = llm_quality.recovery_prose(calib, "wide", held)
    assert wide[: len(calib)] == list(calib) and len(wide) > 2 * len(calib)
    assert not set(wide) & set(held_prose)
    held_code = "".join(f.read_text(encoding="utf-8", errors="replace") for f in held)
    assert not any(s in held_code for s in wide[len(calib) :])  # not a sentence of the held-out code
    # without the held-out files, a sentence that the held-out code also holds comes through
    assert any(s in held_code for s in llm_quality.recovery_prose(calib, "wide")[len(calib) :])
    with pytest.raises(ValueError, match="kind must be one of"):
        llm_quality.recovery_prose(calib, "all")
