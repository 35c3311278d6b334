"""The bitmask kernels at many tokens (prefill, encoders): each strategy of ``sparsa::bitmask_linear`` on
one weight, against dense ``F.linear`` in every dtype, side by side in one process.

Per weight shape (0.5B Llama and BERT-base linears by default; ``--models llama-1b`` the 1B ones), dtype,
sparsity (a fraction kept per row, or 2:4) and token count, the strategies are timed round-robin with the
dense passes: ``stream`` (up to 24 tokens), ``expand_blocks`` (row blocks at any token count; only where
the GEMM is float32), ``expand_whole`` (the whole weight expanded, one ``F.linear``), ``panel`` (bf16 where
the CPU has AVX512-BF16 + VBMI2; float32 with AVX2 FMAs), ``nm24`` (2:4 bf16 rows where the CPU has
AVX512-BF16: the 2:4 kernel of ``sparsa.kernels.nm24``), ``amx`` (bf16 where the CPU has AMX-BF16: dense
tiles expanded from the weight's rows, :mod:`sparsa.kernels.bitmask_amx`), ``fused`` (float32 where the CPU
has AVX-512: the weight expanded into L1 blocks inside the kernel's GEMM), and ``auto`` (what the op's
automatic choice picks: ``choose_strategy``, and ``nm24`` for 2:4 above the crossover ``nm24.panel_bf16``).
The weight stays in cache between calls: this measures the kernels, not a model's memory traffic
(``llm_decode.py`` does that). Rows: ``shape, dtype, sparsity, tokens, threads, <strategy>_ms,
<strategy>_vs_dense`` (same dtype), ``<strategy>_vs_best_dense``, ``auto_strategy``, ``best_dense``. It
shows the choices the crossovers of ``sparsa.crossovers`` make (``bitmask.stream_*``,
``bitmask.row_blocks_f32``, ``bitmask.fused_f32``, ``bitmask.panel_*``: measured per CPU by ``sparsa cost
--refit``), each against every strategy on the weights of a model.

    python benchmarks/bitmask_prefill.py [--quick]

Writes ``benchmarks/results/<cpu class>/bitmask_prefill.json`` (``--out`` or ``$SPARSA_RESULTS_DIR`` move it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sparsa  # noqa: E402
from sparsa.kernels import bitmask as bm  # noqa: E402
from sparsa.kernels import nm24  # noqa: E402
from sparsa.layouts import Bitmask, nm_mask  # noqa: E402
from sparsa.timing import round_robin_ms  # noqa: E402
from _results import results_dir  # noqa: E402

SHAPES = {
    "llama-0.5b": [(1536, 1536), (512, 1536), (4096, 1536), (1536, 4096)],
    "bert-base": [(768, 768), (3072, 768), (768, 3072)],
    "llama-1b": [(2048, 2048), (512, 2048), (8192, 2048), (2048, 8192)],
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
STREAM_MAX = 24  # the stream kernel re-reads the weight per few tokens: beyond this it only loses


def _strategy(name: str):
    """A call of one strategy (``expand_blocks`` / ``expand_whole`` pin ``row_blocks_max_tokens``)."""

    def call(x, w):
        old = bm.row_blocks_max_tokens
        if name == "expand_blocks":
            bm.row_blocks_max_tokens = lambda: 1 << 62
        elif name == "expand_whole":
            bm.row_blocks_max_tokens = lambda: 0
        try:
            strategy = "expand" if name.startswith("expand") else name
            return bm.bitmask_linear_impl(x, w.bits, w.row_ptr, w.values, None, w.shape[0], strategy)
        finally:
            bm.row_blocks_max_tokens = old

    return call


def _weight(dense: torch.Tensor, spec: str) -> Bitmask:
    if spec == "2:4":
        return Bitmask.from_dense(dense, mask=nm_mask(dense, 2, 4))
    return Bitmask.from_dense(dense, sparsity=float(spec))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="0.5B shapes, bf16, 50/70%%, 128 tokens, 3 rounds")
    ap.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=None)
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=None)
    ap.add_argument("--sparsities", nargs="+", default=None, help="fractions and/or 2:4 (default 0.4 0.5 0.7 2:4)")
    ap.add_argument("--tokens", nargs="+", type=int, default=None, help="default 8 16 128 512 1024")
    ap.add_argument("--rounds", type=int, default=None, help="round-robin rounds (default 5; quick 3)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    models = a.models or (["llama-0.5b"] if a.quick else ["bert-base", "llama-0.5b"])
    dtypes = a.dtypes or (["bfloat16"] if a.quick else ["float32", "bfloat16"])
    specs = a.sparsities or (["0.5", "0.7"] if a.quick else ["0.4", "0.5", "0.7", "2:4"])
    tokens = a.tokens or ([128] if a.quick else [8, 16, 128, 512, 1024])
    rounds = a.rounds if a.rounds is not None else (3 if a.quick else 5)
    for s in specs:
        if s != "2:4" and not 0.0 < float(s) < 1.0:
            raise SystemExit(f"bitmask_prefill: --sparsities takes fractions in (0, 1) or 2:4, got {s!r}")
    if rounds < 1 or min(tokens) < 1:
        raise SystemExit("bitmask_prefill: --rounds and --tokens must be >= 1")
    if bm.native_library() is None:
        raise SystemExit(
            "bitmask_prefill: no native bitmask kernel here (SPARSA_NO_NATIVE is set, or it did not build)"
        )
    torch.set_num_threads(a.threads)
    t_start = time.time()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for model in models:
        for R, K in SHAPES[model]:
            dense32 = torch.randn(R, K, generator=gen)
            for spec in specs:
                for dname in dtypes:
                    dt = DTYPES[dname]
                    w = _weight(dense32.to(dt), spec)
                    wd = {d: w.to_dense().to(DTYPES[d]) for d in DTYPES}  # the pruned weight in every dtype
                    # row blocks run only where the GEMM is float32 (with bf16 hardware a bf16 GEMM takes the whole)
                    blocks = dt == torch.float32 or not bm._bf16_gemm_hardware()
                    names = (["expand_blocks"] if blocks else []) + ["expand_whole"]
                    has_panel = bm.has_panel_bf16() if dt == torch.bfloat16 else bm.has_panel_f32()
                    names += ["panel"] if has_panel else []
                    if spec == "2:4" and dt == torch.bfloat16 and bm.has_nm24_panel():
                        names += ["nm24"]
                    if dt == torch.bfloat16 and bm.has_amx():
                        names += ["amx"]
                    if dt == torch.float32 and bm.has_fused_f32():
                        names += ["fused"]
                    for t in tokens:
                        x32 = torch.randn(t, K, generator=gen)
                        x = x32.to(dt)
                        strategies = (["stream"] if t <= STREAM_MAX else []) + names
                        fns = {f"dense_{d}": (lambda d=d, xd=x32.to(DTYPES[d]): F.linear(xd, wd[d])) for d in DTYPES}
                        fns.update({s: (lambda f=_strategy(s): f(x, w)) for s in strategies})
                        want = F.linear(x.double(), w.to_dense().double())
                        errs = {}
                        for s in strategies:
                            got = _strategy(s)(x, w)
                            errs[s] = float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))
                        ms = round_robin_ms(fns, rounds)
                        best = min(DTYPES, key=lambda d: ms[f"dense_{d}"])
                        auto = bm.auto_strategy(t, dt, w.bits, w.values, R, K)
                        whole = not blocks or t > bm.row_blocks_max_tokens()
                        auto_key = auto if auto != "expand" else ("expand_whole" if whole else "expand_blocks")
                        row = {
                            "model": model,
                            "shape": [R, K],
                            "dtype": dname,
                            "sparsity": spec,
                            "tokens": t,
                            "threads": a.threads,
                            "dense_ms": round(ms[f"dense_{dname}"], 3),
                            "best_dense": best,
                            "auto_strategy": auto_key,
                        }
                        for s in strategies:
                            row[f"{s}_ms"] = round(ms[s], 3)
                            row[f"{s}_vs_dense"] = round(ms[f"dense_{dname}"] / ms[s], 3)
                            row[f"{s}_vs_best_dense"] = round(ms[f"dense_{best}"] / ms[s], 3)
                        row["auto_vs_best_dense"] = row.get(f"{auto_key}_vs_best_dense")
                        row["max_rel_err"] = float(f"{max(errs.values()):.2e}")
                        rows.append(row)
                        print(
                            f"{model} {R}x{K} {dname:>8} {spec:>4} T={t:<5} "
                            + "  ".join(f"{s} x{row[f'{s}_vs_dense']:.2f}" for s in strategies)
                            + f"  (vs dense {dname}; auto {auto_key} x{row['auto_vs_best_dense']:.2f} vs best {best})",
                            flush=True,
                        )
    res = {
        "benchmark": "bitmask_prefill",
        "cpu": sparsa.cpu.cpu_info(),
        "threads": a.threads,
        "quick": a.quick,
        "rounds": rounds,
        "panel_kernel": bm.has_panel_bf16(),
        "panel_f32_kernel": bm.has_panel_f32(),
        "nm24_kernel": bm.has_nm24_panel(),
        "thresholds": {
            # the crossovers in force (sparsa.crossovers: refitted here, this class's, or the default)
            "stream_max_tokens bfloat16": bm.stream_max_tokens(torch.bfloat16),
            "stream_max_tokens float32": bm.stream_max_tokens(torch.float32),
            "panel_max_density bfloat16": bm.panel_max_density(torch.bfloat16),
            "panel_max_density float32": bm.panel_max_density(torch.float32),
            "row_blocks_max_tokens": bm.row_blocks_max_tokens(),
            "fused_max_tokens": bm.fused_max_tokens(),
            "nm24 panel_min_tokens": nm24.panel_min_tokens(),
        },
        "torch": torch.__version__,
        "seconds": round(time.time() - t_start, 1),
        "rows": rows,
    }
    out = Path(a.out) if a.out else results_dir() / "bitmask_prefill.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"wrote {out} ({res['seconds']} s)")


if __name__ == "__main__":
    main()
