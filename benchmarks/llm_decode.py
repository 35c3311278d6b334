"""Sparse LLM decoding on the CPU: Llama-architecture models with bitmask weights against dense PyTorch.

Random-initialised ``LlamaForCausalLM`` configs of about 0.5B and 1B parameters (speed does not depend
on the values, only on the pattern's density). The decoder blocks' linears are pruned per row by
magnitude to each sparsity (and 2:4), stored in the ``bitmask`` layout; embeddings and ``lm_head`` stay
dense. For every model, dtype and batch, one process times side by side (round robin, warm-up first,
medians):

- **decode**: steps of one new token per sequence on a KV cache holding the prompt (the cache is cut back
  after each round, so every round decodes the same positions), lm_head and sampling included;
- **prefill**: the forward of the whole prompt up to the next token's logits (``logits_to_keep=1``, as
  ``generate()`` runs it: ``lm_head`` on the last position only).

Engines: dense in the same dtype (``F.linear``, oneDNN/MKL), ``torch.compile`` of the dense model's
decode step (``--compile``; one whole graph on a static KV cache, as ``generate()`` runs it with
``sparsa.models.compiled_decode.compiled_generate_kwargs()``), and bitmask at each sparsity, eager and
(``--compile-sparse``) compiled the same way. The dense model in every other dtype of
:data:`REFERENCE_DTYPES` (eager, and compiled where the same dtype is) runs in the same round robin as a
reference, whatever ``--dtypes`` asks for. Rows (of the asked dtypes only): ``model, params, dtype, layout,
sparsity, batch, phase, ms, tokens_per_s, speedup_vs_dense, speedup_vs_best_dense,
speedup_vs_best_dense_same_dtype, best_dense, weight_bytes_ratio``. ``speedup_vs_dense`` is against dense
eager in the row's dtype; ``speedup_vs_best_dense`` against the fastest dense path timed with it, in any
dtype (``best_dense`` names it, e.g. ``bfloat16 compiled``); ``..._same_dtype`` against the faster of
dense eager and compiled in the row's dtype. The JSON also has the CPU,
threads, peak RSS, where a batch-1 decode step's time goes (``breakdown``: block linears, ``lm_head``, the
rest) and, when ``llm_quality.json`` exists beside it, the perplexity table.

    python benchmarks/llm_decode.py --quick     # 0.5B, fp32, batch 1, 50% and 2:4: about 2-3 minutes
    python benchmarks/llm_decode.py             # 0.5B and 1B, fp32 and bf16, batch 1 and 4 (long)

Writes ``benchmarks/results/<cpu class>/llm_decode.json`` (``--out`` or ``$SPARSA_RESULTS_DIR`` move it).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sparsa  # noqa: E402
from sparsa.models.causal_lm import kv_cache_kwargs  # noqa: E402
from sparsa.models.compiled_decode import compile_decode_step, static_cache  # noqa: E402
from sparsa.sparsifiers import NM, Magnitude  # noqa: E402
from sparsa.timing import round_robin_ms  # noqa: E402
from _compile import compile_many_models  # noqa: E402
from _results import results_dir  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: the dtypes whose dense model every round robin times: a sparse model's speed-up counts against the
#: fastest dense path of the machine, and on a CPU without bf16 hardware that is often dense bf16 decoding
#: (half the bytes of fp32), not the fp32 model a sparse fp32 model was pruned from
REFERENCE_DTYPES = (torch.float32, torch.bfloat16)

#: how the ``+compiled`` / ``dense_compiled`` engines run (recorded in the JSON)
COMPILED = "torch.compile of the whole decode step (fullgraph, static shapes) on a StaticCache; prefill eager"

#: (hidden, intermediate, layers, heads, kv heads, vocab): Llama-style shapes
CONFIGS = {
    "llama-0.5b": (1536, 4096, 16, 12, 4, 32000),
    "llama-1b": (2048, 8192, 16, 32, 8, 32000),
}


def build_model(name: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    h, i, n, heads, kv, vocab = CONFIGS[name]
    cfg = LlamaConfig(
        hidden_size=h,
        intermediate_size=i,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


def linear_bytes(model) -> int:
    """Bytes of the decoder blocks' linear weights (what decoding streams besides lm_head)."""
    total = 0
    for n, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and n.startswith("model.layers"):
            w = m.weight
            total += w.sparse_layout.nbytes if isinstance(w, sparsa.SparseTensor) else w.numel() * w.element_size()
    return total


def prune_copy(dense, spec: str):
    """A bitmask copy of ``dense``'s block linears: ``spec`` is a sparsity ("0.5") or "2:4". Each block's
    q/k/v and gate/up projections run as one product (``sparsa.fuse_projections``), as ``sparsa generate``
    runs them."""
    import copy

    sparsifier = NM(2, 4) if spec == "2:4" else Magnitude(float(spec), per="row")
    model = copy.deepcopy(dense)
    sparsa.sparsify(
        model,
        [sparsa.Rule(sparsifier=sparsifier, layout="bitmask", names="model.layers.*", module_types=torch.nn.Linear)],
    )
    sparsa.fuse_projections(model)
    return model


def decode_fn(model, batch: int, prompt: int, steps: int, forward=None) -> Callable[[], None]:
    """``steps`` greedy decode steps on a cache holding ``prompt`` tokens, cut back afterwards. With a
    compiled ``forward`` (:func:`compiled_decode`) the cache is static (``prompt + steps`` positions), as
    ``generate()`` runs a compiled step; eager steps use the dynamic cache ``generate()`` uses by default."""
    from transformers import DynamicCache

    fwd = forward or model
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache() if forward is None else static_cache(model, prompt + steps)
    kv = kv_cache_kwargs(model, cache)
    with torch.no_grad():
        out = model(ids, use_cache=True, **kv)
    first = out.logits[:, -1:].argmax(-1)

    def run():
        tok = first
        with torch.no_grad():
            for _ in range(steps):
                tok = fwd(tok, use_cache=True, **kv).logits[:, -1:].argmax(-1)
        cache.crop(-steps)

    return run


def prefill_fn(model, batch: int, prompt: int) -> Callable[[], None]:
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(1))

    def run():
        with torch.no_grad():
            model(ids, use_cache=True, logits_to_keep=1)

    return run


def decode_breakdown(model, batch: int, prompt: int, steps: int) -> Dict[str, float]:
    """Milliseconds per decode step spent in the decoder blocks' linears, in ``lm_head`` and in the rest
    (attention, norms, sampling, Python), from forward hooks on every ``nn.Linear`` over one warm pass.
    Run apart from the timed rounds: the hooks add a few microseconds per linear."""
    spent = {"block_linears": 0.0, "lm_head": 0.0}
    handles = []

    def pre(mod, args):
        mod._sparsa_t0 = time.perf_counter()

    for n, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            part = "lm_head" if n == "lm_head" else "block_linears"

            def post(mod, args, out, part=part):
                spent[part] += time.perf_counter() - mod._sparsa_t0

            handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    try:
        run = decode_fn(model, batch, prompt, steps)
        run()  # warm-up
        spent.update(block_linears=0.0, lm_head=0.0)
        t0 = time.perf_counter()
        run()
        total = time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()
    ms = {k: round(v / steps * 1e3, 2) for k, v in spent.items()}
    ms["token"] = round(total / steps * 1e3, 2)
    ms["rest"] = round(ms["token"] - ms["block_linears"] - ms["lm_head"], 2)
    return ms


def compiled_decode(model):
    """The compiled decode step (``torch.compile`` of the model's forward, whole graph, static shapes, for a
    static KV cache: :mod:`sparsa.models.compiled_decode`), or None with the reason."""
    try:
        return compile_decode_step(model), None
    except Exception as e:  # pragma: no cover - depends on the torch build
        return None, f"{type(e).__name__}: {e}"[:300]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def dense_references(name: str, use_compile: bool, notes: Dict[str, str]) -> Dict[torch.dtype, tuple]:
    """The dense model of ``name`` in every :data:`REFERENCE_DTYPES` dtype, with its compiled forward
    (None without ``use_compile`` or where compiling fails): ``{dtype: (model, compiled_forward)}``."""
    refs = {}
    for dt in REFERENCE_DTYPES:
        model = build_model(name, dt)
        comp = None
        if use_compile:
            comp, why = compiled_decode(model)
            if why:
                notes[f"{name}/{dtype_name(dt)}/compile"] = why
        refs[dt] = (model, comp)
    return refs


def dense_label(key: str, dname: str) -> str:
    """``"float32 eager"`` for the round robin's ``"dense"`` key of a float32 pass, ``"bfloat16 compiled"``
    for ``"dense@bfloat16+compiled"``, and so on."""
    if key.startswith("dense@"):
        other, _, compiled = key[len("dense@") :].partition("+")
        return f"{other} {'compiled' if compiled else 'eager'}"
    return f"{dname} {'compiled' if key == 'dense_compiled' else 'eager'}"


def _timed(label: str, make_fn: Callable[[], Callable[[], None]], fns: Dict, notes: Dict[str, str], key: str):
    """``fns[label] = make_fn()`` after one untimed call (compiles outside the timing); a failure is a note."""
    t0 = time.perf_counter()
    try:
        fn = make_fn()
        fn()
        fns[label] = fn
        notes[f"{key}_s"] = f"{time.perf_counter() - t0:.1f}"
    except Exception as e:  # pragma: no cover - depends on torch/transformers
        notes[key] = f"{type(e).__name__}: {e}"[:300]


def bench_model(
    name: str,
    dtype: torch.dtype,
    a,
    specs,
    batches,
    prefill_batches,
    steps: int,
    rounds: int,
    refs: Dict[torch.dtype, tuple],
    notes: Dict[str, str],
    breakdown: List[Dict],
) -> List[Dict]:
    """The rows of one model and dtype (and, with ``--breakdown``, where a batch-1 decode step's time goes,
    appended to ``breakdown``). ``refs``: :func:`dense_references`; the dense models of the other dtypes
    run in every round robin as references. The pruned copies die with this call's frame, so the next
    dtype is built in the memory they held (1B fp32 plus pruned copies is most of 24 GiB)."""
    rows: List[Dict] = []
    dense, comp = refs[dtype]
    others = {dtype_name(dt): ref for dt, ref in refs.items() if dt != dtype}
    params = sum(p.numel() for p in dense.parameters())
    dense_bytes = linear_bytes(dense)
    engines = {"dense": (dense, None, 1.0)}
    for s in specs:
        m = prune_copy(dense, s)
        engines[f"bitmask@{s}"] = (m, s, linear_bytes(m) / dense_bytes)
    dname = dtype_name(dtype)
    if a.breakdown:
        for k, (m, spec, _) in engines.items():
            b = decode_breakdown(m, 1, a.prompt, steps)
            breakdown.append({"model": name, "dtype": dname, "layout": "bitmask" if spec else k, "sparsity": spec, **b})
            print(f"{name} {dname} b1 decode breakdown {k:16s} {b}", flush=True)
    for batch in batches:
        phases = []
        if "decode" in a.phases:
            phases.append(("decode", lambda m, f=None: decode_fn(m, batch, a.prompt, steps, f)))
        if "prefill" in a.phases and batch in prefill_batches:
            phases.append(("prefill", lambda m, f=None: prefill_fn(m, batch, a.prompt)))
        for phase, make in phases:
            fns = {k: make(m) for k, (m, _, _) in engines.items()}
            for oname, (om, _) in others.items():
                fns[f"dense@{oname}"] = make(om)
            if comp is not None and phase == "decode" and batch in a.compile_batches:
                _timed("dense_compiled", lambda: make(dense, comp), fns, notes, f"{name}/{dname}/b{batch}/compile")
                for oname, (om, ocomp) in others.items():
                    if ocomp is not None:
                        key = f"{name}/{oname}/b{batch}/compile_as_reference"
                        _timed(f"dense@{oname}+compiled", lambda om=om, oc=ocomp: make(om, oc), fns, notes, key)
                for s in a.compile_sparse:
                    m = engines[f"bitmask@{s}"][0]
                    key = f"{name}/{dname}/b{batch}/sparse{s}_compile"
                    _timed(
                        f"bitmask@{s}+compiled",
                        lambda m=m: make(m, compile_decode_step(m)),
                        fns,
                        notes,
                        key,
                    )
            # a prefill is seconds long and steadier than a decode step: fewer rounds
            ms = round_robin_ms(fns, rounds if phase == "decode" else min(rounds, 3), min_seconds=0.0)
            per = steps if phase == "decode" else 1
            best_same = min(ms["dense"], ms.get("dense_compiled", float("inf")))
            best_key = min((k for k in ms if k.startswith("dense")), key=lambda k: ms[k])
            for k, t in ms.items():
                if k.startswith("dense@"):  # another dtype's reference: its own pass reports it
                    continue
                base = k.replace("+compiled", "")
                spec = engines[base][1] if base in engines else None
                toks = batch * (steps if phase == "decode" else a.prompt)
                rows.append(
                    {
                        "model": name,
                        "params": params,
                        "dtype": dname,
                        "layout": ("bitmask" if spec else k) + ("+compiled" if spec and base != k else ""),
                        "sparsity": spec,
                        "batch": batch,
                        "phase": phase,
                        "ms": round(t / per, 3),
                        "tokens_per_s": round(toks / (t / 1e3), 2),
                        "speedup_vs_dense": round(ms["dense"] / t, 3),
                        "speedup_vs_best_dense": round(ms[best_key] / t, 3),
                        "speedup_vs_best_dense_same_dtype": round(best_same / t, 3),
                        "best_dense": dense_label(best_key, dname),
                        "weight_bytes_ratio": round(engines[base][2], 4) if base in engines else 1.0,
                    }
                )
                r = rows[-1]
                print(
                    f"{name} {dname} b{batch} {phase:7s} {k:16s} {r['ms']:9.2f} ms  "
                    f"{r['tokens_per_s']:9.1f} tok/s  x{r['speedup_vs_dense']:.2f} vs dense  "
                    f"x{r['speedup_vs_best_dense']:.2f} vs best dense ({r['best_dense']})  "
                    f"bytes {r['weight_bytes_ratio']:.3f}",
                    flush=True,
                )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="0.5B, fp32, batch 1, 50%% and 2:4, fewer rounds")
    p.add_argument("--models", nargs="+", choices=sorted(CONFIGS), default=None)
    p.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--batches", nargs="+", type=int, default=None)
    p.add_argument("--sparsities", nargs="+", default=None, help="fractions and/or 2:4 (default 0.5 0.7 2:4)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=None, help="decode steps per timed round (default 8; quick 4)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5; quick 3)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time torch.compile of the dense decode step (default: on, off with --quick)",
    )
    p.add_argument(
        "--phases",
        nargs="+",
        choices=["decode", "prefill"],
        default=["decode", "prefill"],
        help="what to time (default both; e.g. --phases prefill --append re-measures the prefill rows)",
    )
    p.add_argument(
        "--prefill-batches",
        nargs="*",
        type=int,
        default=None,
        help="batches whose prefill is timed too (default: batch 1 only; none: decode only)",
    )
    p.add_argument(
        "--compile-batches",
        nargs="*",
        type=int,
        default=[1],
        help="batches whose decode is also timed under torch.compile (default: 1)",
    )
    p.add_argument(
        "--compile-sparse",
        nargs="*",
        default=None,
        help="sparsities (as in --sparsities) whose bitmask model is also timed compiled (decode; default: "
        "all of them where the dense decode step is compiled, none with --no-compile)",
    )
    p.add_argument(
        "--append",
        action="store_true",
        help="merge into an existing JSON (rows of the same model, dtype, batch, phase and engine replaced)",
    )
    p.add_argument(
        "--breakdown",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also split a batch-1 decode step into block linears, lm_head and the rest (one hooked pass "
        "per engine, apart from the timing; default on)",
    )
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    compile_many_models()
    q = a.quick
    models = a.models or (["llama-0.5b"] if q else ["llama-0.5b", "llama-1b"])
    dtypes = [getattr(torch, d) for d in (a.dtypes or (["float32"] if q else ["float32", "bfloat16"]))]
    batches = a.batches or ([1] if q else [1, 4])
    specs = a.sparsities or (["0.5", "2:4"] if q else ["0.5", "0.7", "2:4"])
    for s in specs:
        if s != "2:4":
            sparsa.layouts.base.check_fraction(float(s), "--sparsities")
    steps, rounds = a.steps or (4 if q else 8), a.rounds or (3 if q else 5)
    use_compile = (not q) if a.compile is None else a.compile
    if a.compile_sparse is None:  # the sparse models compiled as the dense one is: best path against best path
        a.compile_sparse = list(specs) if use_compile else []
    prefill_batches = [1] if a.prefill_batches is None else a.prefill_batches
    torch.set_num_threads(a.threads)
    out = a.out or results_dir() / "llm_decode.json"
    rows: List[Dict] = []
    breakdown: List[Dict] = []
    notes: Dict[str, str] = {}
    t_start = time.time()
    # every model's forward shares one code object: the dense references of both dtypes and the compiled
    # sparse models of a model are each a recompile of it
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
    for name in models:
        refs = dense_references(name, use_compile, notes)
        for dtype in dtypes:
            rows += bench_model(name, dtype, a, specs, batches, prefill_batches, steps, rounds, refs, notes, breakdown)
            gc.collect()
        del refs
        gc.collect()
        torch._dynamo.reset()  # compiled graphs hold the weights they were traced with
    res = {
        "benchmark": "llm_decode",
        "cpu": sparsa.cpu.cpu_info(),
        "threads": a.threads,
        "prompt": a.prompt,
        "decode_steps_per_round": steps,
        "rounds": rounds,
        "quick": q,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "seconds": round(time.time() - t_start, 1),
        "compiled": COMPILED,
        "notes": notes,
        "rows": rows,
        "breakdown": breakdown,
        "breakdown_note": "ms per batch-1 decode step from forward hooks on every nn.Linear (one warm pass per "
        "engine, eager, apart from the timed rounds): block_linears, lm_head (dense in every engine), rest = "
        "token - both (attention, norms, sampling, Python)",
    }
    if a.append and out.is_file():
        old = json.loads(out.read_text())
        key = lambda r: (r["model"], r["dtype"], r["batch"], r["phase"], r["layout"], r["sparsity"])  # noqa: E731
        mine = {key(r) for r in rows}
        # rows without best_dense predate the cross-dtype reference: their speedup_vs_best_dense meant
        # something else, so they are dropped rather than mixed in
        kept = [r for r in old.get("rows", []) if key(r) not in mine and "best_dense" in r]
        if len(kept) + len(mine) < len(old.get("rows", [])):
            print("--append: dropped rows measured without the cross-dtype dense reference", flush=True)
        res["rows"] = kept + rows
        res["notes"] = {**old.get("notes", {}), **notes}
        res["seconds"] = round(old.get("seconds", 0) + res["seconds"], 1)
        res["peak_rss_mb"] = max(old.get("peak_rss_mb", 0), res["peak_rss_mb"])
        bkey = lambda r: (r["model"], r["dtype"], r["layout"], r["sparsity"])  # noqa: E731
        fresh = {bkey(r) for r in breakdown}
        res["breakdown"] = [r for r in old.get("breakdown", []) if bkey(r) not in fresh] + breakdown
        if "reruns" in old:  # the hand-written record of which rows were re-measured, and why
            res["reruns"] = old["reruns"]
    quality = out.parent / "llm_quality.json"
    if quality.is_file():
        res["perplexity"] = json.loads(quality.read_text()).get("rows", [])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"wrote {out} ({res['seconds']} s, peak RSS {res['peak_rss_mb']} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
