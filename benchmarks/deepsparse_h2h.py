"""Head to head with Neural Magic's DeepSparse: BERT-base inference on the same pruned weights.

BERT-base (transformers ``BertModel(BertConfig())``, eager attention, random weights, seed 0) is
pruned once per sparsity: every encoder Linear (72 of them) by row-balanced magnitude
(``sparsa.sparsifiers.Magnitude(s, per="row")``: each output row keeps the same number of weights).
Those exact pruned fp32 weights are then run by every engine, all timed round robin in this one
process (warm-up first, median of the rounds) for each sparsity and batch:

- ``pytorch_dense_fp32`` / ``pytorch_dense_bf16``: the pruned model as plain dense PyTorch eager
  (bf16: ``model.to(torch.bfloat16)``, so the weights are those values rounded to bf16);
- ``deepsparse``: the pruned model exported to ONNX (``torch.onnx.export(..., dynamo=False,
  opset_version=14)``, keyword inputs) and compiled by ``deepsparse.compile_model(path,
  batch_size=b, num_cores=threads)``;
- ``sparsa_<layout>_fp32`` / ``sparsa_<layout>_bf16``: the pruned model converted by
  ``sparsa.sparsify`` to the layout with the *same* mask (default ``sliced_ell`` and ``bitmask``, sparsa's
  unstructured layouts: sparse compute, and dense AMX tiles on the compressed weight where the CPU has
  AMX; the structured fast layouts ``row_group``/``grouped_nm``/``nm`` cannot hold a
  row-balanced unstructured mask; the pure-PyTorch ``masked``/``csr``/``coo`` can be added with
  ``--layouts``);
- ``sparsa_<layout>_fused_fp32`` / ``_bf16``: the same with GELU in the kernels' epilogue
  (``sparsa.fuse_gelu``) and query, key and value as one product (``sparsa.fuse_projections``); runs
  before the q/k/v product named these ``sparsa_<layout>_gelu_fused_*`` (GELU only);
- ``..._compiled``: ``torch.compile(model, dynamic=False)`` of dense PyTorch and of each layout (its fused
  model where it has one), in bf16 where the CPU has bf16 matrix hardware (AVX512-BF16 or AMX), else fp32;
  compiled for each batch in the output check, before timing (``--no-compile`` leaves them out).

Inputs: random token ids, an all-ones attention mask and zero token types, seq 128. Every engine's
``last_hidden_state`` is checked against the pruned dense fp32 model (``max_rel_err`` = max abs
difference / max abs reference; bf16 engines get a looser bound); a check that fails is printed,
recorded, and makes the script exit 1 after writing the JSON. The DeepSparse engine's status
(version, ISA it detected, fraction of ops it runs itself, compile seconds, or the one-line reason it
could not run on this CPU) is recorded too; when it cannot run, the other engines are still timed.

Writes ``benchmarks/results/<cpu class>/deepsparse_h2h.json`` (``--out`` overrides): a top-level
``cpu`` object (``sparsa.cpu.cpu_info()``) and ``rows`` of ``engine, sparsity, batch, seq,
threads, median_ms, speedup_vs_fp32_eager, speedup_vs_best_dense, max_rel_err, weights``
(``weights``: sha256 prefix of the pruned fp32 state dict that engine was built from, and the
precision it ran in; ``speedup_vs_best_dense`` is against the fastest dense PyTorch row, compiled included).

DeepSparse 1.8.0 needs ``onnx<1.15`` (1.9.0 is a placeholder release that refuses to install), which
conflicts with the project's pins, so this runs from its own virtual environment
``.venv-deepsparse`` (sparsa installed editable into it). It is not part of ``make test``::

    make deepsparse-venv      # once: creates .venv-deepsparse (downloads deepsparse, onnx, ...)
    make bench-deepsparse     # full run: sparsities 0.75 and 0.9, batch 8 and 1, 2 threads
    NM_DISABLE_ANALYTICS=1 .venv-deepsparse/bin/python benchmarks/deepsparse_h2h.py --quick --out /tmp/h2h.json
    flock /tmp/sparsa-bench.lock .venv-deepsparse/bin/python benchmarks/deepsparse_h2h.py --sparsities 0.9 --batches 8

Run without those packages (e.g. with ``.venv``'s python), it prints how to create the venv and exits 0.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

os.environ.setdefault("NM_DISABLE_ANALYTICS", "1")  # no usage telemetry from deepsparse / sparsezoo
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
NEEDED = ("deepsparse", "onnx", "transformers", "torch")
SEQ = 128
VOCAB = 30522
#: max_rel_err bounds against the pruned dense fp32 model
TOL_FP32 = 1e-3
TOL_BF16 = 0.1


def _missing_packages() -> List[str]:
    return [p for p in NEEDED if importlib.util.find_spec(p) is None]


def _parse_floats(s: str) -> List[float]:
    return [float(v) for v in s.split(",") if v.strip()]


def _parse_ints(s: str) -> List[int]:
    return [int(v) for v in s.split(",") if v.strip()]


def _args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small run: sparsity 0.9, batch 1, 3 rounds")
    ap.add_argument("--sparsities", type=_parse_floats, default=None, help="comma list (default 0.75,0.9)")
    ap.add_argument("--batches", type=_parse_ints, default=None, help="comma list (default 8,1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per engine (default 7; quick 3)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls per engine before timing")
    ap.add_argument(
        "--layouts",
        default="sliced_ell,bitmask",
        help="comma list of sparsa layouts that can hold the exact mask: sliced_ell and bitmask (default), "
        "and the pure-PyTorch masked, coo, csr (csr: fp32 only)",
    )
    ap.add_argument("--no-deepsparse", action="store_true", help="skip the DeepSparse engine")
    ap.add_argument(
        "--no-compile", action="store_true", help="skip the torch.compile engines (about a minute each per batch)"
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="JSON path (default benchmarks/results/<cpu class>/deepsparse_h2h.json)"
    )
    a = ap.parse_args(argv)
    if a.sparsities is None:
        a.sparsities = [0.9] if a.quick else [0.75, 0.9]
    if a.batches is None:
        a.batches = [1] if a.quick else [8, 1]
    if a.rounds is None:
        a.rounds = 3 if a.quick else 7
    a.layouts = [s.strip() for s in a.layouts.split(",") if s.strip()]
    for s in a.sparsities:
        if not 0.0 <= s < 1.0:
            ap.error(f"--sparsities: {s} is not in [0, 1)")
    if not a.batches or min(a.batches) < 1:
        ap.error("--batches: positive integers, e.g. 8,1")
    return a


# ---------------------------------------------------------------------------------------------- model
def _dense_model():
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig()
    cfg._attn_implementation = "eager"  # plain matmul + softmax attention: what the ONNX export traces
    model = BertModel(cfg).eval()
    return model


def _encoder_linears(model) -> List[str]:
    import torch.nn as nn

    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layer." in n]


def _prune(dense, sparsity: float):
    """A pruned copy (row-balanced magnitude on every encoder Linear) and its masks by module name."""
    import torch
    from sparsa.sparsifiers import Magnitude

    model = copy.deepcopy(dense)
    sparsifier = Magnitude(sparsity, per="row")
    masks = {}
    with torch.no_grad():
        for name in _encoder_linears(model):
            w = model.get_submodule(name).weight
            m = sparsifier.mask(w)
            kept = m.sum(1)
            if not bool((kept == kept[0]).all()):  # pragma: no cover - a sparsifier bug guard
                raise RuntimeError(f"{name}: rows keep different counts ({int(kept.min())}..{int(kept.max())})")
            w.mul_(m)
            masks[name] = m
    return model, masks


def _digest(model) -> str:
    """sha256 of the model's state dict (names, dtypes, shapes and bytes), in key order."""
    import torch

    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        t = v.detach().contiguous().cpu()
        h.update(f"{k}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _exact_mask_sparsifier(mask):
    """A sparsa sparsifier that returns ``mask`` (so a layout stores exactly the pruned pattern)."""
    from sparsa.sparsifiers import Sparsifier

    class ExactMask(Sparsifier):
        name = "exact_mask"

        def _mask(self, dense):
            if dense.shape != mask.shape:
                raise ValueError(f"ExactMask: weight {tuple(dense.shape)} vs mask {tuple(mask.shape)}")
            return mask.clone()

    return ExactMask()


def _sparsa_model(pruned, masks: Dict[str, Any], layout: str):
    """``pruned`` converted by sparsa.sparsify to ``layout`` with the given masks; checks the stored
    weights equal the pruned dense ones exactly."""
    import torch
    import sparsa

    model = copy.deepcopy(pruned)
    rules = [
        sparsa.Rule(sparsifier=_exact_mask_sparsifier(m), layout=layout, names=[name]) for name, m in masks.items()
    ]
    sparsa.sparsify(model, rules)
    for name, m in masks.items():
        w = model.get_submodule(name).weight
        if not isinstance(w, sparsa.SparseTensor):
            raise RuntimeError(f"{layout}: {name}.weight stayed dense")
        if not torch.equal(w.sparse_layout.to_dense(), pruned.get_submodule(name).weight.detach()):
            raise RuntimeError(f"{layout}: {name}.weight differs from the pruned weight")
        if not torch.equal(w.pattern(), m):
            raise RuntimeError(f"{layout}: {name}.weight does not store the pruned mask")
    return model


def _inputs(batch: int) -> Dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(1000 + batch)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones(batch, SEQ, dtype=torch.long),
        "token_type_ids": torch.zeros(batch, SEQ, dtype=torch.long),
    }


# ---------------------------------------------------------------------------------------------- DeepSparse
def _KeywordCall(model):
    """``model`` called with keyword inputs, returning a plain tuple: what the TorchScript exporter
    traces (handing BertModel's own forward to it directly trips over its many optional arguments)."""
    import torch.nn as nn

    class KeywordCall(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, token_type_ids):
            o = self.inner(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            return o.last_hidden_state, o.pooler_output

    return KeywordCall(model).train(model.training)  # a new Module is in training mode; export restores it


class DeepSparse:
    """Export + compile, remembering why it could not run (one line) instead of raising."""

    def __init__(self, enabled: bool, threads: int, workdir: Path):
        self.threads = threads
        self.workdir = workdir
        self.status: Dict[str, Any] = {"status": "skipped (--no-deepsparse)"} if not enabled else {}
        self.ok = enabled
        if enabled:
            try:
                import deepsparse

                self.status.update({"version": deepsparse.__version__, "status": "ok", "engines": []})
            except Exception as e:  # the engine refuses unsupported CPUs at import
                self._fail("import", e)

    def _fail(self, stage: str, e: BaseException) -> None:
        msg = " ".join(f"{type(e).__name__}: {e}".split())[:400]
        self.ok = False
        self.status["status"] = "unavailable"
        self.status["reason"] = f"{stage}: {msg}"
        print(f"DeepSparse not timed ({stage} failed): {msg} -- timing the other engines only", flush=True)

    def export(self, pruned, sparsity: float) -> Optional[Path]:
        if not self.ok:
            return None
        import torch

        path = self.workdir / f"bert_{int(round(sparsity * 100))}.onnx"
        try:
            t0 = time.perf_counter()
            kw = _inputs(1)
            with warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore")
                torch.onnx.export(
                    _KeywordCall(pruned),
                    (),
                    str(path),
                    kwargs=kw,
                    dynamo=False,
                    opset_version=14,
                    input_names=list(kw),
                    output_names=["last_hidden_state", "pooler_output"],
                    dynamic_axes={k: {0: "batch"} for k in list(kw) + ["last_hidden_state", "pooler_output"]},
                    do_constant_folding=True,
                )
            pruned.eval()
            zeros = _onnx_zero_count(path)
            print(
                f"  exported ONNX ({path.stat().st_size / 2**20:.0f} MiB, {zeros} zero weights) "
                f"in {time.perf_counter() - t0:.1f} s",
                flush=True,
            )
            self.status.setdefault("onnx_zero_weights", {})[str(sparsity)] = zeros
            return path
        except Exception as e:
            self._fail("onnx export", e)
            return None

    def compile(self, path: Optional[Path], sparsity: float, batch: int):
        if not self.ok or path is None:
            return None
        try:
            from deepsparse import compile_model

            t0 = time.perf_counter()
            engine = compile_model(str(path), batch_size=batch, num_cores=self.threads)
            dt = time.perf_counter() - t0
            info = {
                "sparsity": sparsity,
                "batch": batch,
                "compile_s": round(dt, 1),
                "cpu_avx_type": getattr(engine, "cpu_avx_type", None),
                "cpu_vnni": getattr(engine, "cpu_vnni", None),
                "fraction_of_supported_ops": getattr(engine, "fraction_of_supported_ops", None),
                "num_cores": getattr(engine, "num_cores", None),
            }
            self.status["engines"].append(info)
            print(
                f"  DeepSparse compiled for batch {batch} in {dt:.1f} s ({info['cpu_avx_type']}, "
                f"fraction of ops supported {info['fraction_of_supported_ops']})",
                flush=True,
            )
            return engine
        except Exception as e:
            self._fail("compile", e)
            return None


def _onnx_zero_count(path: Path) -> int:
    """Exact zeros in the ONNX model's 2-D float initializers (the Linear weights)."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(path))
    n = 0
    for init in m.graph.initializer:
        if len(init.dims) == 2 and init.data_type == onnx.TensorProto.FLOAT:
            n += int((numpy_helper.to_array(init) == 0).sum())
    return n


def _compiled(models: Dict[str, Tuple[Any, str]], layouts: List[str], cpu) -> Dict[str, Tuple[Any, str]]:
    """``torch.compile`` of dense PyTorch and of each layout (fused where it fuses) in bf16 where the CPU has
    bf16 matrix hardware, else fp32; each compiles on its first call (the output check, untimed)."""
    import torch

    flags = cpu.cpu_flags()
    prec = "bf16" if flags.get("avx512_bf16") or flags.get("amx_bf16") else "fp32"
    out = {}
    sources = {"pytorch_dense": f"pytorch_dense_{prec}"}
    for layout in layouts:
        fused = f"sparsa_{layout}_fused_{prec}"
        sources[f"sparsa_{layout}"] = fused if fused in models else f"sparsa_{layout}_{prec}"
    for name, src in sources.items():
        if src in models:
            out[f"{name}_{prec}_compiled"] = (torch.compile(models[src][0], dynamic=False), prec)
    return out


def _deepsparse_fn(engine, kw: Dict[str, Any]) -> Callable[[], Any]:
    import numpy as np

    names = list(getattr(engine, "input_names", None) or kw)
    arrays = [np.ascontiguousarray(kw[n].numpy()) for n in names]
    return lambda: engine.run(arrays)


# ---------------------------------------------------------------------------------------------- main
def _rel_err(out, ref) -> float:
    import torch

    out = torch.as_tensor(out).float()
    return float((out - ref).abs().max() / ref.abs().max())


def run(a: argparse.Namespace) -> int:
    import torch
    import sparsa
    from sparsa import cpu
    from sparsa.timing import round_robin_ms

    warnings.simplefilter("ignore")
    torch.set_num_threads(a.threads)
    t_start = time.perf_counter()
    out_path = a.out or (RESULTS / cpu.cpu_class() / "deepsparse_h2h.json")
    versions = {"torch": torch.__version__, "sparsa": sparsa.__version__, "python": sys.version.split()[0]}
    for p in ("transformers", "onnx", "deepsparse", "numpy"):
        try:
            versions[p] = __import__(p).__version__
        except Exception:
            versions[p] = None
    dense = _dense_model()
    names = _encoder_linears(dense)
    print(
        f"BERT-base, {len(names)} encoder Linears, seq {SEQ}, {a.threads} threads, sparsities {a.sparsities}, "
        f"batches {a.batches}, layouts {a.layouts}, {a.rounds} rounds",
        flush=True,
    )
    rows: List[Dict[str, Any]] = []
    weights: Dict[str, Any] = {}
    failures: List[str] = []
    fallbacks: Dict[str, Any] = {}
    skipped: Dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="sparsa-deepsparse-") as tmp:
        ds = DeepSparse(not a.no_deepsparse, a.threads, Path(tmp))
        for sp in a.sparsities:
            t0 = time.perf_counter()
            pruned, masks = _prune(dense, sp)
            digest = _digest(pruned)
            zeros = int(sum(int((~m).sum()) for m in masks.values()))
            weights[str(sp)] = {
                "sha256": digest,
                "encoder_linear_zeros": zeros,
                "encoder_linear_weights": int(sum(m.numel() for m in masks.values())),
            }
            print(
                f"sparsity {sp:.0%}: pruned in {time.perf_counter() - t0:.1f} s, weights sha256 {digest[:16]}",
                flush=True,
            )
            tag = f"sha256:{digest[:16]}"
            models: Dict[str, Tuple[Any, str]] = {
                "pytorch_dense_fp32": (pruned, "fp32"),
                "pytorch_dense_bf16": (copy.deepcopy(pruned).to(torch.bfloat16), "bf16"),
            }
            for layout in a.layouts:
                sm = _sparsa_model(pruned, masks, layout)
                models[f"sparsa_{layout}_fp32"] = (sm, "fp32")
                fused = copy.deepcopy(sm)
                models[f"sparsa_{layout}_bf16"] = (copy.deepcopy(sm).to(torch.bfloat16), "bf16")
                # GELU in the kernel's epilogue where the layout has one, and q/k/v as one product
                if sparsa.fuse_gelu(fused) + sparsa.fuse_projections(fused):
                    models[f"sparsa_{layout}_fused_fp32"] = (fused, "fp32")
                    models[f"sparsa_{layout}_fused_bf16"] = (copy.deepcopy(fused).to(torch.bfloat16), "bf16")
            if not a.no_compile:
                models.update(_compiled(models, a.layouts, cpu))
            onnx_path = ds.export(pruned, sp)
            if onnx_path is not None and ds.status["onnx_zero_weights"][str(sp)] < zeros:
                ds._fail(
                    "onnx export",
                    RuntimeError(
                        f"the ONNX file has {ds.status['onnx_zero_weights'][str(sp)]} zero weights, expected >= {zeros}"
                    ),
                )
            for batch in a.batches:
                kw = _inputs(batch)
                fns: Dict[str, Callable[[], Any]] = {}
                errs: Dict[str, float] = {}
                precision: Dict[str, str] = {}
                with torch.no_grad():
                    ref = pruned(**kw).last_hidden_state.float()
                    sparsa.reset_fallback_counts()
                    for eng, (model, prec) in models.items():
                        try:
                            errs[eng] = _rel_err(model(**kw).last_hidden_state, ref)
                        except Exception as e:  # e.g. a pure-PyTorch layout without a bf16 kernel
                            msg = " ".join(f"{type(e).__name__}: {e}".split())[:300]
                            skipped[f"{eng} sparsity {sp} batch {batch}"] = msg
                            print(f"  {eng} not timed: {msg}", flush=True)
                            continue
                        fns[eng] = lambda m=model: m(**kw)
                        precision[eng] = prec
                    engine = ds.compile(onnx_path, sp, batch)
                    if engine is not None:
                        try:
                            fn = _deepsparse_fn(engine, kw)
                            errs["deepsparse"] = _rel_err(fn()[0], ref)
                            fns["deepsparse"] = fn
                            precision["deepsparse"] = "fp32 (onnx)"
                        except Exception as e:
                            ds._fail("run", e)
                    for eng, fn in fns.items():
                        for _ in range(a.warmup):
                            fn()
                    ms = round_robin_ms(fns, a.rounds)
                    fb = sparsa.fallback_counts()
                    if fb:
                        fallbacks[f"{sp}/{batch}"] = {str(k): v for k, v in dict(fb).items()}
                fp32 = ms["pytorch_dense_fp32"]
                best_dense = min(v for k, v in ms.items() if k.startswith("pytorch_dense_"))
                for eng in fns:
                    tol = TOL_BF16 if precision[eng] == "bf16" else TOL_FP32
                    if not errs[eng] <= tol:
                        failures.append(f"{eng} sparsity {sp} batch {batch}: max_rel_err {errs[eng]:.2e} > {tol:g}")
                        print(f"CHECK FAILED: {failures[-1]}", flush=True)
                    rows.append(
                        {
                            "engine": eng,
                            "sparsity": sp,
                            "batch": batch,
                            "seq": SEQ,
                            "threads": a.threads,
                            "median_ms": round(ms[eng], 2),
                            "speedup_vs_fp32_eager": round(fp32 / ms[eng], 3),
                            "speedup_vs_best_dense": round(best_dense / ms[eng], 3),
                            "max_rel_err": float(f"{errs[eng]:.3g}"),
                            "weights": f"{tag} {precision[eng]}",
                        }
                    )
                    r = rows[-1]
                    print(
                        f"  {eng:>24} {sp:4.0%} batch {batch}: {r['median_ms']:9.2f} ms  "
                        f"{r['speedup_vs_fp32_eager']:5.2f}x vs fp32 eager  {r['speedup_vs_best_dense']:5.2f}x vs "
                        f"best dense  (err {errs[eng]:.1e})",
                        flush=True,
                    )
                del engine
            del models, pruned, masks
    res = {
        "benchmark": "deepsparse_h2h",
        "model": "BertModel(BertConfig()) (BERT-base, random weights, seed 0, eager attention)",
        "pruning": "row-balanced magnitude, sparsa.sparsifiers.Magnitude(s, per='row'), every encoder Linear",
        "inputs": "random token ids, all-ones attention mask, zero token types",
        "timing": f"round robin in one process, {a.warmup} warm-up calls each, median of {a.rounds} rounds",
        "quick": a.quick,
        "seq": SEQ,
        "threads": a.threads,
        "layouts": a.layouts,
        "tolerances": {"fp32": TOL_FP32, "bf16": TOL_BF16},
        "cpu": cpu.cpu_info(),
        "versions": versions,
        "deepsparse": ds.status,
        "weights": weights,
        "sparsa_fallbacks": fallbacks,
        "not_timed": skipped,
        "check_failures": failures,
        "rows": rows,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out_path} in {res['seconds']} s" + (f"; {len(failures)} output checks FAILED" if failures else ""))
    return 1 if failures else 0


def main(argv: Optional[List[str]] = None) -> int:
    a = _args(argv)
    missing = _missing_packages()
    if missing:
        print(
            f"deepsparse_h2h: needs {', '.join(missing)}, kept out of .venv (conflicting pins): create its venv "
            "with `make deepsparse-venv`, then run `make bench-deepsparse`"
        )
        return 0
    sys.path.insert(0, str(ROOT))
    from _compile import compile_many_models

    compile_many_models()
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
