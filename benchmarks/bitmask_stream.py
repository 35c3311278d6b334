"""The bitmask decode kernel alone: a decoder's block linears at 1-4 tokens, against dense ``F.linear``.

The weights of every block linear of a Llama-style model (default: the 0.5B config of
``llm_decode.py``, 16 layers, more than the last-level cache) are multiplied by a few tokens, one
layer after another, as one decode step would; the bitmask ``stream`` kernel (``sparsa.kernels.bitmask``)
against dense ``F.linear`` in the same dtype and in every other dtype of ``DTYPES`` (the same weights,
rounded), round-robin in one process, 2 threads. No model, attention or Python dispatch: this isolates
what the kernel reads and computes, which ``llm_decode.py`` mixes with the rest of a decode step. Rows:
``dtype, sparsity, tokens, threads, stream_ms, dense_ms, speedup_vs_dense, best_dense,
speedup_vs_best_dense, stream_gb_per_s, weight_bytes_ratio``; ``best_dense`` is the dtype whose dense pass
was fastest (on a CPU without bf16 hardware a dense bf16 GEMV, half the bytes, often beats fp32).

    python benchmarks/bitmask_stream.py [--quick]
    python benchmarks/ab_commits.py OLD --script-from new -- bitmask_stream.py --quick   # a kernel change

Writes ``benchmarks/results/<cpu class>/bitmask_stream.json`` (``--out`` or ``$SPARSA_RESULTS_DIR`` move it).
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
from sparsa.layouts import Bitmask  # noqa: E402
from sparsa.timing import round_robin_ms  # noqa: E402
from _results import results_dir  # noqa: E402

#: (hidden, intermediate, layers, heads, kv heads): the block-linear shapes of llm_decode.py's configs
CONFIGS = {"llama-0.5b": (1536, 4096, 16, 12, 4), "llama-1b": (2048, 8192, 16, 32, 8)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def block_shapes(name: str, layers: int) -> list:
    """(out_features, in_features) of every block linear: q, k, v, o, gate, up, down per layer."""
    h, inter, _, heads, kv = CONFIGS[name]
    kvd = kv * (h // heads)
    return [(h, h), (kvd, h), (kvd, h), (h, h), (inter, h), (inter, h), (h, inter)] * layers


def stream_pass(sparse: list, xs: dict):
    """One decode step's block linears through the stream kernel over the bitmask weights."""

    def run():
        for m in sparse:
            bm.bitmask_linear_impl(xs[m.shape[1]], m.bits, m.row_ptr, m.values, None, m.shape[0], "stream")

    return run


def dense_pass(dense: list, xs: dict):
    """One decode step's block linears through dense F.linear."""

    def run():
        for w in dense:
            F.linear(xs[w.shape[1]], w)

    return run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 layers, fp32, 1 token, fewer rounds")
    ap.add_argument("--model", choices=sorted(CONFIGS), default="llama-0.5b")
    ap.add_argument("--layers", type=int, default=None, help="layers of weights (default: the model's; quick 4)")
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=None)
    ap.add_argument("--sparsities", nargs="+", type=float, default=[0.5, 0.7])
    ap.add_argument("--tokens", nargs="+", type=int, default=None, help="default 1 2 4 (quick: 1)")
    ap.add_argument("--rounds", type=int, default=None, help="round-robin rounds (default 15; quick 7)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    layers = a.layers if a.layers is not None else (4 if a.quick else CONFIGS[a.model][2])
    dtypes = a.dtypes or (["float32"] if a.quick else ["float32", "bfloat16"])
    tokens = a.tokens or ([1] if a.quick else [1, 2, 4])
    rounds = a.rounds if a.rounds is not None else (7 if a.quick else 15)
    bad = [s for s in a.sparsities if not 0.0 < s < 1.0]
    if bad or layers < 1 or rounds < 1 or min(tokens) < 1 or max(tokens) > bm.BATCH_MAX_TOKENS:
        raise SystemExit(
            f"bitmask_stream: need 0 < sparsity < 1 (got {bad}), --layers and --rounds >= 1, and 1 <= tokens <= "
            f"{bm.BATCH_MAX_TOKENS} (decoding batches)"
        )
    if bm.native_library() is None:
        raise SystemExit("bitmask_stream: no native bitmask kernel here (SPARSA_NO_NATIVE is set, or it did not build)")
    torch.set_num_threads(a.threads)
    t_start = time.time()
    shapes = block_shapes(a.model, layers)
    gen = torch.Generator().manual_seed(0)
    rows = []
    # the dense weights in every dtype (the same values, rounded): each round robin times all of them
    dense_by = {"float32": [torch.randn(r, k, generator=gen) for r, k in shapes]}
    dense_by.update({d: [w.to(DTYPES[d]) for w in dense_by["float32"]] for d in DTYPES if d != "float32"})
    for dname in dtypes:
        dt = DTYPES[dname]
        dense = dense_by[dname]
        dense_bytes = sum(w.numel() * w.element_size() for w in dense)
        for s in a.sparsities:
            sparse = [Bitmask.from_dense(w, sparsity=s) for w in dense]
            sparse_bytes = sum(m.nbytes for m in sparse)
            for t in tokens:
                x32 = {k: torch.randn(t, k, generator=gen) for k in {k for _, k in shapes}}
                xs = {k: x.to(dt) for k, x in x32.items()}
                fns = {"stream": stream_pass(sparse, xs)}
                for d, ws in dense_by.items():
                    fns[d] = dense_pass(ws, {k: x.to(DTYPES[d]) for k, x in x32.items()})
                w0, x0 = sparse[0], xs[shapes[0][1]]
                got = bm.bitmask_linear_impl(x0, w0.bits, w0.row_ptr, w0.values, None, w0.shape[0], "stream")
                want = F.linear(x0.float(), w0.to_dense().float())
                err = float((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-30))
                ms = round_robin_ms(fns, rounds)
                best = min(dense_by, key=lambda d: ms[d])
                row = {
                    "model": a.model,
                    "layers": layers,
                    "dtype": dname,
                    "sparsity": s,
                    "tokens": t,
                    "threads": a.threads,
                    "stream_ms": round(ms["stream"], 3),
                    "dense_ms": round(ms[dname], 3),
                    "speedup_vs_dense": round(ms[dname] / ms["stream"], 3),
                    "best_dense": best,
                    "speedup_vs_best_dense": round(ms[best] / ms["stream"], 3),
                    "stream_gb_per_s": round(sparse_bytes / ms["stream"] / 1e6, 2),
                    "dense_gb_per_s": round(dense_bytes / ms[dname] / 1e6, 2),
                    "weight_bytes_ratio": round(sparse_bytes / dense_bytes, 4),
                    "max_rel_err": float(f"{err:.2e}"),
                }
                rows.append(row)
                print(
                    f"{dname:>8} {s:.2f} T={t}: stream {row['stream_ms']:8.2f} ms ({row['stream_gb_per_s']:5.1f} "
                    f"GB/s)  dense {row['dense_ms']:8.2f} ms ({row['dense_gb_per_s']:5.1f} GB/s)  "
                    f"x{row['speedup_vs_dense']:.2f}  x{row['speedup_vs_best_dense']:.2f} vs dense {best}",
                    flush=True,
                )
            del sparse
    del dense_by
    res = {
        "benchmark": "bitmask_stream",
        "cpu": sparsa.cpu.cpu_info(),
        "threads": a.threads,
        "quick": a.quick,
        "rounds": rounds,
        "stream_path": bm.STREAM_PATH,
        "avx512_loop": bm.has_avx512(),
        "torch": torch.__version__,
        "seconds": round(time.time() - t_start, 1),
        "rows": rows,
    }
    out = Path(a.out) if a.out else results_dir() / "bitmask_stream.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"wrote {out} ({res['seconds']} s)")


if __name__ == "__main__":
    main()
