"""Prune a Hugging Face model directory (or a directory written by this function) offline.

The output directory holds the model's ``config.json`` (plus ``generation_config.json`` and the
tokenizer files, if any) and ``model.sparsa.safetensors`` — the compressed sparse weights — so it
can be re-loaded with :func:`load_pruned` or pruned again. Encoders (BERT-like) load as the base
model; causal LMs (``architectures`` ending in ``ForCausalLM``, e.g. Llama, Mistral, Qwen2) keep
their LM head, so ``load_pruned(out).generate(...)`` works.

Only the ``nn.Linear`` layers inside the model's repeated blocks are pruned (never the LM head or
the embeddings). The output is written to a temporary sibling directory and moved into place at
the end, so an interrupted or failed run leaves no partial output.

Example::

    >>> from sparsa.prune import prune_model_dir        # doctest: +SKIP
    >>> rows = prune_model_dir("path/to/hf_model", "out/", method="wanda", sparsity=0.5,
    ...                        pattern="unstructured")  # doctest: +SKIP

:func:`search_target_quality` instead searches patterns, layouts and sparsities for the fastest
configuration whose held-out embedding cosine to the dense model reaches a target (encoders only)::

    >>> from sparsa.prune import search_target_quality                # doctest: +SKIP
    >>> res = search_target_quality("path/to/minilm", "out/", 0.9, method="sparsegpt",
    ...                             data="my_texts.txt")                 # doctest: +SKIP
    >>> print(res.table()); res.chosen["label"], res.chosen["sparsity"]  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import signal
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from . import frontier
from .nn.blocks import prunable_linears
from .sparsifiers.pattern_names import PATTERN_SPELLINGS

__all__ = [
    "prune_model_dir",
    "load_pruned",
    "is_causal_lm",
    "prunable_linears",
    "check_pattern_layout",
    "default_layout",
    "CHECKPOINT",
    "METHODS",
    "PATTERNS_HELP",
    "search_target_quality",
    "split_texts",
    "TargetQualityResult",
    "TargetNotReached",
    "SEARCH_SPARSITIES",
]

CHECKPOINT = "model.sparsa.safetensors"
METHODS = ("magnitude", "wanda", "sparsegpt")
PATTERNS_HELP = ", ".join(PATTERN_SPELLINGS)
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
    "merges.txt",
    "vocab.json",
    "sentencepiece.bpe.model",
    "spiece.model",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
)
_EXTRA_FILES = ("generation_config.json",)
_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")  # LMHeadModel: GPT-2 style names


def is_causal_lm(path: Union[str, os.PathLike]) -> bool:
    """Whether the model directory ``path`` holds a causal (decoder) LM: its ``config.json`` names an
    architecture ending in ``ForCausalLM`` (or GPT-2's ``LMHeadModel``)."""
    try:
        with open(Path(path) / "config.json", encoding="utf-8") as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{Path(path) / 'config.json'} is not valid JSON: {e}") from None
    archs = cfg.get("architectures") if isinstance(cfg, dict) else None
    return any(isinstance(a, str) and a.endswith(_CAUSAL_SUFFIXES) for a in archs or ())


def load_pruned(path: str) -> nn.Module:
    """A model from a Hugging Face directory; if it holds a sparsa checkpoint, its weights are the
    sparse ones (in their saved layouts). A causal LM comes back as its ``...ForCausalLM`` class
    (with the LM head, ready for ``generate``); any other model as its base model (``AutoModel``).
    Offline: every file is read from ``path`` (``local_files_only``); the environment is left alone."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from .io import load

    p = Path(path)
    if not p.is_dir() or not (p / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a model directory (expected a config.json inside)")
    auto = AutoModelForCausalLM if is_causal_lm(p) else AutoModel
    if (p / CHECKPOINT).is_file():
        model = auto.from_config(AutoConfig.from_pretrained(str(p), local_files_only=True))
        load(model, str(p / CHECKPOINT))
        if hasattr(model, "tie_weights"):  # the checkpoint holds a tied head as a copy; tie it again
            model.tie_weights()
    else:
        model = auto.from_pretrained(str(p), local_files_only=True)
    return model.float().eval()


def _pattern_sparsifier(
    pattern: str, sparsity: float, layout: Optional[str] = None, arg: str = "--pattern"
) -> Tuple[Any, str]:
    """``(sparsifier, natural layout)`` of ``pattern`` (one of :data:`PATTERNS_HELP`) for ``layout``:
    :func:`sparsa.sparsifiers.parse_pattern`, errors naming ``arg``.

    An ``'N:M'`` pattern stored in the ``grouped_nm`` layout is pruned by the grouped N:M sparsifier
    (``GroupedNM(n, m, g=4)``): a plain N:M mask (n of m along each row) is not grouped N:M (n of m
    rows of a block per column, the pattern shared by ``g`` columns), so that layout cannot store it.
    ``'grouped_nm'`` is the grouped N:M nearest ``sparsity`` (:func:`sparsa.frontier.grouped_nm_for`)."""
    from .sparsifiers.pattern_names import parse_pattern

    p = parse_pattern(pattern, sparsity, layout, arg=arg)
    return p.sparsifier, parse_pattern(pattern, sparsity, arg=arg).layout


#: from this sparsity on, an encoder's unstructured weights are stored as ``sliced_ell``: whole-model
#: BERT-base runs at dense fp32's speed there and faster in bf16, while ``masked`` always runs a dense
#: product (``benchmarks/bert_inference.py``, ``benchmarks/linear_kernels.py``); below it, ``masked``.
SLICED_ELL_MIN_SPARSITY = 0.5


def default_layout(pattern: str, causal_lm: bool = False, sparsity: Optional[float] = None) -> str:
    """The layout ``prune_model_dir`` stores ``pattern`` in when none is given: the pattern's natural
    one (masked, nm, grouped_nm or row_group), except that
    - a causal LM's ``'unstructured'`` or ``'N:M'`` weights go to ``"bitmask"`` (fast single-token
      decode, sparse bf16 prefill) when that layout is registered;
    - another model's ``'unstructured'`` weights go to ``"sliced_ell"`` (sparse compute for many tokens)
      at ``sparsity`` >= :data:`SLICED_ELL_MIN_SPARSITY` (``None``: 0.5, the CLI's default).

    >>> default_layout("2:4"), default_layout("grouped_2:4"), default_layout("row_group16")
    ('nm', 'grouped_nm', 'row_group')
    >>> default_layout("unstructured", sparsity=0.75), default_layout("unstructured", sparsity=0.3)
    ('sliced_ell', 'masked')
    """
    from .layouts.base import get_layout

    s = 0.5 if sparsity is None else sparsity
    _, natural = _pattern_sparsifier(pattern, s, arg="pattern")
    fast = None
    if causal_lm and natural in ("masked", "nm"):
        fast = "bitmask"
    elif not causal_lm and natural == "masked" and s >= SLICED_ELL_MIN_SPARSITY:
        fast = "sliced_ell"
    if fast is not None:
        try:
            get_layout(fast)
            return fast
        except ValueError:
            pass
    return natural


#: one example of each pattern family, as the error for a layout that cannot store a pattern lists them
_PATTERN_EXAMPLES = (
    ("unstructured", "'unstructured'"),
    ("2:4", "N:M (e.g. 2:4)"),
    ("grouped_2:4", "grouped_N:M (e.g. grouped_2:4)"),
    ("row_group16", "row_group<G> (e.g. row_group16)"),
)


def _probe() -> nn.Linear:
    probe = nn.Linear(256, 64, bias=False)
    with torch.no_grad():
        probe.weight.copy_(torch.randn(64, 256, generator=torch.Generator().manual_seed(0)))
    return probe


def _stores(pattern: str, sparsity: float, layout: str) -> bool:
    """Whether ``layout`` stores ``pattern`` at ``sparsity`` (tried on a small random weight)."""
    from . import Rule, sparsify

    try:
        sparsifier, _ = _pattern_sparsifier(pattern, sparsity, layout)
        sparsify(_probe(), Rule(sparsifier=sparsifier, layout=layout))
    except (ValueError, TypeError):
        return False
    return True


def _layout_fix(pattern: str, sparsity: float, layout: str) -> str:
    """What to pass instead when ``layout`` cannot store ``pattern``: the patterns ``layout`` stores
    and the layouts that store ``pattern`` (both found by trying them)."""
    from .layouts.base import registered_layouts

    fits = [say for p, say in _PATTERN_EXAMPLES if p != pattern and _stores(p, sparsity, layout)]
    where = [lay for lay in sorted(registered_layouts()) if lay != layout and _stores(pattern, sparsity, lay)]
    out = []
    if fits:
        out.append(f"--layout {layout} stores --pattern {' or '.join(fits)}")
    if where:
        out.append(
            f"--pattern {pattern} can be stored with --layout {', '.join(where)} "
            f"(default {_pattern_sparsifier(pattern, sparsity)[1]}: omit --layout)"
        )
    return "; ".join(out)


def check_pattern_layout(pattern: str, sparsity: float, layout: str) -> Any:
    """The sparsifier of ``pattern`` stored in ``layout`` (an ``'N:M'`` pattern in the ``grouped_nm``
    layout: the grouped N:M sparsifier); raises ``ValueError`` naming the argument and the fix if
    ``pattern``, ``sparsity`` or ``layout`` is invalid, or if ``layout`` cannot store ``pattern``
    (checked on a small random weight, so nothing is loaded or pruned first).

    >>> check_pattern_layout("2:4", 0.5, "grouped_nm")
    GroupedNM(n=2, m=4, g=4)
    """
    from . import Rule, sparsify
    from .layouts.base import check_fraction, get_layout

    check_fraction(sparsity, "--sparsity")
    sparsifier, _ = _pattern_sparsifier(pattern, sparsity, layout)
    try:
        get_layout(layout)
    except ValueError as e:
        raise ValueError(f"--layout: {e}") from None
    try:
        sparsify(_probe(), Rule(sparsifier=sparsifier, layout=layout))
    except (ValueError, TypeError) as e:
        why = str(e).splitlines()[0].split("; use ")[0] if str(e) else type(e).__name__
        fix = _layout_fix(pattern, sparsity, layout)
        raise ValueError(
            f"--layout {layout!r} cannot store --pattern {pattern!r} at --sparsity {sparsity} ({why})"
            + (f"; {fix}" if fix else "")
        ) from None
    return sparsifier


def _calibration(
    path: Path, n: int, causal_lm: bool = False, data: Optional[Union[str, os.PathLike]] = None
) -> Optional[Tuple[Any, List[Dict[str, torch.Tensor]]]]:
    from transformers import AutoTokenizer

    from .data.text import calibration_and_evaluation, read_user_texts

    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if tok.pad_token is None:  # many causal-LM tokenizers have none; padded positions are masked anyway
        tok.pad_token = tok.eos_token or tok.unk_token
    calib = read_user_texts(data, n) if data is not None else calibration_and_evaluation(n, 1)[0]
    return tok, _tokenized(tok, calib, causal_lm)


def _tokenized(tok: Any, texts: Sequence[str], causal_lm: bool = False) -> List[Dict[str, torch.Tensor]]:
    """Batches of 16 texts, padded, truncated to 128 tokens (decoders get no token_type_ids)."""
    batches = [
        dict(tok(list(texts[i : i + 16]), padding=True, truncation=True, max_length=128, return_tensors="pt"))
        for i in range(0, len(texts), 16)
    ]
    if causal_lm:
        batches = [{k: v for k, v in b.items() if k in ("input_ids", "attention_mask")} for b in batches]
    return batches


def _save(model: nn.Module, path: Path) -> None:
    from .io import save

    save(model, str(path))


class _NoInterrupt:
    """Hold Ctrl-C back for a short critical section (main thread only); re-raised at its end."""

    def __enter__(self) -> "_NoInterrupt":
        self.hit, self.old = False, None
        if threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGINT, self._note)
        return self

    def _note(self, *_: Any) -> None:
        self.hit = True

    def __exit__(self, *exc: Any) -> None:
        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)
        if self.hit and exc[0] is None:
            raise KeyboardInterrupt


def _write_out(out: Path, write: Callable[[Path], None]) -> None:
    """Run ``write(tmp)`` on a fresh temporary sibling directory of ``out``, then move it into place:
    one rename when ``out`` is absent or empty; into an existing non-empty ``out`` its files replace
    those of the same names (others are kept), the checkpoint last. On any exception (Ctrl-C
    included) the temporary directory, and any parent directories made for it, are removed."""
    made = [d for d in [out.parent, *out.parent.parents] if not d.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:
        tmp = out.parent / f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        tmp.mkdir()  # not mkdtemp: OUT gets the usual (umask) permissions, not 0700
        write(tmp)
        with _NoInterrupt():
            if out.is_dir() and not any(out.iterdir()):
                out.rmdir()
            if not out.exists():
                os.rename(tmp, out)
            else:
                files = sorted(tmp.iterdir(), key=lambda f: f.name == CHECKPOINT)
                for f in files:
                    os.replace(f, out / f.name)
                tmp.rmdir()
    except BaseException:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        for d in made:  # innermost first
            try:
                d.rmdir()
            except OSError:
                break
        raise


def prune_model_dir(
    src: str,
    out: str,
    *,
    method: str = "magnitude",
    sparsity: float = 0.5,
    pattern: str = "unstructured",
    layout: Optional[str] = None,
    calib: int = 256,
    progress: bool = True,
    only_if_faster: Union[bool, int] = False,
    data: Optional[Union[str, os.PathLike]] = None,
    recover_seconds: float = 0.0,
    recover_autocast: Optional[torch.dtype] = None,
) -> List[Dict[str, Any]]:
    """Prune the Linear layers of the transformer blocks of the model in ``src`` (see
    :func:`prunable_linears`) and write ``out``.

    ``layout``: the storage layout (default :func:`default_layout`). ``data``: calibration text for
    wanda/sparsegpt (a text file, one passage per line, or a directory of ``*.txt``; default the
    built-in offline sentences). ``only_if_faster`` (``True`` or a token count, as in
    :class:`sparsa.methods.OneShot`): each pruned layer is timed in its layout and in the
    :data:`~sparsa.nn.linears.SAME_PATTERN_LAYOUTS` that store its pattern exactly, and the fastest is
    kept; a layer whose fastest sparse layout is not measured faster than dense on this machine is saved
    as a dense weight (same values); ``True`` times a causal LM at
    :data:`sparsa.nn.linears.DECODE_TOKENS` (decoding), other models at 128 tokens. Returns the per-layer report rows
    (see :func:`sparsa.sparsity_report`; the pruned weights' rows also carry ``path`` and
    ``ratio_vs_dense``). ``recover_seconds``: after pruning, distil the pruned model towards the
    dense one for that many seconds, pattern kept (:func:`sparsa.prune_recovery.recover_pruned`, on
    ``data`` or the built-in text); for an encoder given enough seconds the one-shot pruning stops at
    :func:`~sparsa.prune_recovery.recovery_start` and the recovery prunes gradually on to
    ``sparsity``. ``recover_autocast``: the recovery's student forward under ``torch.autocast`` of that
    dtype (e.g. ``torch.bfloat16``: faster steps on CPUs with bf16 hardware; weights stay fp32).
    ``out`` is complete or untouched: see :func:`_write_out`.
    """
    from . import Rule, sparsify, sparsity_report
    from .methods import SparseGPT, Wanda
    from .nn.linears import SAME_PATTERN_LAYOUTS, _tokens, annotate_paths, dense_where_slower, timing_tokens

    if method not in METHODS:
        raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")
    if isinstance(recover_seconds, bool) or not isinstance(recover_seconds, (int, float)) or not recover_seconds >= 0:
        raise ValueError(f"--recover must be a number of seconds >= 0, got {recover_seconds!r}")
    _tokens(only_if_faster, "only_if_faster")  # a bad value fails before any loading
    srcp, outp = Path(src), Path(out)
    if outp.exists() and not outp.is_dir():
        raise ValueError(f"--out {out!r} exists and is not a directory")
    if not (srcp / "config.json").is_file():
        raise FileNotFoundError(f"MODEL_DIR {src!r}: not a model directory (expected a config.json inside)")
    causal = is_causal_lm(srcp)
    layout = layout or default_layout(pattern, causal, sparsity)
    sparsifier = check_pattern_layout(pattern, sparsity, layout)
    frontier.check_method_layout(method, layout, "--method")
    model = load_pruned(src)
    names = prunable_linears(model)
    if not names:
        raise ValueError(
            f"MODEL_DIR {src!r}: the model has no nn.Linear layers to prune (only nn.Linear "
            "weights are pruned; GPT-2 style Conv1D layers are not)"
        )
    teacher = copy.deepcopy(model) if recover_seconds else None
    start = sparsity
    if recover_seconds and not causal:
        from .prune_recovery import recovery_start

        # a gradual recovery (measured on encoders only): one-shot to the start, then recover_pruned
        # prunes on to the target
        start = recovery_start(pattern, sparsity, recover_seconds)
        if start != sparsity:
            sparsifier = check_pattern_layout(pattern, start, layout)
    tok = None
    if recover_seconds or method != "magnitude":
        cal = _calibration(srcp, calib, causal, data)
        if cal is None:
            raise ValueError(
                f"{'--recover' if recover_seconds else '--method ' + method} needs text, but {src} has no "
                "tokenizer files; use --method magnitude without --recover"
            )
        tok, batches = cal
    if method == "magnitude":
        sparsify(model, [Rule(sparsifier=sparsifier, layout=layout, names=names)])
    else:
        # causal LMs: run the base model only (the LM head's logits are not needed and can be huge)
        fwd = (lambda m, b: m.base_model(**b, use_cache=False)) if causal else (lambda m, b: m(**b))
        wanted = set(names)
        config = (
            Wanda(start, sparsifier=sparsifier, layout=layout, calibration=batches, forward=fwd)
            if method == "wanda"
            else SparseGPT(
                start, sparsifier=sparsifier, layout=layout, calibration=batches, forward=fwd, progress=progress
            )
        )
        sparsify(model, config, lambda m, n: n in wanted)
    if recover_seconds:
        from .prune_recovery import recover_pruned

        if progress and start != sparsity:
            print(f"recovering: pruned to {start:.0%}, then gradually to {sparsity:.0%} while distilling", flush=True)
        rep = recover_pruned(
            model,
            teacher,
            tok,
            causal=causal,
            names=names,
            pattern=pattern,
            sparsity=sparsity,
            layout=layout,
            seconds=recover_seconds,
            data=data,
            progress=progress,
            autocast=recover_autocast,
        )
        del teacher
        if progress:
            first, last = (rep.losses[0], rep.losses[-1]) if rep.losses else (float("nan"), float("nan"))
            print(f"recovered: {rep.steps} steps in {rep.seconds:.0f} s, loss {first:.4f} -> {last:.4f}", flush=True)
    tokens = timing_tokens(only_if_faster, model)
    if tokens:
        chosen = dense_where_slower(model, tokens, names=names, layouts=SAME_PATTERN_LAYOUTS)
    else:
        chosen = {f"{n}.weight": {"path": "sparse", "ratio_vs_dense": None} for n in names}

    _write_out(outp, _writer(srcp, model))
    return annotate_paths(sparsity_report(model), chosen)


def _writer(srcp: Path, model: nn.Module) -> Callable[[Path], None]:
    """What :func:`_write_out` runs: config, extra and tokenizer files of ``srcp``, then the checkpoint."""

    def write(tmp: Path) -> None:
        for f in ("config.json",) + _EXTRA_FILES + _TOKENIZER_FILES:
            if (srcp / f).is_file():
                shutil.copy2(srcp / f, tmp / f)
        _save(model, tmp / CHECKPOINT)

    return write


# ----------------------------------------------------------------------------- --target-quality
#: the sparsities :func:`search_target_quality` bisects over, per pattern whose sparsity is free
SEARCH_SPARSITIES: Tuple[float, ...] = tuple(round(0.3 + 0.05 * i, 2) for i in range(14))  # 0.30 .. 0.95
_MAX_EVAL = 128


def split_texts(
    texts: Sequence[str], n_calibration: int, n_evaluation: Optional[int] = None, seed: int = 0
) -> Tuple[List[str], List[str]]:
    """Split ``texts`` disjointly into (calibration, evaluation): de-duplicated, shuffled with
    ``seed`` (deterministic), ``n_evaluation`` held out (default: up to 128, at least a quarter, and
    whatever the calibration's ``n_calibration`` leaves), then up to ``n_calibration`` of the rest.
    Needs at least 8 distinct texts.

    >>> cal, ev = split_texts([f"text {i}" for i in range(20)], 12)
    >>> len(cal), len(ev), set(cal).isdisjoint(ev)
    (12, 8, True)
    """
    import random

    uniq = list(dict.fromkeys(t for t in texts if t.strip()))
    if len(uniq) < 8:
        raise ValueError(
            f"--data holds {len(uniq)} distinct passage(s); --target-quality needs at least 8 (one per "
            "line) to split into calibration and held-out evaluation text"
        )
    random.Random(seed).shuffle(uniq)
    n_eval = n_evaluation or min(_MAX_EVAL, max(len(uniq) // 4, len(uniq) - n_calibration))
    n_eval = max(2, min(n_eval, len(uniq) - 1))
    return uniq[n_eval : n_eval + n_calibration], uniq[:n_eval]


@dataclass
class TargetQualityResult:
    """What :func:`search_target_quality` tried and chose. ``candidates``: one dict per configuration
    evaluated (``pattern``, ``label``, ``layout``, ``sparsity``, ``quality_cosine``, ``quality_top1``,
    ``speedup_vs_best_dense``, ``speedup_vs_dense``, ``sparse_dtype`` / ``sparse_path`` (how it ran
    fastest), ``passes``, or ``skipped`` with a reason);
    ``chosen``: the fastest passing one (``None`` if none passed); ``dense_ms`` / ``best_dense``: the
    dense baselines timed; ``report``: the per-layer rows of the saved model."""

    target: float
    method: str
    candidates: List[Dict[str, Any]]
    chosen: Optional[Dict[str, Any]]
    dense_ms: Dict[str, float]
    best_dense: str
    n_calibration: int
    n_evaluation: int
    report: List[Dict[str, Any]] = field(default_factory=list)
    #: the speed-up over the best dense path a winner also needs (None: any)
    min_speedup: Optional[float] = None

    def table(self) -> str:
        """A plain-text table of the candidates (the chosen one marked ``<-``)."""
        head = f"{'pattern':<14} {'layout':<11} {'sparsity':>8} {'cosine':>7} {'top-1':>6} {'speedup':>8}  ok"
        lines = [head, "-" * len(head)]
        for c in self.candidates:
            if "skipped" in c:
                lines.append(f"{c['label']:<14} {c['layout']:<11} {c['sparsity']:>8.0%}  skipped: {c['skipped']}")
                continue
            lines.append(
                f"{c['label']:<14} {c['layout']:<11} {c['sparsity']:>8.0%} {c['quality_cosine']:>7.3f} "
                f"{c['quality_top1']:>6.3f} {c['speedup_vs_best_dense']:>7.2f}x  "
                f"{'yes' if c['passes'] else 'no'}{'  <-' if c is self.chosen else ''}"
                + (f"  ({c['sparse_dtype']}, {c['sparse_path']})" if "sparse_path" in c else "")
                + (f"  (after {c['recover_s']:.0f} s of recovery)" if c.get("recovered") else "")
            )
        lines.append(
            f"speedup: vs the best dense path here ({self.best_dense}: "
            + ", ".join(f"{k} {v:.1f} ms" for k, v in self.dense_ms.items())
            + f"), batch 8, seq 128; "
            f"cosine / top-1: held-out embeddings vs the dense model on {self.n_evaluation} texts "
            f"(calibration on {self.n_calibration} others)"
        )
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: what was chosen and why (or that nothing reached the target)."""
        tried = [c for c in self.candidates if "skipped" not in c]
        ok = [c for c in tried if c["passes"]]
        if self.chosen is None and ok and self.min_speedup is not None:
            fastest = max(ok, key=lambda c: c["speedup_vs_best_dense"])
            return (
                f"no configuration reached cosine >= {self.target:g} at >= {self.min_speedup:g}x the best dense "
                f"path ({self.best_dense}) with {self.method} ({len(ok)} of {len(tried)} tried reached the cosine; "
                f"the fastest: {fastest['label']} at {fastest['sparsity']:.0%}, "
                f"{fastest['speedup_vs_best_dense']:.2f}x): keep the model dense ({self.best_dense}), lower "
                "--min-speedup or --target-quality"
                + ("" if any(c.get("recovered") for c in tried) else ", or add --recover SECONDS")
            )
        if self.chosen is None:
            best = max(tried, key=lambda c: c["quality_cosine"], default=None)
            return (
                f"no configuration reached cosine >= {self.target:g} with {self.method} ({len(tried)} tried"
                + (
                    f"; the closest: {best['label']} at {best['sparsity']:.0%}, cosine {best['quality_cosine']:.3f}"
                    if best
                    else ""
                )
                + "); lower --target-quality, try --method sparsegpt"
                + ("" if any(c.get("recovered") for c in tried) else ", add --recover SECONDS")
                + ", or prune by --sparsity"
            )
        c = self.chosen
        how = self.method + (f" + {c['recover_s']:.0f} s of recovery" if c.get("recovered") else "")
        return (
            f"chose {c['label']} ({c['layout']}) at {c['sparsity']:.0%} with {how}: the fastest of the "
            f"{len(ok)} configurations (of {len(tried)} tried) with held-out cosine >= {self.target:g}: "
            f"cosine {c['quality_cosine']:.3f}, {c['speedup_vs_best_dense']:.2f}x vs the best dense path "
            f"({self.best_dense})"
            + (f" when run as {_runs_as(c)}" if "sparse_path" in c else "")
            + ("; note: it is slower than dense here" if c["speedup_vs_best_dense"] < 1 else "")
        )


def _runs_as(row: Dict[str, Any]) -> str:
    """How a candidate runs fastest, e.g. ``"bitmask, bfloat16, compiled"``."""
    return ", ".join(str(row[k]) for k in ("layout", "sparse_dtype", "sparse_path") if k in row)


class TargetNotReached(ValueError):
    """No configuration reached the target quality; ``result`` holds what was tried (nothing written)."""

    def __init__(self, result: TargetQualityResult):
        super().__init__(result.summary())
        self.result = result


def search_target_quality(
    src: str,
    out: str,
    target_quality: float,
    *,
    method: str = "magnitude",
    data: Optional[Union[str, os.PathLike]] = None,
    patterns: Optional[Sequence[str]] = None,
    sparsities: Sequence[float] = SEARCH_SPARSITIES,
    calib: int = 256,
    use_compile: bool = True,
    reps: int = 3,
    recover_seconds: float = 0.0,
    recover_candidates: int = 2,
    recover_autocast: Optional[torch.dtype] = None,
    min_speedup: Optional[float] = None,
    log: Optional[Callable[[str], None]] = print,
) -> TargetQualityResult:
    """Prune the encoder in ``src`` into the fastest configuration whose held-out embedding quality
    (mean cosine of mean-pooled last hidden states to the dense model's) is at least
    ``target_quality``, and write it to ``out`` as :func:`prune_model_dir` does.

    Candidates: ``patterns`` (default every one of :data:`sparsa.frontier.PATTERNS`: unstructured
    as sliced_ell, 2:4, 4:8, grouped N:M, row groups of 4/8/16) pruned by ``method``. Per pattern the
    highest passing sparsity of ``sparsities`` is found by bisection (quality falls as sparsity
    rises); every candidate evaluated is also timed once (batch 8, seq 128) against the fastest dense
    path of this machine (dense fp32, dense bf16 and, with ``use_compile``, ``torch.compile`` of the
    faster), in its own fastest way to run (:meth:`sparsa.frontier.DenseBaselines.best_path`: fp32 or
    bf16, GELU-fused, compiled; an unstructured mask in each of
    :data:`sparsa.frontier.UNSTRUCTURED_LAYOUTS`, kept in the fastest), and the fastest passing one
    wins; the summary says how it runs fastest. ``data``: the user's text (a file, one passage per line,
    or a directory of ``*.txt``), split by :func:`split_texts` into calibration (up to ``calib``
    passages) and evaluation text; default the built-in offline sentences (disjoint samples).

    ``recover_seconds`` > 0: then up to ``recover_candidates`` of the configurations that failed but
    are faster than the one-shot winner (those closest to the target first) are pruned again (to
    :func:`sparsa.prune_recovery.recovery_start`) and distilled towards the dense model for
    ``recover_seconds`` each (:func:`sparsa.prune_recovery.
    recover_pruned`, on every text but the held-out ones), re-scored and re-timed; one that passes
    and is faster wins. The search then takes up to ``recover_candidates * recover_seconds`` more.
    ``recover_autocast``: as in :func:`prune_model_dir`.

    ``min_speedup``: the winner must also run at least that many times as fast as the best dense path
    (e.g. 1.0: never slower than dense); recovery then only tries configurations that fast.

    Raises :class:`TargetNotReached` (a ``ValueError``, with ``.result``) without writing ``out`` when
    no candidate passes (or none passes fast enough); ``ValueError`` for a bad argument or a causal LM
    (not supported yet).
    """
    from . import sparsity_report
    from .data.text import calibration_and_evaluation, read_user_texts
    from .models.minilm import embed

    say = log or (lambda _: None)
    if (
        isinstance(target_quality, bool)
        or not isinstance(target_quality, (int, float))
        or not 0.0 < float(target_quality) <= 1.0
    ):
        raise ValueError(
            f"--target-quality must be in (0, 1] (a mean cosine to the dense model), got {target_quality!r}"
        )
    if method not in METHODS:
        raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")
    if isinstance(recover_seconds, bool) or not isinstance(recover_seconds, (int, float)) or not recover_seconds >= 0:
        raise ValueError(f"--recover {recover_seconds!r}: give a number of seconds >= 0 (0: no recovery)")
    if min_speedup is not None and (
        isinstance(min_speedup, bool) or not isinstance(min_speedup, (int, float)) or not 0.0 < min_speedup < math.inf
    ):
        raise ValueError(f"--min-speedup {min_speedup!r}: give a positive speed-up over the best dense path (e.g. 1.0)")
    if isinstance(recover_candidates, bool) or not isinstance(recover_candidates, int) or recover_candidates < 1:
        raise ValueError(f"recover_candidates must be a positive int, got {recover_candidates!r}")
    srcp, outp = Path(src), Path(out)
    if outp.exists() and not outp.is_dir():
        raise ValueError(f"--out {out!r} exists and is not a directory")
    if not (srcp / "config.json").is_file():
        raise FileNotFoundError(f"MODEL_DIR {src!r}: not a model directory (expected a config.json inside)")
    if is_causal_lm(srcp):
        raise ValueError(
            "--target-quality is not supported for causal LMs yet (it scores sentence embeddings of "
            "encoders such as BERT or MiniLM); prune with --sparsity instead"
        )
    patterns = list(patterns or frontier.PATTERNS)
    for p in patterns:
        try:
            frontier.pattern_config(p, 0.5)
        except (ValueError, TypeError) as e:
            raise ValueError(f"--pattern: {e}") from None
    grid = sorted({float(s) for s in sparsities})
    if not grid or not all(0.0 < s < 1.0 for s in grid):
        raise ValueError(f"sparsities must be in (0, 1), got {list(sparsities)}")
    if not any((srcp / f).is_file() for f in _TOKENIZER_FILES):
        raise ValueError(f"--target-quality scores the model on held-out text, but {src} has no tokenizer files")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(srcp), local_files_only=True)
    if data is not None:
        cal_texts, eval_texts = split_texts(read_user_texts(data, calib + _MAX_EVAL), calib)
    else:
        cal_texts, eval_texts = calibration_and_evaluation(calib, _MAX_EVAL)
    dense = load_pruned(src)
    names = prunable_linears(dense)
    if not names:
        raise ValueError(f"MODEL_DIR {src!r}: the model has no nn.Linear layers to prune")
    calibration = _tokenized(tok, cal_texts) if method != "magnitude" else []
    held = {"data": eval_texts}
    ref = {"data": embed(dense, tok, eval_texts, max_length=128)}
    baselines = frontier.DenseBaselines(
        dense, frontier.encoder_inputs(dense), use_compile=use_compile, reps=reps, log=say
    )

    def _fastest_layout(model: nn.Module, row: Dict[str, Any], cfg: frontier.PatternConfig) -> nn.Module:
        """``model`` (pruned into ``cfg.layout``) or its copy in another layout that stores the same mask,
        whichever runs fastest (:meth:`DenseBaselines.best_layout`); its speed and layout go into ``row``."""
        fastest, speed = baselines.best_layout(model, cfg, names)
        row.update(speed, layout=speed["sparse_layout"])
        return fastest

    tried: Dict[Tuple[str, float], Dict[str, Any]] = {}
    candidates: List[Dict[str, Any]] = []
    best: Dict[str, Any] = {"row": None, "model": None}

    def evaluate(pattern: str, sparsity: float) -> bool:
        cfg = frontier.pattern_config(pattern, sparsity)
        key = (cfg.label, cfg.sparsity)
        if key not in tried:
            row: Dict[str, Any] = {
                "pattern": pattern,
                "label": cfg.label,
                "layout": cfg.layout,
                "sparsity": cfg.sparsity,
            }
            try:
                model = frontier.prune_copy(dense, method, cfg, calibration, names)
            except ValueError as e:
                row["skipped"], row["passes"] = str(e).split(";")[0], False
                say(f"  {cfg.label} at {cfg.sparsity:.0%}: skipped ({row['skipped']})")
            else:
                row.update(frontier.embedding_quality(model, tok, held, ref))
                model = _fastest_layout(model, row, cfg)
                row["passes"] = row["quality_cosine"] >= target_quality
                say(
                    f"  {cfg.label} at {cfg.sparsity:.0%}: cosine {row['quality_cosine']:.3f}, "
                    f"{row['speedup_vs_best_dense']:.2f}x vs the best dense as {_runs_as(row)}"
                    + (" (passes)" if row["passes"] else "")
                )
                if row["passes"] and (
                    best["row"] is None or row["speedup_vs_best_dense"] > best["row"]["speedup_vs_best_dense"]
                ):
                    best["row"], best["model"] = row, model
                del model
            tried[key] = row
            candidates.append(row)
        return bool(tried[key]["passes"])

    say(
        f"searching {', '.join(patterns)} for cosine >= {target_quality:g} with {method} "
        f"({len(cal_texts)} calibration / {len(eval_texts)} held-out texts)"
    )
    for p in patterns:
        if p in frontier.FIXED_SPARSITY or (":" in p and not p.startswith("grouped")):
            evaluate(p, frontier.pattern_config(p, 0.5).sparsity)
        else:
            frontier.highest_passing(grid, lambda s, p=p: evaluate(p, s))
    if recover_seconds > 0:
        from .prune_recovery import recover_pruned, recovery_start

        floor = best["row"]["speedup_vs_best_dense"] if best["row"] is not None else 0.0
        fast = min_speedup or 0.0  # a recovered configuration below it could not win
        near_misses = sorted(
            (
                c
                for c in candidates
                if "skipped" not in c
                and c["speedup_vs_best_dense"] > floor
                and c["speedup_vs_best_dense"] >= fast
                and not c["passes"]
            ),
            key=lambda c: -c["quality_cosine"],
        )[:recover_candidates]
        for miss in near_misses:
            cfg = frontier.pattern_config(miss["pattern"], miss["sparsity"])
            start = recovery_start(miss["pattern"], cfg.sparsity, float(recover_seconds))
            gradual = f" (from {start:.0%}, pruned gradually)" if start != cfg.sparsity else ""
            say(f"  recovering {cfg.label} at {cfg.sparsity:.0%} for {recover_seconds:g} s{gradual} ...")
            model = frontier.prune_copy(
                dense, method, frontier.pattern_config(miss["pattern"], start), calibration, names
            )
            rep = recover_pruned(
                model,
                dense,
                tok,
                causal=False,
                names=names,
                pattern=miss["pattern"],
                sparsity=cfg.sparsity,
                layout=cfg.layout,
                seconds=float(recover_seconds),
                data=data,
                exclude=eval_texts,
                progress=log is not None,
                autocast=recover_autocast,
            )
            model.eval()
            row = {k: miss[k] for k in ("pattern", "label", "layout", "sparsity")}
            row.update(recovered=True, recover_s=round(rep.seconds, 1), recover_steps=rep.steps, recover_start=start)
            row["one_shot_cosine"] = miss["quality_cosine"]
            row.update(frontier.embedding_quality(model, tok, held, ref))
            model = _fastest_layout(model, row, cfg)
            row["passes"] = row["quality_cosine"] >= target_quality
            say(
                f"  {cfg.label} at {cfg.sparsity:.0%} after {rep.steps} recovery steps: cosine "
                f"{miss['quality_cosine']:.3f} -> {row['quality_cosine']:.3f}, "
                f"{row['speedup_vs_best_dense']:.2f}x vs the best dense as {_runs_as(row)}"
                + (" (passes)" if row["passes"] else "")
            )
            if row["passes"] and (
                best["row"] is None or row["speedup_vs_best_dense"] > best["row"]["speedup_vs_best_dense"]
            ):
                best["row"], best["model"] = row, model
            candidates.append(row)
            del model
    candidates.sort(key=lambda c: (patterns.index(c["pattern"]), c["sparsity"]))
    fast_enough = best["row"] is not None and (
        min_speedup is None or best["row"]["speedup_vs_best_dense"] >= min_speedup
    )
    result = TargetQualityResult(
        float(target_quality),
        method,
        candidates,
        best["row"] if fast_enough else None,
        {k: round(v, 1) for k, v in baselines.ms.items()},
        baselines.best,
        len(cal_texts),
        len(eval_texts),
        min_speedup=None if min_speedup is None else float(min_speedup),
    )
    if not fast_enough:
        raise TargetNotReached(result)
    _write_out(outp, _writer(srcp, best["model"]))
    result.report = sparsity_report(best["model"])
    return result
