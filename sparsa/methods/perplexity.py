"""Perplexity of a causal language model on held-out text: how much pruning hurt it.

The texts are joined (``"\\n\\n"`` between them), tokenized once and cut into non-overlapping
windows of ``seq_len`` tokens (the tail that does not fill a window is dropped); each window is
scored on its own, every token after the first predicted from the ones before it in the window.
Perplexity is ``exp`` of the mean negative log-likelihood over all predicted tokens.

>>> import torch
>>> from sparsa.models.causal_lm import tiny_llama
>>> windows = torch.randint(0, 256, (3, 16))
>>> ppl = window_perplexity(tiny_llama(vocab=256), windows)
>>> 100 < ppl < 1000      # a random model: about the vocabulary size
True
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["text_windows", "window_perplexity", "perplexity"]


def text_windows(tokenizer: Any, texts: Sequence[str], seq_len: int, max_windows: Optional[int] = None) -> Tensor:
    """``(n, seq_len)`` int64 token windows of ``texts`` (at most ``max_windows``)."""
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len must be an int >= 2 (tokens per window), got {seq_len!r}")
    if isinstance(texts, str):
        raise TypeError("texts must be a sequence of strings, not one string: wrap it in a list")
    ids = tokenizer("\n\n".join(texts), add_special_tokens=False, return_tensors="pt").input_ids[0]
    n = ids.numel() // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise ValueError(
            f"texts: {ids.numel()} tokens, fewer than one window of seq_len={seq_len}; "
            "pass more text or a smaller seq_len"
        )
    return ids[: n * seq_len].view(n, seq_len).long()


@torch.no_grad()
def window_perplexity(model: nn.Module, windows: Tensor, batch_size: int = 4) -> float:
    """Perplexity of ``model`` (called as ``model(input_ids)``, returning ``.logits`` or logits) on
    ``windows`` (n, seq_len): ``exp`` of the mean next-token negative log-likelihood."""
    if windows.dim() != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be (n, seq_len) token ids with seq_len >= 2, got {tuple(windows.shape)}")
    nll, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        ids = windows[i : i + batch_size]
        out = model(ids)
        logits = getattr(out, "logits", out)[:, :-1].float()
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum").item()
        count += ids[:, 1:].numel()
    return math.exp(nll / count)


def perplexity(
    model: nn.Module,
    tokenizer: Any,
    texts: Sequence[str],
    seq_len: int = 256,
    max_windows: Optional[int] = None,
    batch_size: int = 4,
) -> float:
    """Token-level perplexity of a causal LM on ``texts`` (see the module doc for the windows)."""
    return window_perplexity(model, text_windows(tokenizer, texts, seq_len, max_windows), batch_size)
