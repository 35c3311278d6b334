"""GPU benchmark of sparsa's Triton kernels -> benchmarks/results/gpu.json (needs CUDA; < 10 minutes).

Sections (each ratio = dense time / sparse time, > 1 means sparsa is faster):

1. ``weight_sparse``: ``F.linear`` with a block-sparse (BSR, 64x64 blocks) or N:M weight vs dense
   cuBLAS at 50-95% sparsity, BERT-base (768/3072) and LLM (4096x4096, 8k/16k tokens, plus a 16-token
   decode case) shapes, bf16 and fp32 (TF32 allowed, as cuBLAS uses it); PyTorch's 2:4 semi-structured
   path (bf16) where the GPU supports it. Every case is also checked against the dense result.
2. ``act_sparse_linear`` / ``act_sparse_conv``: forward + backward (compaction, forward GEMM, input and
   weight gradients) vs dense cuBLAS / cuDNN over an activation-sparsity sweep, for random zeros and
   for channel-structured zeros (whole channels dead per 64-row panel).
3. ``training_step``: one SGD step of VGG-16 / ResNet-18-style nets (``examples/convnets.py``)
   dense vs with every ReLU-fed conv routed through the activation-sparse kernels where a one-time
   per-layer timing says it pays (the policy; otherwise the layer stays dense).

Run (on a machine with an NVIDIA GPU)::

    python benchmarks/gpu.py            # or: python benchmarks/gpu.py --quick
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "gpu.json"
BUDGET_S = 540.0  # stop starting new cases after this many seconds (the whole run must stay < 10 min)
T0 = time.time()


#: device and case lists (module-level so a CPU smoke run under TRITON_INTERPRET=1 can shrink them)
DEV = "cuda"
WEIGHT_SHAPES = [
    ("bert_qkv_768x768", 768, 768, 4096),
    ("bert_ffn_up_3072x768", 3072, 768, 4096),
    ("bert_ffn_down_768x3072", 768, 3072, 4096),
    ("llm_4096x4096_8k", 4096, 4096, 8192),
    ("llm_4096x4096_16k", 4096, 4096, 16384),
    ("llm_4096x4096_decode16", 4096, 4096, 16),
]
WEIGHT_SPARSITIES = [0.5, 0.75, 0.9, 0.95]
BLOCK = 64
ACT_SWEEP = [0.0, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99]
ACT_LINEAR = [(8192, 4096, 4096)]
ACT_CONV = [("vgg_conv3_256", 64, 256, 8, 256), ("vgg_conv2_128", 64, 128, 16, 128)]
TRAIN = [("vgg16", "vgg16", 128, {}), ("resnet18", "resnet18", 128, {})]
IMAGE = 32


def _sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


class _Timer:
    """CUDA events on the GPU; perf_counter elsewhere (smoke runs)."""

    def __init__(self):
        if DEV == "cuda":
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def start(self):
        if DEV == "cuda":
            self.a.record()
        else:
            self.t = time.perf_counter()

    def stop_ms(self) -> float:
        if DEV == "cuda":
            self.b.record()
            self.b.synchronize()
            return self.a.elapsed_time(self.b)
        return (time.perf_counter() - self.t) * 1e3


_SECTION_END = [T0 + BUDGET_S]  # deadline of the section being measured (set in main)


def _left() -> float:
    return _SECTION_END[0] - time.time()


# ------------------------------------------------------------------------------------------- timing
def _time_pair(dense: Callable[[], object], sparse: Callable[[], object], reps: int = 15, inner: int = 3):
    """Median ms per call of two functions, alternated (same GPU state), after warm-up."""
    for _ in range(2):
        dense()
        sparse()
    _sync()
    td, ts = [], []
    for _ in range(reps):
        for fn, acc in ((dense, td), (sparse, ts)):
            t = _Timer()
            t.start()
            for _ in range(inner):
                fn()
            acc.append(t.stop_ms() / inner)
    return statistics.median(td), statistics.median(ts)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


# ------------------------------------------------------------------------------------------- 1. weights
def _block_sparse_weight(n: int, k: int, sparsity: float, bs: int, dtype, gen) -> torch.Tensor:
    nb = (n // bs) * (k // bs)
    keep = max(1, round(nb * (1 - sparsity)))
    sel = torch.zeros(nb, dtype=torch.bool, device=DEV)
    sel[torch.randperm(nb, device=DEV, generator=gen)[:keep]] = True
    mask = sel.view(n // bs, k // bs).repeat_interleave(bs, 0).repeat_interleave(bs, 1)
    return torch.randn(n, k, device=DEV, dtype=dtype, generator=gen) * mask / math.sqrt(k)


def bench_weight_sparse(quick: bool) -> List[dict]:
    import sparsa
    from sparsa.gpu.semi_structured import semi_structured_supported
    from sparsa.layouts import NM, BSR  # noqa: F401

    shapes = WEIGHT_SHAPES if not quick else [WEIGHT_SHAPES[0], WEIGHT_SHAPES[3]]
    sparsities = WEIGHT_SPARSITIES
    nm_for = {0.5: (2, 4), 0.75: (1, 4), 0.9: (1, 10), 0.95: (1, 20)}
    semi_ok, semi_why = semi_structured_supported()
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for name, n, k, tokens in shapes:
            x = torch.randn(tokens, k, device=DEV, dtype=dtype, generator=gen)
            for s in sparsities:
                if _left() < 60:
                    rows.append({"skipped": "time budget", "shape": name})
                    return rows
                dense_w = _block_sparse_weight(n, k, s, BLOCK, dtype, gen)
                cases = [(f"bsr{BLOCK}", sparsa.to_sparse(dense_w, "bsr", blocksize=(BLOCK, BLOCK)))]
                if s < 0.92 or tokens <= 16 or not quick:
                    nn_, mm_ = nm_for[s]
                    cases.append(
                        (
                            f"nm{nn_}:{mm_}",
                            sparsa.to_sparse(
                                torch.randn(n, k, device=DEV, dtype=dtype, generator=gen) / math.sqrt(k),
                                "nm",
                                n=nn_,
                                m=mm_,
                            ),
                        )
                    )
                for kind, w in cases:
                    wd = w.to_dense()
                    with torch.no_grad():
                        ref = F.linear(x, wd)
                        out = F.linear(x, w)
                        err = _rel_err(out, ref)
                        td, ts = _time_pair(lambda: F.linear(x, wd), lambda: F.linear(x, w))
                    route = sparsa.ops.explain("linear", None, type(w.sparse_layout)).split(": ")[1]
                    rows.append(
                        {
                            "shape": name,
                            "out": n,
                            "in": k,
                            "tokens": tokens,
                            "dtype": str(dtype)[6:],
                            "kernel": kind,
                            "sparsity": round(1 - w.density, 4),
                            "dense_ms": td,
                            "sparse_ms": ts,
                            "speedup": td / ts,
                            "rel_err": err,
                            "route": route,
                        }
                    )
                    print(
                        f"  {name:24s} {str(dtype)[6:]:8s} {kind:7s} s={1 - w.density:.2f} dense {td:7.3f} ms  "
                        f"sparse {ts:7.3f} ms  x{td / ts:5.2f}  err {err:.1e}",
                        flush=True,
                    )
            if dtype == torch.bfloat16 and semi_ok:  # PyTorch's 2:4 path, for comparison
                w = sparsa.to_sparse(torch.randn(n, k, device=DEV, dtype=dtype, generator=gen), "nm", n=2, m=4)
                wd = w.to_dense()
                with torch.no_grad():
                    err = _rel_err(F.linear(x, w), F.linear(x, wd))
                    td, ts = _time_pair(lambda: F.linear(x, wd), lambda: F.linear(x, w))
                rows.append(
                    {
                        "shape": name,
                        "out": n,
                        "in": k,
                        "tokens": tokens,
                        "dtype": "bfloat16",
                        "kernel": "semi_structured_2:4",
                        "sparsity": 0.5,
                        "dense_ms": td,
                        "sparse_ms": ts,
                        "speedup": td / ts,
                        "rel_err": err,
                    }
                )
                print(
                    f"  {name:24s} bfloat16 2:4-semi s=0.50 dense {td:7.3f} ms  sparse {ts:7.3f} ms  x{td / ts:5.2f}",
                    flush=True,
                )
    if not semi_ok:
        rows.append({"kernel": "semi_structured_2:4", "skipped": semi_why})
    return rows


# ------------------------------------------------------------------------------------------- 2. activations
def _sparse_act(shape, sparsity: float, pattern: str, dtype, gen, panel: int = 64) -> torch.Tensor:
    z = torch.rand(*shape, device=DEV, generator=gen)
    if pattern == "random":
        keep = z >= sparsity
    else:  # channel-structured: per panel of rows, whole columns (channels) are zero
        rows, cols = shape[0], shape[-1]
        pan = torch.rand((rows + panel - 1) // panel, cols, device=DEV, generator=gen) >= sparsity
        keep = pan.repeat_interleave(panel, 0)[:rows]
    return (torch.rand(*shape, device=DEV, generator=gen, dtype=dtype) + 0.1) * keep


def bench_act_sparse(quick: bool) -> Dict[str, List[dict]]:
    from sparsa.gpu.act_sparse import act_sparse_conv2d, act_sparse_linear

    gen = torch.Generator(device=DEV).manual_seed(1)
    sweep = ACT_SWEEP if not quick else [0.5, 0.9]
    lin, conv = [], []
    for dtype in (torch.bfloat16, torch.float32):
        for m, k, n in ACT_LINEAR if not quick else [(4096, 1024, 1024)]:
            for pattern in ("random", "channel"):
                for s in sweep:
                    if _left() < 45:
                        return {"linear": lin + [{"skipped": "time budget"}], "conv": conv}
                    a = _sparse_act((m, k), s, pattern, dtype, gen)
                    w = (torch.randn(n, k, device=DEV, dtype=dtype, generator=gen) / math.sqrt(k)).requires_grad_()
                    g = torch.randn(m, n, device=DEV, dtype=dtype, generator=gen)
                    ad, asp = a.clone().requires_grad_(), a.clone().requires_grad_()

                    def dense():
                        F.linear(ad, w).backward(g)

                    def sparse():
                        act_sparse_linear(asp, w).backward(g)

                    y_ref, y = F.linear(a, w), act_sparse_linear(a, w)
                    err = _rel_err(y, y_ref)
                    td, ts = _time_pair(dense, sparse, reps=7, inner=2)
                    lin.append(
                        {
                            "tokens": m,
                            "in": k,
                            "out": n,
                            "dtype": str(dtype)[6:],
                            "pattern": pattern,
                            "act_sparsity": s,
                            "measured_sparsity": float((a == 0).float().mean()),
                            "dense_fwd_bwd_ms": td,
                            "sparse_fwd_bwd_ms": ts,
                            "speedup": td / ts,
                            "rel_err": err,
                        }
                    )
                    print(
                        f"  linear {m}x{k}->{n} {str(dtype)[6:]:8s} {pattern:7s} s={s:.2f} dense {td:7.2f} ms "
                        f"sparse {ts:7.2f} ms x{td / ts:5.2f} err {err:.1e}",
                        flush=True,
                    )
        # conv layers (VGG-16 middle layers at batch 64, 32x32 CIFAR-sized inputs)
        for name, nb, c, hw, o in ACT_CONV if not quick else ACT_CONV[:1]:
            for pattern in ("random", "channel"):
                for s in sweep:
                    if _left() < 45:
                        return {"linear": lin, "conv": conv + [{"skipped": "time budget"}]}
                    if pattern == "random":
                        x = _sparse_act((nb, c, hw, hw), s, "random", dtype, gen)
                    else:  # whole channels dead per image
                        keep = torch.rand(nb, c, 1, 1, device=DEV, generator=gen) >= s
                        x = (torch.rand(nb, c, hw, hw, device=DEV, generator=gen, dtype=dtype) + 0.1) * keep
                    w = (torch.randn(o, c, 3, 3, device=DEV, dtype=dtype, generator=gen) * 0.05).requires_grad_()
                    xd, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
                    gy = torch.randn(nb, o, hw, hw, device=DEV, dtype=dtype, generator=gen)

                    def dense():
                        F.conv2d(xd, w, None, 1, 1).backward(gy)

                    def sparse():
                        act_sparse_conv2d(xs, w, None, 1, 1).backward(gy)

                    err = _rel_err(act_sparse_conv2d(x, w, None, 1, 1), F.conv2d(x, w, None, 1, 1))
                    td, ts = _time_pair(dense, sparse, reps=7, inner=2)
                    conv.append(
                        {
                            "layer": name,
                            "batch": nb,
                            "in_ch": c,
                            "hw": hw,
                            "out_ch": o,
                            "dtype": str(dtype)[6:],
                            "pattern": pattern,
                            "act_sparsity": s,
                            "dense_fwd_bwd_ms": td,
                            "sparse_fwd_bwd_ms": ts,
                            "speedup": td / ts,
                            "rel_err": err,
                        }
                    )
                    print(
                        f"  conv {name} {str(dtype)[6:]:8s} {pattern:7s} s={s:.2f} cuDNN {td:7.2f} ms "
                        f"sparse {ts:7.2f} ms x{td / ts:5.2f} err {err:.1e}",
                        flush=True,
                    )
    return {"linear": lin, "conv": conv}


# ------------------------------------------------------------------------------------------- 3. training
class _PolicyConv(nn.Module):
    """A Conv2d that, after one timing on its first input, runs the activation-sparse kernels if they
    were faster there and the input is non-negative (a ReLU output), else cuDNN."""

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        self.conv = conv
        self.use_sparse: Optional[bool] = None
        self.ratio = None

    def forward(self, x):
        from sparsa.gpu.act_sparse import act_sparse_conv2d

        c = self.conv
        args = (c.stride, c.padding, c.dilation)
        if self.use_sparse is None:
            ok = c.groups == 1 and not isinstance(c.padding, str) and bool((x >= 0).all())
            self.use_sparse = False
            if ok:
                xd = x.detach().clone().requires_grad_()
                wd = c.weight.detach().clone().requires_grad_()
                gy = torch.randn_like(F.conv2d(xd, wd, None, *args))
                td, ts = _time_pair(
                    lambda: F.conv2d(xd, wd, None, *args).backward(gy),
                    lambda: act_sparse_conv2d(xd, wd, None, *args).backward(gy),
                    reps=5,
                    inner=1,
                )
                self.ratio = td / ts
                self.use_sparse = ts < td
        if self.use_sparse:
            return act_sparse_conv2d(x, c.weight, c.bias, *args)
        return c(x)


def _wrap_convs(model: nn.Module) -> List[_PolicyConv]:
    out = []
    for name, mod in list(model.named_children()):
        if isinstance(mod, nn.Conv2d) and mod.in_channels > 3:
            pc = _PolicyConv(mod)
            setattr(model, name, pc)
            out.append(pc)
        else:
            out += _wrap_convs(mod)
    return out


def bench_training(quick: bool) -> List[dict]:
    try:
        from examples import convnets
    except ImportError as e:
        return [{"skipped": f"examples.convnets not available ({e})"}]
    import copy

    rows = []
    for name, builder, batch, kw in TRAIN:
        build = getattr(convnets, builder)
        if _left() < 40:
            rows.append({"model": name, "skipped": "time budget"})
            continue
        for dtype in (torch.float32,):
            torch.manual_seed(0)
            dense = build(**kw).to(DEV).to(dtype)
            sparse = copy.deepcopy(dense)
            wrapped = _wrap_convs(sparse)
            x = torch.randn(batch, 3, IMAGE, IMAGE, device=DEV, dtype=dtype)
            y = torch.randint(0, 10, (batch,), device=DEV)
            opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (dense, sparse)]

            def step(m, opt):
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(m(x), y).backward()
                opt.step()

            step(sparse, opts[1])  # calibration (per-layer timing) happens here
            td, ts = _time_pair(lambda: step(dense, opts[0]), lambda: step(sparse, opts[1]), reps=7, inner=1)
            rows.append(
                {
                    "model": name,
                    "batch": batch,
                    "dtype": str(dtype)[6:],
                    "dense_step_ms": td,
                    "sparsa_step_ms": ts,
                    "speedup": td / ts,
                    "layers_sparse": sum(bool(w.use_sparse) for w in wrapped),
                    "layers": len(wrapped),
                    "layer_ratios": [None if w.ratio is None else round(w.ratio, 3) for w in wrapped],
                }
            )
            print(
                f"  train {name} b={batch} {str(dtype)[6:]} dense {td:7.2f} ms sparsa {ts:7.2f} ms x{td / ts:5.2f} "
                f"({rows[-1]['layers_sparse']}/{len(wrapped)} layers sparse)",
                flush=True,
            )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a few cases only (smoke run)")
    p.add_argument("--out", default=str(OUT))
    p.add_argument(
        "--budget",
        type=float,
        default=BUDGET_S,
        help="seconds for the whole run, shared 45/30/25%% by the three sections (default %(default)s)",
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "benchmarks/gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured, "
            "no JSON written. Run it on a machine with an NVIDIA GPU."
        )
        return 0
    import sparsa.gpu as sg

    if not sg.triton_available():
        print(f"benchmarks/gpu.py needs Triton: {sg.why_unavailable()}")
        return 0
    os.environ.pop("TRITON_INTERPRET", None)
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 rows are TF32 on both sides, like cuBLAS defaults
    torch.backends.cudnn.allow_tf32 = True
    import triton

    res = {
        "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "note": "speedup = dense / sparse time (median, alternated, CUDA events); fp32 means TF32 on both",
    }
    end = T0
    for key, fn, share in (
        ("weight_sparse", bench_weight_sparse, 0.45),
        ("act_sparse", bench_act_sparse, 0.30),
        ("training_step", bench_training, 0.25),
    ):
        end += share * args.budget
        _SECTION_END[0] = max(end, time.time() + 50)  # each section gets its share (and at least one case)
        print(f"[{key}] ({time.time() - T0:.0f} s elapsed)", flush=True)
        try:
            res[key] = fn(args.quick)
        except Exception as e:  # keep what was measured; say what failed
            res[key] = {"error": f"{type(e).__name__}: {e}"}
            print(f"  {key} failed: {type(e).__name__}: {e}", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
    res["total_s"] = time.time() - T0
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out} in {res['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
