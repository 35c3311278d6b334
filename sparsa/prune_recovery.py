"""``sparsa prune --recover SECONDS``: after one-shot pruning, distil the pruned model towards the
dense one with :func:`sparsa.recover`, keeping its pattern.

What is matched depends on the model:

- encoders (BERT-like): the mean-pooled sentence embedding and every layer's hidden states at the
  real tokens (as ``benchmarks/recover.py`` does), batches of 16 texts;
- causal LMs: the next-token distributions (:func:`~sparsa.methods.logit_distillation_loss`),
  batches of 4 texts.

Above :data:`GRADUAL_START` sparsity and given at least :data:`GRADUAL_MIN_SECONDS`, the one-shot
start prunes only to :data:`GRADUAL_START` and recovery prunes gradually on to the target while it
distils (:func:`recovery_start`): at the same budget that kept more than starting at the target.
``sparsa prune`` does so for encoders, where it was measured (MiniLM); causal LMs start at the target.
The gradual phase ranks weights as :data:`GRADUAL_PRUNE_BY` says for the pattern.

The text is the user's ``--data`` (every line) or, by default, the built-in offline sentences: the
standard library's docstrings (:func:`~sparsa.data.text.stdlib_sentences` and
:func:`~sparsa.data.text.extra_stdlib_sentences`) and the prose of the Python language reference and
IDLE's notes (:func:`~sparsa.data.text.python_docs_sentences`, which lifted MiniLM's cosine on README
prose, a domain never distilled on; ``benchmarks/recover.py --n-prose``). The input embeddings (and a head tied to them)
stay frozen. The learning rates are the ones the benchmarks measured (:data:`RECOVER_LR`).
"""

from __future__ import annotations

import os
import random
import sys
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from .methods.distill import distillation_loss, logit_distillation_loss
from .methods.recover import RecoverReport, _fixed_sparsity, pattern_sparsifier, recover

__all__ = [
    "RECOVER_LR",
    "GRADUAL_START",
    "GRADUAL_MIN_SECONDS",
    "GRADUAL_PRUNE_BY",
    "recovery_start",
    "recover_pruned",
    "distillation_texts",
    "encoder_outputs",
]

#: AdamW learning rate per model kind: encoders (MiniLM, ``benchmarks/recover.py``) and causal LMs
#: (SmolLM2-135M, ``benchmarks/llm_quality.py``)
RECOVER_LR = {"encoder": 1e-3, "causal_lm": 1e-4}
_BATCH = {"encoder": 16, "causal_lm": 4}
#: the sparsity a gradual recovery's one-shot start prunes to (``benchmarks/recover.py --init-sparsity``)
GRADUAL_START = 0.5
#: the shortest recovery budget (seconds) at which the gradual start was measured to pay (it did at 600
#: and 1200 s; at 300 s it was a draw); shorter recoveries start at the target, which leaves them all
#: their time to distil
GRADUAL_MIN_SECONDS = 600.0
#: what the gradual phase ranks weights by (``recover(prune_by=...)``), per pattern: Wanda's |W|·||X||
#: where it was measured to keep more than magnitude (MiniLM, unstructured and row groups of 4, 8 and 16),
#: else magnitude
GRADUAL_PRUNE_BY = {"unstructured": "wanda", "row_group4": "wanda", "row_group8": "wanda", "row_group16": "wanda"}
_MAX_TOKENS = 128


def distillation_texts(data: Optional[Union[str, os.PathLike]]) -> List[str]:
    """Every line of ``data`` (a text file or a directory of ``*.txt``), or the built-in sentences."""
    from .data.text import extra_stdlib_sentences, python_docs_sentences, read_user_texts, stdlib_sentences

    if data is not None:
        return read_user_texts(data, sys.maxsize)
    return stdlib_sentences() + extra_stdlib_sentences() + python_docs_sentences()


def recovery_start(pattern: str, sparsity: float, seconds: float) -> float:
    """The sparsity to prune to one-shot before a recovery of ``seconds`` towards ``sparsity`` in
    ``pattern``: :data:`GRADUAL_START` for a pattern whose sparsity is free (unstructured, row groups)
    when ``sparsity`` is above it and ``seconds >= GRADUAL_MIN_SECONDS``; else ``sparsity`` itself
    (N:M patterns have one fixed sparsity).

    >>> [recovery_start(p, s, 1200) for p, s in [("unstructured", 0.9), ("row_group16", 0.4), ("2:4", 0.5)]]
    [0.5, 0.4, 0.5]
    >>> recovery_start("unstructured", 0.9, 60)
    0.9
    """
    sp, _ = pattern_sparsifier(pattern, sparsity)
    if _fixed_sparsity(sp) is not None or seconds < GRADUAL_MIN_SECONDS:
        return sparsity
    return min(sparsity, GRADUAL_START)


def _batches(tok: Any, texts: Sequence[str], size: int, causal: bool) -> List[Dict[str, Tensor]]:
    """Batches of ``size`` texts of similar length (little padding), in a fixed shuffled order."""
    by_len = sorted(texts, key=len)
    out = []
    for i in range(0, len(by_len), size):
        b = dict(tok(by_len[i : i + size], padding=True, truncation=True, max_length=_MAX_TOKENS, return_tensors="pt"))
        out.append({k: v for k, v in b.items() if k in ("input_ids", "attention_mask")} if causal else b)
    random.Random(0).shuffle(out)
    return out


def encoder_outputs(model: nn.Module, batch: Dict[str, Tensor]) -> List[Tensor]:
    """What an encoder's recovery matches: the mean-pooled sentence embedding, then every layer's
    hidden states at the real (unpadded) tokens. A ``forward`` for :func:`sparsa.recover`."""
    from .models.minilm import mean_pool

    o = model(**batch, output_hidden_states=True)
    keep = batch["attention_mask"].bool()
    return [mean_pool(o.last_hidden_state, batch["attention_mask"])] + [h[keep] for h in o.hidden_states[1:]]


def _logits(m: nn.Module, b: Dict[str, Tensor]) -> Tensor:
    # padded positions carry no next-token target: only the real ones are compared
    return m(**b, use_cache=False).logits[b["attention_mask"].bool()]


def recover_pruned(
    model: nn.Module,
    teacher: nn.Module,
    tok: Any,
    *,
    causal: bool,
    names: Sequence[str],
    pattern: str,
    sparsity: float,
    layout: str,
    seconds: float,
    data: Optional[Union[str, os.PathLike]] = None,
    exclude: Sequence[str] = (),
    progress: bool = True,
    autocast: Optional[torch.dtype] = None,
) -> RecoverReport:
    """Distil ``model`` (pruned in place to ``pattern``, stored in ``layout``) towards ``teacher`` (the
    dense model) for ``seconds``; the weights end in ``layout`` at ``sparsity`` in ``pattern``. A model
    pruned below ``sparsity`` (to :func:`recovery_start`) is pruned gradually on to it while it distils.
    ``exclude``: texts never distilled on (the held-out evaluation text of a search). ``autocast``: the
    student's forward under ``torch.autocast`` of that dtype (:func:`sparsa.recover`)."""
    kind = "causal_lm" if causal else "encoder"
    held = set(exclude)
    texts = [t for t in distillation_texts(data) if t not in held]
    if not texts:
        raise ValueError("--data: no text is left to distil on once the held-out evaluation text is set aside")
    batches = _batches(tok, texts, _BATCH[kind], causal)
    sp, _ = pattern_sparsifier(pattern, sparsity, layout)
    fixed = _fixed_sparsity(sp)  # an N:M pattern's own sparsity (the nearest grouped N:M, say)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None:
        emb.requires_grad_(False)
    return recover(
        model,
        teacher,
        batches,
        target_sparsity=sparsity if fixed is None else fixed,
        pattern=pattern,
        layout=layout,
        time_budget=seconds,
        names=list(names),
        forward=_logits if causal else encoder_outputs,
        loss=logit_distillation_loss if causal else distillation_loss,
        lr=RECOVER_LR[kind],
        prune_by=GRADUAL_PRUNE_BY.get(pattern, "magnitude"),
        progress=progress,
        autocast=autocast,
    )
