"""One setting for benchmarks that ``torch.compile`` many models: none of them may silently run eagerly.

Dynamo keeps at most ``recompile_limit`` (8) compiled entries per code object, and every BERT or Llama
model of a sweep shares one ``forward``; past the limit it runs each new model *eagerly* and only logs
a warning, so a "compiled" row would time eager code. :func:`compile_many_models` raises the limit and
makes reaching it an error instead.
"""

from __future__ import annotations

#: compiled entries allowed per code object: a full sweep compiles a few dozen models at most
RECOMPILE_LIMIT = 64


def compile_many_models(limit: int = RECOMPILE_LIMIT) -> None:
    """Let one process compile up to ``limit`` models sharing a forward, and fail rather than fall back."""
    import torch._dynamo

    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, limit)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * limit)
    cfg.fail_on_recompile_limit_hit = True
