"""The ``sparsa`` command.

    sparsa prune MODEL_DIR -o OUT     prune a Hugging Face model directory offline, save compressed
    sparsa prune MODEL_DIR -o OUT --target-quality Q   the fastest configuration with held-out cosine >= Q
    sparsa generate MODEL_DIR --prompt TEXT   greedy generation with a (pruned) causal LM, timed
    sparsa inspect CHECKPOINT         per-layer layout, sparsity and bytes of a sparsa checkpoint
    sparsa bench linear|bert|training|quality|pareto|dispatch   run a benchmark script (JSON + PNG)

Bad arguments print one line starting with ``sparsa: error:`` and exit with status 2; a failure
while running prints one line and exits with status 1 (``--debug`` shows the traceback).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

__all__ = ["main", "build_parser"]

BENCHES = {
    "linear": "linear_kernels.py",
    "bert": "bert_inference.py",
    "training": "adaptive_training.py",
    "quality": "quality.py",
    "pareto": "pareto.py",
    "dispatch": "dispatch_overhead.py",
}


class UsageError(Exception):
    """Bad argument value: reported as a one-line usage error (exit status 2)."""


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text!r}") from None
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1) (the fraction of weights removed), got {text}")
    return v


def _quality(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (the held-out mean cosine to the dense model), got {text}")
    return v


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return v


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="sparsa", description="Composable, fast sparsity for PyTorch.")
    p.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    # The demo is an example, not part of the package (issue #17): it lives in examples/ of a source
    # checkout. The subcommand stays only to say where it went.
    sub.add_parser(
        "demo",
        help="moved: run `make demo` (or `python -m examples.flagship`) in a source checkout",
        description="The flagship demo is no longer part of the installed package. In a source "
        "checkout of sparsa run `make demo`, or `python -m examples.flagship [--quick]` "
        "from the repository root.",
    )

    pr = sub.add_parser(
        "prune",
        help="prune a Hugging Face model directory offline and save it compressed",
        description="Prune every Linear of the transformer blocks of MODEL_DIR (a Hugging Face "
        "model directory, or one written by `sparsa prune`; encoders such as BERT "
        "and causal LMs such as Llama, Mistral or Qwen2, whose LM head and "
        "embeddings stay dense) and write OUT: config, tokenizer and the compressed "
        "sparse checkpoint. OUT is written in a temporary sibling directory and "
        "moved into place at the end: an interrupted run leaves no partial OUT.",
    )
    pr.add_argument("model", metavar="MODEL_DIR", help="Hugging Face model directory (with config.json)")
    pr.add_argument("-o", "--out", required=True, help="output directory")
    pr.add_argument(
        "--method",
        choices=["magnitude", "wanda", "sparsegpt"],
        default="magnitude",
        help="one-shot method (wanda/sparsegpt calibrate on built-in offline text; default magnitude)",
    )
    pr.add_argument("--sparsity", type=_fraction, default=None, help="fraction of weights removed (default 0.5)")
    pr.add_argument(
        "--pattern",
        default=None,
        help="'unstructured', 'N:M' (e.g. 2:4), 'grouped_N:M' (e.g. grouped_2:4), 'grouped_nm' (the "
        "grouped N:M nearest --sparsity) or 'row_group<G>' (e.g. row_group16; fast on CPU), as "
        "sparsa.sparsifiers.parse_pattern reads them (default unstructured; with --target-quality: "
        "a comma-separated list to search, default all of unstructured,2:4,4:8,grouped_nm,"
        "row_group4,row_group8,row_group16)",
    )
    pr.add_argument(
        "--layout",
        default=None,
        help="storage layout (default: the pattern's natural one: masked, nm, grouped_nm or row_group; "
        "for a causal LM with an unstructured or N:M pattern, bitmask where available; for an encoder "
        "with an unstructured pattern at --sparsity >= 0.5, sliced_ell)",
    )
    pr.add_argument("--calib", type=_positive_int, default=256, help="calibration sentences (default 256)")
    pr.add_argument(
        "--data",
        metavar="FILE|DIR",
        default=None,
        help="calibration text for wanda/sparsegpt: a UTF-8 file (one passage per line) or a "
        "directory of *.txt files (default: built-in offline sentences); with --target-quality it "
        "is split disjointly into calibration and held-out evaluation text",
    )
    pr.add_argument(
        "--recover",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="after pruning, distil the pruned model towards the dense one for SECONDS of wall-clock "
        "time, the pattern kept (sparsa.recover; on --data, or the built-in offline text); e.g. 1200 "
        "(default 0: no recovery); from 600 s on, an encoder's unstructured and row-group patterns above "
        "50%% are pruned to 50%% first and gradually to the target while distilling (unstructured and "
        "row_group4/8/16 ones ranked by |W|*||X||); with --target-quality, "
        "the two faster configurations closest to the target are recovered for SECONDS each and win "
        "if they then pass",
    )
    pr.add_argument(
        "--recover-bf16",
        action="store_true",
        help="run the recovery's student forward under bf16 autocast (faster steps on CPUs with bf16 "
        "matrix hardware, AVX512-BF16 or AMX; weights, optimizer and loss stay fp32); needs --recover",
    )
    pr.add_argument(
        "--target-quality",
        type=_quality,
        default=None,
        metavar="Q",
        help="search patterns, layouts and sparsities for the fastest configuration whose held-out "
        "mean cosine to the dense model's embeddings is >= Q (encoders only); prints the "
        "candidates tried; exits 1 without writing OUT if none reaches Q",
    )
    pr.add_argument(
        "--min-speedup",
        type=float,
        default=None,
        metavar="X",
        help="with --target-quality: the chosen configuration must also run at least X times as fast as "
        "the best dense path (e.g. 1.0: never slower than dense); if none does, exit 1 without writing OUT",
    )
    pr.add_argument(
        "--no-compile",
        action="store_true",
        help="with --target-quality: skip the torch.compile dense baseline (a faster search; speed-ups "
        "then against dense fp32 and bf16 eager only)",
    )
    pr.add_argument(
        "--only-if-faster",
        action="store_true",
        help="time each pruned layer on this machine (at the current thread count) in its layout and "
        "in sliced_ell and bitmask where they store the same pattern; keep the fastest sparse layout "
        "where it beats dense, and save the others dense (same values)",
    )
    pr.add_argument(
        "--timing-tokens",
        type=_positive_int,
        default=None,
        metavar="N",
        help="input rows (tokens) to time each layer at with --only-if-faster (default 128; 1 for a "
        "causal LM, whose generation runs one token per step)",
    )

    g = sub.add_parser(
        "generate",
        help="greedy generation with a (pruned) causal LM; prints prefill and decode speed",
        description="Load a causal-LM directory (dense, or written by `sparsa prune`), generate "
        "greedily with the KV cache and print the text, then one timing line (after a short "
        "warm-up run): prefill = from the prompt's hand-over to the model (just before "
        "its forward pass) to the first new token; decode = the tokens after the "
        "first, per second.",
    )
    g.add_argument("model", metavar="MODEL_DIR", help="causal-LM directory (config.json, tokenizer, weights)")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=32,
        help="tokens to generate at most (stops early at end of sequence; default 32)",
    )
    g.add_argument("--threads", type=_positive_int, default=2, help="torch threads (default: 2)")
    g.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="compute dtype of the model (default float32)",
    )
    g.add_argument(
        "--compile",
        action="store_true",
        help="decode with a static KV cache and a torch.compile'd step (sparsa.models.compiled_decode): "
        "less time per token outside the linears; the warm-up run compiles it (seconds to a minute)",
    )

    i = sub.add_parser(
        "inspect",
        help="per-layer layout, sparsity and bytes of a sparsa checkpoint",
        description="Read a sparsa checkpoint (a .safetensors file or a directory written by "
        "`sparsa prune`) and print per-layer layout, sparsity and bytes.",
    )
    i.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint file or pruned model directory")

    b = sub.add_parser(
        "bench",
        help="run a benchmark script (writes JSON and PNG under benchmarks/results)",
        description="Run one of the benchmark scripts of a source checkout.",
    )
    b.add_argument("which", choices=sorted(BENCHES), help="which benchmark")
    b.add_argument("--quick", action="store_true", help="the quick subset")

    c = sub.add_parser(
        "cost",
        help="show or clear the measured per-CPU cost tables (only_if_faster's timings and "
        "the adaptive-training calibration)",
        description="The cost table caches side-by-side timings of sparse kernels and dense paths "
        "per CPU model, shape and thread count; the adaptive-training calibration caches "
        "dense and activation-sparse conv/linear training times per CPU model and layer "
        "shape. Both are measured when first needed.",
    )
    c.add_argument(
        "--clear",
        action="store_true",
        help="forget every measurement of both tables (they are re-timed when next needed)",
    )
    c.add_argument(
        "--refit",
        action="store_true",
        help="measure the sparse kernels' density and token crossovers and the adaptive conv backward's "
        "cost models on this CPU (about three minutes) and store them in the table; kernels this "
        "CPU cannot run are skipped, with the reason",
    )
    return p


def _cmd_cost(a: argparse.Namespace) -> int:
    from . import cpu
    from .cost_model import default_cost_model

    cm = default_cost_model()
    info = cpu.cpu_info()
    print(f"cpu: {info['model']} ({info['class']}, kernel path {info['isa']})")
    if a.clear and a.refit:
        raise UsageError("sparsa cost: pass --clear or --refit, not both")
    from .adaptive.calibration import default_calibration

    cal = default_calibration()
    print(
        f"table: {cm.path or 'in memory only (SPARSA_COST_DIR=off)'}: {len(cm.keys())} timed keys, "
        f"{len(cm.fit_keys())} fitted models"
    )
    print(f"adaptive calibration: {len(cal)} layer models" + (f" (in {cal.path})" if cal.path != cm.path else ""))
    if a.clear:
        cm.clear()
        cal.clear()
        print("cleared")
        return 0
    from .adaptive import cost_fits
    from . import crossovers

    if a.refit:
        from .adaptive import cost_fits_refit
        from .ops import crossover_refit

        for name, d in crossover_refit.refit(cm).items():
            print(f"crossover {name}: {crossovers.describe(name, d)} (default {crossovers.builtin_default(name):g})")
        fitted, skipped = cost_fits_refit.refit(cm)
        for name, c in fitted.items():
            print(f"cost fit {name}: {_coeffs(c)} (default {_coeffs(cost_fits.builtin(name))})")
        for why in dict.fromkeys(skipped.values()):
            print(f"skipped {', '.join(n for n, w in skipped.items() if w == why)}: {why}")
    for key in cm.keys():
        costs = cm.lookup(key) or {}
        print(key + ": " + ", ".join(f"{o} {ms:.3f} ms" for o, ms in sorted(costs.items(), key=lambda kv: kv[1])))
    named = (crossovers.PREFIX, cost_fits.PREFIX)  # listed below with their defaults
    for key in cm.fit_keys():
        if key.startswith(named):
            continue
        params = cm.fit(key) or {}
        print(
            key
            + ": "
            + ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in params.items() if v is not None
            )
        )
    print("named crossovers and cost models (`sparsa cost --refit` measures them on this CPU):")
    for name in crossovers.CROSSOVERS:
        measured = cm.fit(crossovers.PREFIX + name) is not None
        src = (
            "refitted"
            if measured
            else "measured on this CPU class"
            if crossovers.measured_on_this_class(name)
            else "default"
        )
        print(f"  crossover {name}: {crossovers.describe(name, crossovers.crossover(name, cm))} ({src})")
    for name in cost_fits.COST_FITS:
        measured = cost_fits.stored(name, cm) is not None
        src = (
            "refitted"
            if measured
            else "measured on this CPU class"
            if cost_fits.measured_on_this_class(name)
            else "default"
        )
        print(f"  cost fit {name}: {_coeffs(cost_fits.coefficients(name, cm))} ({src})")
    return 0


def _coeffs(c) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in c.items())


def _cmd_demo(a: argparse.Namespace) -> int:
    raise UsageError(
        "`sparsa demo` moved out of the package: in a source checkout of sparsa run `make demo`, "
        "or `python -m examples.flagship [--quick]` from the repository root"
    )


def _quiet_transformers() -> None:
    """No weight-loading progress bars: the command's output stays its own."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _check_model_dir(path: str) -> None:
    if not Path(path).is_dir():
        raise UsageError(f"MODEL_DIR {path!r} does not exist or is not a directory")
    if not (Path(path) / "config.json").is_file():
        raise UsageError(f"MODEL_DIR {path!r} has no config.json (not a Hugging Face model directory)")


def _cmd_prune(a: argparse.Namespace) -> int:
    import torch

    from .nn.report import format_report
    from .prune import CHECKPOINT, check_pattern_layout, default_layout, is_causal_lm, prune_model_dir

    _check_model_dir(a.model)
    if not a.recover >= 0:
        raise UsageError(f"--recover {a.recover:g}: give a number of seconds >= 0 (0: no recovery)")
    if a.recover_bf16 and not a.recover:
        raise UsageError("--recover-bf16 only applies to a recovery: add --recover SECONDS")
    if a.target_quality is not None:
        return _cmd_prune_target(a)
    if a.no_compile:
        raise UsageError("--no-compile only applies with --target-quality")
    if a.min_speedup is not None:
        raise UsageError("--min-speedup only applies with --target-quality")
    a.sparsity = 0.5 if a.sparsity is None else a.sparsity
    a.pattern = a.pattern or "unstructured"
    if a.layout is not None:
        from .layouts.base import registered_layouts

        if a.layout not in registered_layouts():
            raise UsageError(f"unknown --layout {a.layout!r}; choose one of {', '.join(sorted(registered_layouts()))}")
    causal = is_causal_lm(a.model)  # a config.json that is no JSON fails here (exit 1)
    try:
        layout = a.layout or default_layout(a.pattern, causal, a.sparsity)
    except ValueError as e:
        raise UsageError(f"--pattern: {e}") from None
    try:
        check_pattern_layout(a.pattern, a.sparsity, layout)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if a.timing_tokens is not None and not a.only_if_faster:
        raise UsageError("--timing-tokens only applies with --only-if-faster")
    if a.data is not None:
        if a.method == "magnitude" and not a.recover:
            raise UsageError(
                "--data only applies with --method wanda or sparsegpt, or with --recover "
                "(magnitude needs no calibration)"
            )
        if not Path(a.data).exists():
            raise UsageError(f"--data {a.data!r} does not exist")
    if Path(a.out).exists() and not Path(a.out).is_dir():
        raise UsageError(f"--out {a.out!r} exists and is not a directory")
    only_if_faster = (a.timing_tokens or True) if a.only_if_faster else False
    _quiet_transformers()
    print(f"pruning {a.model} with {a.method} to {a.sparsity:.0%} ({a.pattern}, layout {layout}) ...", flush=True)
    rows = prune_model_dir(
        a.model,
        a.out,
        method=a.method,
        sparsity=a.sparsity,
        pattern=a.pattern,
        layout=layout,
        calib=a.calib,
        only_if_faster=only_if_faster,
        data=a.data,
        recover_seconds=a.recover,
        recover_autocast=torch.bfloat16 if a.recover_bf16 else None,
    )
    print(format_report(rows))
    print(f"saved {Path(a.out) / CHECKPOINT} ({os.path.getsize(Path(a.out) / CHECKPOINT) / 2**20:.1f} MiB)")
    return 0


def _cmd_prune_target(a: argparse.Namespace) -> int:
    """``sparsa prune --target-quality Q``: search, report, write the fastest passing configuration."""
    import torch

    from .frontier import pattern_config
    from .nn.report import format_report
    from .prune import CHECKPOINT, TargetNotReached, is_causal_lm, search_target_quality

    for flag, given in (
        ("--sparsity", a.sparsity is not None),
        ("--layout", a.layout is not None),
        ("--only-if-faster", a.only_if_faster),
        ("--timing-tokens", a.timing_tokens is not None),
    ):
        if given:
            raise UsageError(
                f"{flag} cannot be combined with --target-quality (the search chooses the sparsity and "
                "layout); drop one of them"
            )
    if is_causal_lm(a.model):
        raise UsageError(
            "--target-quality is not supported for causal LMs yet (it scores sentence embeddings of "
            "encoders such as BERT or MiniLM); prune with --sparsity instead"
        )
    patterns = [p.strip() for p in a.pattern.split(",") if p.strip()] if a.pattern else None
    for p in patterns or ():
        try:
            pattern_config(p, 0.5)
        except ValueError as e:
            raise UsageError(f"--pattern: {e}") from None
    if a.min_speedup is not None and not 0.0 < a.min_speedup < float("inf"):
        raise UsageError(
            f"--min-speedup {a.min_speedup:g}: give a positive speed-up over the best dense path (e.g. 1.0)"
        )
    if a.data is not None and not Path(a.data).exists():
        raise UsageError(f"--data {a.data!r} does not exist")
    if Path(a.out).exists() and not Path(a.out).is_dir():
        raise UsageError(f"--out {a.out!r} exists and is not a directory")
    _quiet_transformers()
    try:
        res = search_target_quality(
            a.model,
            a.out,
            a.target_quality,
            method=a.method,
            data=a.data,
            patterns=patterns,
            calib=a.calib,
            use_compile=not a.no_compile,
            recover_seconds=a.recover,
            recover_autocast=torch.bfloat16 if a.recover_bf16 else None,
            min_speedup=a.min_speedup,
        )
    except TargetNotReached as e:
        print(e.result.table())
        print(e.result.summary() + f"; {a.out} not written", file=sys.stderr)
        return 1
    print(res.table())
    print(res.summary())
    print(format_report(res.report))
    print(f"saved {Path(a.out) / CHECKPOINT} ({os.path.getsize(Path(a.out) / CHECKPOINT) / 2**20:.1f} MiB)")
    return 0


class _TokenTimer:
    """A ``generate`` streamer noting when the prompt and each new token arrive (batch of one)."""

    def __init__(self) -> None:
        self.times: List[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _cmd_generate(a: argparse.Namespace) -> int:
    import torch

    from .prune import _TOKENIZER_FILES, is_causal_lm, load_pruned

    _check_model_dir(a.model)
    if not is_causal_lm(a.model):
        raise UsageError(
            f"MODEL_DIR {a.model!r} is not a causal LM (its config.json architectures must end "
            "in ForCausalLM, e.g. LlamaForCausalLM)"
        )
    if not any((Path(a.model) / f).is_file() for f in _TOKENIZER_FILES):
        raise UsageError(f"MODEL_DIR {a.model!r} has no tokenizer files")
    if not a.prompt.strip():
        raise UsageError("--prompt is empty")
    from transformers import AutoTokenizer

    _quiet_transformers()
    torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(a.model, local_files_only=True)
    model = load_pruned(a.model)
    dtype = getattr(torch, a.dtype)
    model = model.to(dtype)
    from .nn.fused_projections import fuse_projections

    fuse_projections(model)  # q/k/v and gate/up as one sparse product each: fewer fixed costs per token
    enc = tok(a.prompt, return_tensors="pt")
    ids = enc["input_ids"]
    if ids.shape[1] == 0:
        raise UsageError(f"--prompt {a.prompt!r} encodes to no tokens")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    timer = _TokenTimer()
    kw = dict(do_sample=False, use_cache=True, pad_token_id=pad)
    if a.compile:
        from .models.compiled_decode import compiled_generate_kwargs

        kw.update(compiled_generate_kwargs())
    with torch.inference_mode():
        # warm-up: lazy initialisation, kernel builds and compiling stay out of the timing. A compiled step
        # is specialised to the static cache's length (prompt + new tokens), so its warm-up is the same call.
        if a.compile:
            model.generate(
                input_ids=ids, attention_mask=enc.get("attention_mask"), max_new_tokens=a.max_new_tokens, **kw
            )
        else:
            model.generate(input_ids=ids[:, :8], max_new_tokens=2, **kw)
        out = model.generate(
            input_ids=ids,
            attention_mask=enc.get("attention_mask"),
            max_new_tokens=a.max_new_tokens,
            streamer=timer,
            **kw,
        )
    new = out[0, ids.shape[1] :]
    full = tok.decode(out[0], skip_special_tokens=True)
    head = tok.decode(ids[0], skip_special_tokens=True)
    print(a.prompt + (full[len(head) :] if full.startswith(head) else " " + tok.decode(new, skip_special_tokens=True)))
    # times[0]: the prompt, handed over just before its forward pass; times[k]: new token k
    n = len(timer.times) - 1
    prefill_ms = (timer.times[1] - timer.times[0]) * 1e3 if n >= 1 else float("nan")
    decode = (
        f"decode {(n - 1) / (timer.times[-1] - timer.times[1]):.1f} tokens/s ({n - 1} tokens after the first)"
        if n >= 2
        else "decode n/a (one new token)"
    )
    how = f"{a.dtype}, compiled" if a.compile else a.dtype
    print(f"prefill {prefill_ms:.1f} ms ({ids.shape[1]} prompt tokens), {decode}; {a.threads} threads, {how}")
    return 0


def _cmd_inspect(a: argparse.Namespace) -> int:
    from .io import load_state
    from .nn.report import _row, format_report
    from .prune import CHECKPOINT

    path = Path(a.checkpoint)
    if path.is_dir():
        path = path / CHECKPOINT
    if not path.is_file():
        raise UsageError(
            f"CHECKPOINT {a.checkpoint!r}: no such file (expected a .safetensors file or a "
            f"directory containing {CHECKPOINT})"
        )
    state = load_state(str(path))
    rows = [_row(k, v, "weight") for k, v in state.items()]
    print(format_report(rows))
    print(f"file size: {path.stat().st_size / 2**20:.2f} MiB")
    return 0


def _cmd_bench(a: argparse.Namespace) -> int:
    root = Path(__file__).resolve().parents[1] / "benchmarks"
    script = root / BENCHES[a.which]
    if not script.is_file():
        raise UsageError(f"benchmark script {script} not found: `sparsa bench` needs a source checkout of sparsa")
    cmd = [sys.executable, str(script)] + (["--quick"] if a.quick else [])
    rc = subprocess.call(cmd, cwd=str(root.parent))
    if rc == 0 and (root / "plots.py").is_file():
        rc = subprocess.call([sys.executable, str(root / "plots.py")], cwd=str(root.parent))
    return rc


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "demo":  # `sparsa demo ANY OPTIONS` gets the one line saying where it went
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    cmd = {
        "demo": _cmd_demo,
        "prune": _cmd_prune,
        "generate": _cmd_generate,
        "inspect": _cmd_inspect,
        "bench": _cmd_bench,
        "cost": _cmd_cost,
    }[args.command]
    try:
        return cmd(args)
    except UsageError as e:
        parser.exit(2, f"sparsa: error: {e}\n")
    except KeyboardInterrupt:
        parser.exit(130, "sparsa: interrupted\n")
    except Exception as e:  # one line, no traceback, unless --debug
        if args.debug:
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        parser.exit(1, f"sparsa: error: {msg} ({type(e).__name__}; rerun with --debug for the traceback)\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
