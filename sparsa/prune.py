"""Prune a Hugging Face model directory (or a directory written by this function) offline.

The output directory holds the model's ``config.json`` (and tokenizer files, if any) and
``model.sparsa.safetensors`` — the compressed sparse weights — so it can be re-loaded with
:func:`load_pruned` or pruned again.

Example::

    >>> from sparsa.prune import prune_model_dir        # doctest: +SKIP
    >>> rows = prune_model_dir("path/to/hf_model", "out/", method="wanda", sparsity=0.5,
    ...                        pattern="unstructured")  # doctest: +SKIP
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

__all__ = ["prune_model_dir", "load_pruned", "CHECKPOINT", "METHODS", "PATTERNS_HELP"]

CHECKPOINT = "model.sparsa.safetensors"
METHODS = ("magnitude", "wanda", "sparsegpt")
PATTERNS_HELP = "'unstructured', 'N:M' (e.g. 2:4), or 'row_group<G>' (e.g. row_group16, the fast CPU layout)"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json",
                    "merges.txt", "vocab.json", "sentencepiece.bpe.model", "spiece.model")


def _offline() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def load_pruned(path: str) -> nn.Module:
    """A model from a Hugging Face directory; if it holds a sparsa checkpoint, its weights are the
    sparse ones (in their saved layouts)."""
    _offline()
    from transformers import AutoConfig, AutoModel

    from .io import load
    p = Path(path)
    if not p.is_dir() or not (p / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a model directory (expected a config.json inside)")
    if (p / CHECKPOINT).is_file():
        model = AutoModel.from_config(AutoConfig.from_pretrained(str(p), local_files_only=True))
        load(model, str(p / CHECKPOINT))
    else:
        model = AutoModel.from_pretrained(str(p), local_files_only=True)
    return model.float().eval()


def _calibration(path: Path, n: int) -> Optional[Tuple[Any, List[Dict[str, torch.Tensor]]]]:
    from transformers import AutoTokenizer

    from .data.text import calibration_and_evaluation
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    calib, _ = calibration_and_evaluation(n, 1)
    batches = [dict(tok(calib[i:i + 16], padding=True, truncation=True, max_length=128, return_tensors="pt"))
               for i in range(0, len(calib), 16)]
    return tok, batches


def prune_model_dir(src: str, out: str, *, method: str = "magnitude", sparsity: float = 0.5,
                    pattern: str = "unstructured", layout: Optional[str] = None, calib: int = 64,
                    progress: bool = True, only_if_faster: Union[bool, int] = False) -> List[Dict[str, Any]]:
    """Prune every Linear of the transformer blocks of the model in ``src`` and write ``out``.

    ``only_if_faster`` (``True`` or a token count, as in :func:`sparsa.sparsify_linears`): a pruned
    layer whose sparse layout is not measured faster than dense on this machine is saved as a dense
    weight (same values). Returns the per-layer report rows (see :func:`sparsa.sparsity_report`; the
    pruned weights' rows also carry ``path`` and ``ratio_vs_dense``).
    """
    from . import Rule, save, sparsify, sparsity_report
    from .layouts.base import check_fraction, get_layout
    from .methods import sparsegpt, wanda
    from .methods.pattern import named_pattern
    from .nn.linears import _tokens, annotate_paths, dense_where_slower

    if method not in METHODS:
        raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")
    check_fraction(sparsity, "--sparsity")
    tokens = _tokens(only_if_faster, "only_if_faster")
    sparsifier, default_layout = named_pattern(pattern, sparsity)
    layout = layout or default_layout
    get_layout(layout)  # clear error for an unknown layout name
    model = load_pruned(src)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layer." in n]
    if not names:
        names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not names:
        raise ValueError(f"{src}: the model has no nn.Linear layers to prune")
    srcp = Path(src)
    if method == "magnitude":
        sparsify(model, [Rule(sparsifier=sparsifier, layout=layout, names=names)])
    else:
        cal = _calibration(srcp, calib)
        if cal is None:
            raise ValueError(f"--method {method} needs calibration text, but {src} has no tokenizer files; "
                             "use --method magnitude")
        _, batches = cal
        if method == "wanda":
            wanda(model, batches, sparsifier, layout=layout, names=names, forward=lambda m, b: m(**b))
        else:
            sparsegpt(model, batches, sparsifier, layout=layout, names=names, forward=lambda m, b: m(**b),
                      progress=progress)
    if tokens:
        chosen = dense_where_slower(model, tokens, names=names)
    else:
        chosen = {f"{n}.weight": {"path": "sparse", "ratio_vs_dense": None} for n in names}
    outp = Path(out)
    outp.mkdir(parents=True, exist_ok=True)
    shutil.copy2(srcp / "config.json", outp / "config.json")
    for f in _TOKENIZER_FILES:
        if (srcp / f).is_file() and srcp.resolve() != outp.resolve():
            shutil.copy2(srcp / f, outp / f)
    save(model, str(outp / CHECKPOINT))
    return annotate_paths(sparsity_report(model), chosen)
