"""benchmarks/llm_decode.py's rows: every speed-up counts against the fastest dense path timed beside it, in
any dtype, and the other dtypes' dense references are timed but not reported as rows."""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import llm_decode  # noqa: E402

TINY = (64, 176, 2, 4, 2, 320)  # (hidden, intermediate, layers, heads, kv heads, vocab)
ARGS = ["--models", "tiny", "--batches", "1", "--sparsities", "0.5", "--prompt", "8", "--steps", "2"]
ARGS += ["--rounds", "1", "--no-compile", "--no-breakdown", "--prefill-batches"]


def _fixed_times(ms_by_key, seen):
    """A round_robin_ms that runs each function once (so the engines are real) and returns fixed times."""

    def fake(fns, rounds, min_seconds=0.0):
        seen.append(sorted(fns))
        for fn in fns.values():
            fn()
        return {k: ms_by_key[k] for k in fns}

    return fake


def _run(monkeypatch, tmp_path, times, args, old_rows=None, old_extra=None):
    """``main(ARGS + args)`` on the tiny config with fixed times (ms per round); (its rows, the key lists
    each round robin timed). ``old_rows``: a results file to ``--append`` to (``old_extra``: more of its
    top-level keys)."""
    monkeypatch.setitem(llm_decode.CONFIGS, "tiny", TINY)
    seen = []
    monkeypatch.setattr(llm_decode, "round_robin_ms", _fixed_times(times, seen))
    out = tmp_path / "llm.json"
    if old_rows is not None:
        out.write_text(json.dumps({"rows": old_rows, **(old_extra or {})}))
        args = args + ["--append"]
    llm_decode.main(ARGS + args + ["--out", str(out)])
    return json.loads(out.read_text())["rows"], seen


def test_a_faster_dense_dtype_is_the_baseline(monkeypatch, tmp_path):
    # per 2-step round: dense fp32 10 ms, sparse fp32 5 ms, and the dense bf16 reference 4 ms
    times = {"dense": 10.0, "bitmask@0.5": 5.0, "dense@bfloat16": 4.0}
    rows, seen = _run(monkeypatch, tmp_path, times, ["--dtypes", "float32"])
    assert seen == [["bitmask@0.5", "dense", "dense@bfloat16"]]
    rows = {r["layout"]: r for r in rows}
    assert set(rows) == {"dense", "bitmask"}  # the bf16 reference is no row of a float32 run
    sparse = rows["bitmask"]
    assert sparse["dtype"] == "float32" and sparse["best_dense"] == "bfloat16 eager"
    assert sparse["speedup_vs_dense"] == 2.0
    assert sparse["speedup_vs_best_dense_same_dtype"] == 2.0
    assert sparse["speedup_vs_best_dense"] == 0.8
    assert rows["dense"]["speedup_vs_best_dense"] == 0.4


def test_the_own_dtype_stays_the_baseline_when_it_is_fastest(monkeypatch, tmp_path):
    times = {"dense": 4.0, "bitmask@0.5": 2.0, "dense@float32": 8.0}
    rows, seen = _run(monkeypatch, tmp_path, times, ["--dtypes", "bfloat16"])
    assert seen == [["bitmask@0.5", "dense", "dense@float32"]]
    sparse = next(r for r in rows if r["layout"] == "bitmask")
    assert sparse["best_dense"] == "bfloat16 eager"
    assert sparse["speedup_vs_best_dense"] == sparse["speedup_vs_best_dense_same_dtype"] == 2.0


def test_append_drops_rows_measured_without_the_cross_dtype_reference(monkeypatch, tmp_path):
    times = {"dense": 10.0, "bitmask@0.5": 5.0, "dense@bfloat16": 4.0}
    old_row = {"model": "other", "dtype": "float32", "batch": 1, "phase": "decode", "layout": "dense"}
    old_row.update(sparsity=None, speedup_vs_best_dense=1.0)
    old = [old_row, dict(old_row, model="kept", best_dense="float32 eager")]
    rows, _ = _run(monkeypatch, tmp_path, times, ["--dtypes", "float32"], old_rows=old)
    assert sorted({r["model"] for r in rows}) == ["kept", "tiny"]


def test_append_keeps_the_record_of_reruns(monkeypatch, tmp_path):
    times = {"dense": 10.0, "bitmask@0.5": 5.0, "dense@bfloat16": 4.0}
    reruns = [{"rows": "x", "why": "y", "command": "z"}]
    _run(monkeypatch, tmp_path, times, ["--dtypes", "float32"], old_rows=[], old_extra={"reruns": reruns})
    assert json.loads((tmp_path / "llm.json").read_text())["reruns"] == reruns


@pytest.mark.parametrize(
    "key, label",
    [
        ("dense", "float32 eager"),
        ("dense_compiled", "float32 compiled"),
        ("dense@bfloat16", "bfloat16 eager"),
        ("dense@bfloat16+compiled", "bfloat16 compiled"),
    ],
)
def test_dense_labels(key, label):
    assert llm_decode.dense_label(key, "float32") == label


def test_prefill_computes_the_next_tokens_logits_only(monkeypatch):
    # as generate() runs a prompt: lm_head on the last position, not on every prompt token
    monkeypatch.setitem(llm_decode.CONFIGS, "tiny", TINY)
    model = llm_decode.build_model("tiny", llm_decode.torch.float32)
    seen = []
    model.register_forward_hook(lambda mod, args, kwargs, out: seen.append(out.logits.shape), with_kwargs=True)
    llm_decode.prefill_fn(model, batch=2, prompt=8)()
    assert seen == [(2, 1, TINY[5])]


def test_phases_selects_what_is_timed(monkeypatch, tmp_path):
    times = {"dense": 10.0, "bitmask@0.5": 5.0, "dense@bfloat16": 40.0}
    rows, seen = _run(
        monkeypatch, tmp_path, times, ["--dtypes", "float32", "--phases", "prefill", "--prefill-batches", "1"]
    )
    assert len(seen) == 1
    assert {r["phase"] for r in rows} == {"prefill"}
    assert all(r["best_dense"] == "float32 eager" for r in rows)


def test_compiled_engines_decode_on_a_static_cache(monkeypatch, tmp_path):
    # --compile times the dense step and (by default) every sparse model compiled the same way, beside eager
    import torch

    monkeypatch.setitem(llm_decode.CONFIGS, "tiny", TINY)
    seen, caches = [], []
    real = llm_decode.static_cache
    monkeypatch.setattr(llm_decode, "static_cache", lambda m, n: caches.append(n) or real(m, n))
    times = {"dense": 10.0, "bitmask@0.5": 5.0, "dense@bfloat16": 8.0}
    times.update({"dense_compiled": 9.0, "bitmask@0.5+compiled": 4.0, "dense@bfloat16+compiled": 7.0})
    monkeypatch.setattr(llm_decode, "round_robin_ms", _fixed_times(times, seen))
    args = [a for a in ARGS if a != "--no-compile"] + ["--dtypes", "float32", "--out", str(tmp_path / "c.json")]
    try:
        llm_decode.main(args)
    finally:
        torch._dynamo.reset()
    assert seen == [sorted(times)]
    assert caches == [8 + 2] * 3  # prompt + steps positions, one static cache per compiled engine
    rows = {r["layout"]: r for r in json.loads((tmp_path / "c.json").read_text())["rows"]}
    assert rows["bitmask+compiled"]["speedup_vs_best_dense_same_dtype"] == 2.25
    assert rows["bitmask"]["speedup_vs_best_dense_same_dtype"] == 1.8
    notes = json.loads((tmp_path / "c.json").read_text())["notes"]
    assert not [k for k in notes if not k.endswith("_s")], notes  # no compile failed
