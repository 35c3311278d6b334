"""benchmarks/llm_decode.py's decode breakdown: block linears, lm_head and the rest add up to the step."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import llm_decode  # noqa: E402


@pytest.mark.parametrize("spec", [None, "0.5"])
def test_the_parts_add_up_and_the_hooks_go(spec, monkeypatch):
    # (hidden, intermediate, layers, heads, kv heads, vocab), built as the benchmark builds its models
    monkeypatch.setitem(llm_decode.CONFIGS, "tiny", (64, 176, 2, 4, 2, 320))
    model = llm_decode.build_model("tiny", torch.float32)
    if spec:
        model = llm_decode.prune_copy(model, spec)
    b = llm_decode.decode_breakdown(model, batch=1, prompt=8, steps=3)
    assert set(b) == {"block_linears", "lm_head", "rest", "token"}
    assert b["block_linears"] > 0 and b["lm_head"] > 0 and b["rest"] > 0
    assert b["block_linears"] + b["lm_head"] + b["rest"] == pytest.approx(b["token"], abs=0.02)
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
