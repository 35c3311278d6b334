"""The flagship demo's adaptive-training part runs end to end (quick sizes) and reports its figures."""

import math

import torch

from examples.flagship import DemoConfig, run_demo


def test_adaptive_part_of_the_demo_runs(capsys):
    old = torch.get_num_threads()
    try:
        out = run_demo(DemoConfig(quick=True, skip=("minilm", "bert"), train_steps=2, progress=False))
    finally:
        torch.set_num_threads(old)
    res = out["adaptive"]
    assert math.isfinite(res["step_speedup"]) and res["step_speedup"] > 0
    assert 0 <= res["sparse_layers"] <= 16
    text = capsys.readouterr().out
    assert "training-step speed-up vs dense" in text and "sklearn digits" in text
