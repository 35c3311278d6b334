"""Compiled decoding of a causal LM on the CPU: a static KV cache and one ``torch.compile`` graph per step.

A decode step of a ``transformers`` causal LM spends a large part of its time outside the linears
(attention on the cache, norms, rotary embeddings, Python between small ops), and a sparse model's
linears are the part sparsity shrinks, so that rest bounds its speed-up. ``torch.compile`` removes most
of it, but only with a cache of fixed shape: a ``DynamicCache`` grows every token, so a compiled step
is either recompiled or a dynamic-shape graph that keeps much of the cost. A ``StaticCache`` holds
``max_cache_len`` positions from the start, so every decode step has the same shapes and one graph
serves them all (the prefill runs eagerly: its shape changes with the prompt).

``transformers`` does exactly that in ``generate()`` (``cache_implementation="static"``), but compiles
only on accelerators unless the compile config says otherwise; :func:`compiled_generate_kwargs` says so::

    >>> import torch, sparsa
    >>> from sparsa.models.causal_lm import tiny_llama
    >>> from sparsa.models.compiled_decode import compiled_generate_kwargs
    >>> model = tiny_llama(layers=1, hidden=32)
    >>> ids = torch.tensor([[5, 6, 7]])
    >>> out = model.generate(ids, max_new_tokens=2, do_sample=False, **compiled_generate_kwargs())
    >>> out.shape
    torch.Size([1, 5])

Sparse weights whose layouts have custom ops (bitmask, row_group, ...) compile into the graph with no
break (``fullgraph=True``: a break raises instead of silently running eager code).
"""

from __future__ import annotations

from typing import Any, Callable, Dict

import torch
from torch import nn

__all__ = ["compile_config", "compiled_generate_kwargs", "static_cache", "compile_decode_step"]


def compile_config(fullgraph: bool = True) -> Any:
    """A ``transformers.CompileConfig`` for the decode step on any device: ``mode="default"`` (the
    accelerators' ``"reduce-overhead"`` records CUDA graphs), static shapes, and the flag that lets
    ``generate()`` compile on the CPU."""
    from transformers import CompileConfig

    cfg = CompileConfig(fullgraph=fullgraph, dynamic=False, mode="default")
    cfg._compile_all_devices = True  # generate() compiles only on accelerators without it
    return cfg


def compiled_generate_kwargs(fullgraph: bool = True) -> Dict[str, Any]:
    """The keyword arguments that make ``model.generate(...)`` decode with a static cache and a compiled
    step (the first call compiles it: seconds to a minute; later calls with the same batch and length
    reuse it)."""
    return {"cache_implementation": "static", "compile_config": compile_config(fullgraph)}


def static_cache(model: nn.Module, max_cache_len: int) -> Any:
    """A ``transformers.StaticCache`` of ``max_cache_len`` positions for ``model`` (its buffers are made
    on the first forward, in the model's dtype and batch). ``max_cache_len`` must hold the prompt and
    every token decoded after it."""
    from transformers import StaticCache

    if not isinstance(max_cache_len, int) or isinstance(max_cache_len, bool) or max_cache_len < 1:
        raise ValueError(f"static_cache: max_cache_len must be a positive int, got {max_cache_len!r}")
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"static_cache: model must be a transformers model with a .config, got {type(model).__name__}")
    return StaticCache(config=config, max_cache_len=max_cache_len)


def compile_decode_step(model: nn.Module, fullgraph: bool = True) -> Callable[..., Any]:
    """``torch.compile`` of ``model.forward`` for decode steps on a :func:`static_cache` (static shapes;
    ``fullgraph`` raises on a graph break rather than running part of the step eagerly). Compiling
    happens on the first call."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"compile_decode_step: model must be an nn.Module, got {type(model).__name__}")
    return torch.compile(model.forward, fullgraph=fullgraph, dynamic=False)
