"""Benchmarks that compile many models: past Dynamo's per-code limit they fail instead of timing eager code."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _compile  # noqa: E402

_KEYS = ("recompile_limit", "accumulated_recompile_limit", "fail_on_recompile_limit_hit")


@pytest.fixture
def dynamo_config():
    cfg = torch._dynamo.config
    saved = {k: getattr(cfg, k) for k in _KEYS}
    torch._dynamo.reset()
    yield cfg
    for k, v in saved.items():
        setattr(cfg, k, v)
    torch._dynamo.reset()


def _models(n):
    torch.manual_seed(0)
    return [nn.Linear(4 + i, 3) for i in range(n)]  # one forward code object, a new entry per shape


def test_many_models_compile_under_the_raised_limit(dynamo_config):
    _compile.compile_many_models(limit=12)
    assert dynamo_config.recompile_limit >= 12 and dynamo_config.fail_on_recompile_limit_hit
    for m in _models(10):  # past the default limit of 8
        out = torch.compile(m, dynamic=False)(torch.randn(2, m.in_features))
        assert out.shape == (2, 3)


def test_reaching_the_limit_is_an_error_not_an_eager_run(dynamo_config):
    _compile.compile_many_models(limit=0)  # keeps the default limit, raises on reaching it
    dynamo_config.recompile_limit = 2
    with pytest.raises(Exception, match="(?i)recompile|limit"):
        for m in _models(4):
            torch.compile(m, dynamic=False)(torch.randn(2, m.in_features))
