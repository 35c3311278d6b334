"""Sparsity-adaptive training benchmark (issue #4): monitor, per-layer, sweep and end-to-end numbers.

Data: scikit-learn's digits (8x8 grey) upsampled to 32x32 and repeated over 3 channels, 10 classes.
Dense baseline: PyTorch's own conv2d/linear forward+backward (oneDNN/MKL) at the same thread count.
Per model, dense and adaptive training run in both NCHW and channels-last, one step of each in turn on
the same batches; ``step_speedup_vs_dense`` is the faster adaptive format's median step against the
faster dense format's (``step_ms`` and ``step_speedup_same_format`` give all four), and
``step_speedup_vs_best_dense`` against the fastest dense step of either format in fp32 or bf16 autocast
(the other dtype timed for a few rounds on the same batches: ``dense_step_ms_all``). Each row has a
``dtype``: fp32, and bf16 (autocast) rows where the CPU has bf16 hardware (``--dtypes`` overrides), and
the step guard's verdict (``guard``).
Loss check (the channels-last pair): dense, adaptive and a third, dense run from weights moved by a
relative 1e-7 train on the same batches; ``loss_float_band`` (dense vs perturbed dense) shows how far
rounding alone moves the loss, to read ``loss_abs_diff`` (dense vs adaptive) against.

    python benchmarks/adaptive_training.py --quick   # < 3 minutes
    python benchmarks/adaptive_training.py           # full (4 models, 100 steps)

Writes ``benchmarks/results/<cpu class>/adaptive_training.json`` with the keys ``cpu``, ``monitor``,
``layers``, ``sweep``, ``models`` (plus ``config``, ``dtypes`` and ``compaction``).
Run under ``flock /tmp/sparsa-bench.lock``.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sparsa.adaptive as sa  # noqa: E402
import sparsa.cpu  # noqa: E402
from sparsa.adaptive.calibration import default_calibration  # noqa: E402
from sparsa.kernels import adaptive as K  # noqa: E402
from sparsa.kernels import adaptive_union as U  # noqa: E402
from sparsa.adaptive import conv_union  # noqa: E402
from examples.convnets import build  # noqa: E402

try:
    from benchmarks._results import results_dir  # noqa: E402
    from benchmarks._timing import compare, median_time  # noqa: E402
except ImportError:  # pragma: no cover
    from _results import results_dir  # type: ignore  # noqa: E402
    from _timing import compare, median_time  # type: ignore  # noqa: E402

CL = torch.channels_last
ALL_MODELS = ["vgg16", "vgg16_bn", "resnet18", "alexnet"]


# ------------------------------------------------------------------------------------------ data
def digits_batches(batch: int, steps: int, size: int = 32, seed: int = 0):
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    x = (x - x.mean()) / x.std()
    y = torch.tensor(d.target, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        i = torch.randint(0, x.shape[0], (batch,), generator=g)
        out.append((x[i].contiguous(memory_format=CL), y[i]))
    return out


# ------------------------------------------------------------------------------------------ helpers
def _fmt(t):
    return (
        CL if t.dim() == 4 and t.is_contiguous(memory_format=CL) and not t.is_contiguous() else torch.contiguous_format
    )


def train_step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return float(loss.detach())


def capture_inputs(model: nn.Module, x, labels=None) -> dict:
    """Input activation of every adaptive layer for one forward pass, and (given ``labels``) the real
    gradient at its output from one backward pass: ``name -> (module, input, grad_output or None)``.
    The gradient keeps its real zeros (a conv feeding a ReLU directly gets dY = 0 wherever the ReLU
    was inactive; behind a BatchNorm it is dense), which the dY-sparse input gradient exploits."""
    acts, grads, hooks = {}, {}, []

    def keep_grad(name):
        def hook(mod, inp, out):
            if out.requires_grad:
                out.register_hook(lambda g: grads.__setitem__(name, g.detach().clone()))

        return hook

    for name, m in model.named_modules():
        if isinstance(m, (sa.AdaptiveConv2d, sa.AdaptiveLinear)):
            hooks.append(
                m.register_forward_pre_hook(
                    lambda mod, inp, name=name: acts.__setitem__(name, (mod, inp[0].detach().clone()))
                )
            )
            if labels is not None:
                hooks.append(m.register_forward_hook(keep_grad(name)))
    if labels is None:
        with torch.no_grad():
            model(x)
    else:
        F.cross_entropy(model(x), labels).backward()
        model.zero_grad(set_to_none=True)
    for h in hooks:
        h.remove()
    return {k: (m, a, grads.get(k)) for k, (m, a) in acts.items()}


def fwd_bwd(kind, mod, a, sparse: bool, gy=None):
    """A closure running one forward+backward of layer ``mod`` on activation ``a`` (output gradient
    ``gy``: the real one when given, else random and dense)."""
    w = mod.weight.detach().clone().requires_grad_(True)
    b = None if mod.bias is None else mod.bias.detach().clone().requires_grad_(True)
    if kind == "conv2d":
        args = dict(stride=mod.stride, padding=mod.padding, dilation=mod.dilation)
        f = (lambda t: sa.relu_conv2d(t, w, b, **args)) if sparse else (lambda t: F.conv2d(t, w, b, **args))
    else:
        f = (lambda t: sa.relu_linear(t, w, b)) if sparse else (lambda t: F.linear(t, w, b))
    with torch.no_grad():
        y0 = f(a)
        gy = torch.randn_like(y0) if gy is None else gy.reshape(y0.shape).contiguous(memory_format=_fmt(y0))

    def run():
        with torch.no_grad():
            w.mul_(1.0)  # a new weight version each call, as after an optimizer step (both paths)
        t = a.detach().requires_grad_(True)
        f(t).backward(gy)

    return run


def dense_reference_ms() -> float:
    """A fixed dense conv forward+backward ([32, 64, 32, 32], 64 -> 64, 3x3, channels-last), median ms: the
    machine's speed at this point of the run. Shared machines drift for minutes at a time, and oneDNN's
    dense GEMMs more than the sparse kernels (a slow phase inflates every dense/sparse ratio measured in it),
    so the run records this at each stage (``config.dense_reference_ms``)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, 32, 32, generator=gen).relu().contiguous(memory_format=CL)
    mod = nn.Conv2d(64, 64, 3, padding=1).to(memory_format=CL)
    return median_time(fwd_bwd("conv2d", mod, x, False), reps=5, warmup=1, min_seconds=0) * 1e3


def thresholded(a, sparsity):
    """``a`` with its smallest values zeroed to reach ``sparsity`` (keeps the real clustering)."""
    flat = a.reshape(-1)
    k = min(flat.numel(), 400_000)
    sample = flat[torch.randint(0, flat.numel(), (k,), generator=torch.Generator().manual_seed(0))]
    t = torch.quantile(sample, sparsity)
    return torch.where(a > t, a, torch.zeros(()))


# ------------------------------------------------------------------------------------------ parts
FORMATS = {"nchw": torch.contiguous_format, "channels_last": CL}


def _bf16_hardware() -> bool:
    """Whether this CPU has bf16 matrix instructions (AMX or AVX512-BF16): only then is bf16 training fast."""
    flags = sparsa.cpu.cpu_flags()
    return bool(flags.get("amx_bf16") or flags.get("avx512_bf16"))


def train_step_bf16(model, opt, x, y):
    """One training step under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (backward outside it)."""
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return float(loss.detach())


def dense_steps_ms(base, data, steps, step):
    """Median dense training step (``step``: fp32 or bf16 autocast) per memory format, ``steps`` rounds after
    one warm-up, both formats side by side. The dtype a row does not train is timed this way, for a few rounds
    on CPUs where it is many times slower."""
    models = {f: copy.deepcopy(base).to(memory_format=m) for f, m in FORMATS.items()}
    opts = {f: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for f, m in models.items()}
    t = {f: [] for f in FORMATS}
    for i, (x, y) in enumerate(data[: steps + 1]):
        for f, fmt in FORMATS.items():
            t0 = time.perf_counter()
            step(models[f], opts[f], x.contiguous(memory_format=fmt), y)
            if i:
                t[f].append(time.perf_counter() - t0)
    return {f: statistics.median(v) * 1e3 for f, v in t.items()}


def run_model(name, batch, steps, warm, res, dtype="fp32", bf16_steps=3, retain_memory=True):
    """Train ``name`` dense and adaptive in both memory formats side by side (one step of each per round) and
    report the faster adaptive format against the faster dense one (medians over the steps after ``warm``).
    ``dtype="bf16"``: every step under bf16 autocast. ``step_speedup_vs_best_dense`` compares the adaptive
    step with the fastest dense step of any format and of fp32 or bf16 autocast (``bf16_steps`` rounds of
    the other dtype, side by side). Losses: the channels-last pair, with a float-tolerance control (dense from
    rounding-perturbed weights). ``retain_memory``: passed to ``enable`` (glibc ``mallopt`` for the whole
    process, dense included, from the first ``enable`` on; the library's default is off)."""
    torch.manual_seed(0)
    base = build(name)
    data = digits_batches(batch, steps + warm)
    step = train_step_bf16 if dtype == "bf16" else train_step
    dense = {f: copy.deepcopy(base).to(memory_format=m) for f, m in FORMATS.items()}
    adaptive = {f: copy.deepcopy(base).to(memory_format=m) for f, m in FORMATS.items()}
    # the float-tolerance control: dense training from weights moved by a relative 1e-7 (rounding-sized)
    perturbed = copy.deepcopy(dense["channels_last"])
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.mul_(1 + 1e-7 * torch.randn(p.shape, generator=gen))
    rts = {f: sa.enable(m, every=10, retain_memory=retain_memory) for f, m in adaptive.items()}
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)  # noqa: E731
    od, oa, op = {f: sgd(m) for f, m in dense.items()}, {f: sgd(m) for f, m in adaptive.items()}, sgd(perturbed)
    td = {f: [] for f in FORMATS}
    ta = {f: [] for f in FORMATS}
    ld, la, lp = [], [], []
    for i, (x, y) in enumerate(data):
        for f, fmt in FORMATS.items():
            xf = x.contiguous(memory_format=fmt)
            t0 = time.perf_counter()
            l_d = step(dense[f], od[f], xf, y)
            t1 = time.perf_counter()
            l_a = step(adaptive[f], oa[f], xf, y)
            t2 = time.perf_counter()
            if i >= warm:
                td[f].append(t1 - t0)
                ta[f].append(t2 - t1)
            if f == "channels_last":
                ld.append(l_d)
                la.append(l_a)
        lp.append(step(perturbed, op, x.contiguous(memory_format=CL), y))
    md = {f: statistics.median(v) * 1e3 for f, v in td.items()}
    ma = {f: statistics.median(v) * 1e3 for f, v in ta.items()}
    dense_fmt, adaptive_fmt = min(md, key=md.get), min(ma, key=ma.get)
    # the other dtype's dense steps, side by side on the same batches
    other = "fp32" if dtype == "bf16" else "bf16"
    mo = dense_steps_ms(base, data, bf16_steps, train_step if other == "fp32" else train_step_bf16)
    dense_all = {f"{dtype}_{f}": v for f, v in md.items()}
    dense_all.update({f"{other}_{f}": v for f, v in mo.items()})
    best_dense = min(dense_all, key=dense_all.get)
    g = rts[adaptive_fmt].guard
    row = {
        "model": name,
        "dtype": dtype,
        "batch": batch,
        "steps": steps,
        "dense_format": dense_fmt,
        "adaptive_format": adaptive_fmt,
        "dense_step_ms": md[dense_fmt],
        "adaptive_step_ms": ma[adaptive_fmt],
        # the faster adaptive format against the faster dense one, all four timed side by side
        "step_speedup_vs_dense": md[dense_fmt] / ma[adaptive_fmt],
        # ... and against the fastest dense path of either dtype and format
        "best_dense": best_dense,
        "best_dense_step_ms": dense_all[best_dense],
        "step_speedup_vs_best_dense": dense_all[best_dense] / ma[adaptive_fmt],
        "dense_step_ms_all": dense_all,
        "other_dtype_steps": bf16_steps,
        "step_ms": {f"{k}_{f}": v[f] for k, v in (("dense", md), ("adaptive", ma)) for f in FORMATS},
        "step_speedup_same_format": {f: md[f] / ma[f] for f in FORMATS},
        "loss_dense": ld[-1],
        "loss_adaptive": la[-1],
        "loss_abs_diff": abs(ld[-1] - la[-1]),
        "loss_first": ld[0],
        # the same dense training from rounding-perturbed weights: how far float noise alone moves the loss
        "loss_dense_perturbed": lp[-1],
        "loss_float_band": abs(ld[-1] - lp[-1]),
        "loss_max_abs_diff": max(abs(a - b) for a, b in zip(ld, la)),
        "loss_max_float_band": max(abs(a - b) for a, b in zip(ld, lp)),
        "sparse_layers": sum(1 for r in rts[adaptive_fmt].report() if r["path"] == "sparse"),
        "adaptive_layers": len(rts[adaptive_fmt].layers),
        "guard": None if g is None else g.summary(),
    }
    res["models"].append(row)
    print(
        f"[model] {name} {dtype}: dense {md[dense_fmt]:.0f} ms ({dense_fmt}), adaptive {ma[adaptive_fmt]:.0f} ms "
        f"({adaptive_fmt}), speedup {row['step_speedup_vs_dense']:.2f}x (same format: "
        + ", ".join(f"{f} {md[f]:.0f} -> {ma[f]:.0f} ms" for f in FORMATS)
        + f"); best dense {best_dense} {dense_all[best_dense]:.0f} ms: {row['step_speedup_vs_best_dense']:.2f}x "
        f"(all dense: "
        + ", ".join(f"{k} {v:.0f}" for k, v in dense_all.items())
        + f"), loss {row['loss_dense']:.4f} vs {row['loss_adaptive']:.4f} (dense from perturbed weights "
        f"{row['loss_dense_perturbed']:.4f})",
        flush=True,
    )
    print(rts[adaptive_fmt].format(), flush=True)
    return (
        adaptive[adaptive_fmt],
        rts[adaptive_fmt],
        data[-1][0].contiguous(memory_format=FORMATS[adaptive_fmt]),
        data[-1][1],
    )


def layer_rows(name, model, rt, x, labels, reps, res):
    acts = capture_inputs(model, x, labels)
    for lname, (mod, a, gy) in acts.items():
        st = rt.layers[lname]
        if not st.paired_calls or not st.supported:
            continue
        kind = st.kind
        c = compare(
            fwd_bwd(kind, mod, a, False, gy), fwd_bwd(kind, mod, a, True, gy), reps=reps, warmup=1, min_seconds=0
        )
        sp = 1.0 - float((a != 0).float().mean())
        gsp = None if gy is None else 1.0 - float((gy != 0).float().mean())
        ratio = c.ratio if st.path == "sparse" else 1.0
        fb = st.feedback
        res["layers"].append(
            {
                "model": name,
                "layer": lname,
                "kind": kind,
                "shape": list(a.shape),
                "activation_sparsity": sp,
                "grad_sparsity": gsp,
                "path": st.path,
                "ratio_vs_dense": ratio,
                "model_speedup": st.model_speedup,
                "kappa": fb.kappa(),
                "measured_in_training": fb.measured_speedup(),
                "probes": fb.probes,
                "sparse_kernel_ratio": c.ratio,
                "dense_ms": c.baseline_s * 1e3,
                "sparse_ms": c.candidate_s * 1e3,
            }
        )
        print(
            f"[layer] {name} {lname:14s} {kind} {tuple(a.shape)} sparsity {sp:.3f} dY {gsp or 0:.3f} "
            f"path {st.path:6s} sparse/dense {c.ratio:.2f}x",
            flush=True,
        )
    return acts


def compaction_rows(acts, res, limit):
    """Building the sparse operand vs the forward GEMM it feeds: the bitmask operand and union forward
    where relu_conv2d runs the union kernels, else the list compaction and list forward."""
    for lname, (mod, a, _) in list(acts.items())[:limit]:
        if not isinstance(mod, sa.AdaptiveConv2d) or not mod.sparsa_state.paired_calls:
            continue  # only layers fed by a ReLU
        w = mod.weight.detach()
        if U.union_supported(w.shape[1], w.shape[0]) and conv_union.kernels_setting() != "list":
            geo = K.geometry(a.shape, w.shape, mod.stride, mod.padding, mod.dilation, 64)
            op = U.union_operand(a)
            tc = median_time(lambda: U.union_operand(a), reps=5, min_seconds=0)
            tf = median_time(lambda: U.union_conv_fwd(op, w, None, geo), reps=5, min_seconds=0)
            kernels = "union"
        else:
            geo = K.geometry(a.shape, w.shape, mod.stride, mod.padding, mod.dilation, 64)
            wt = w.permute(2, 3, 1, 0).contiguous()
            cnt, idx, val = K.compact(a, 64)
            tc = median_time(lambda: K.compact(a, 64), reps=5, min_seconds=0)
            tf = median_time(lambda: K.conv_fwd(cnt, idx, val, wt, None, geo, 1), reps=5, min_seconds=0)
            kernels = "list"
        res["compaction"].append(
            {
                "layer": lname,
                "shape": list(a.shape),
                "kernels": kernels,
                "compaction_ms": tc * 1e3,
                "forward_gemm_ms": tf * 1e3,
                "compaction_vs_gemm": tc / tf,
            }
        )


def sweep(acts, names, sparsities, reps, res):
    """Each layer's real activation thresholded to each sparsity; forward+backward with the layer's real
    output gradient (``dy: "real"``), and at 75% / 90% also with a dense random one (``dy: "random"``)."""
    for lname in names:
        mod, a, gy = acts[lname]
        kind = "conv2d" if isinstance(mod, nn.Conv2d) else "linear"
        gsp = None if gy is None else 1.0 - float((gy != 0).float().mean())
        for s in sparsities:
            at = thresholded(a, s).contiguous(memory_format=CL) if a.dim() == 4 else thresholded(a, s)
            real = 1.0 - float((at != 0).float().mean())
            for dy, g in (("real", gy), ("random", None)):
                if dy == "random" and (gy is None or s not in (0.75, 0.9)):
                    continue
                c = compare(
                    fwd_bwd(kind, mod, at, False, g),
                    fwd_bwd(kind, mod, at, True, g),
                    reps=reps,
                    warmup=1,
                    min_seconds=0,
                )
                res["sweep"].append(
                    {
                        "shape": f"{lname} x{list(a.shape)} w{list(mod.weight.shape)}",
                        "activation_sparsity": real,
                        "dy": dy if g is not None else "random",
                        "grad_sparsity": gsp if g is not None else 0.0,
                        "ratio_vs_dense": c.ratio,
                    }
                )
                print(f"[sweep] {lname} {tuple(a.shape)} sparsity {real:.2f} dY {dy} ratio {c.ratio:.2f}x", flush=True)


def monitor_numbers(acts, every, res):
    """Monitor (sampled, refreshed every ``every`` steps) vs a full count_nonzero every step."""
    xs = [a for _, a, _ in acts.values()]
    mons = [sa.SparsityMonitor(every=1, seed=i) for i in range(len(xs))]
    for m, a in zip(mons, xs):
        m.observe(a)  # build the sample indices once (as in training)

    def full():
        for a in xs:
            torch.count_nonzero(a)

    def sample():
        for m, a in zip(mons, xs):
            m.observe(a)

    t_full = median_time(full, reps=7, min_seconds=0.02)
    t_sample = median_time(sample, reps=7, min_seconds=0.02)
    errs = []
    for m, a in zip(mons, xs):
        exact = 1.0 - float((a != 0).float().mean())
        errs.append(abs(m.sparsity - exact) * 100)
    per_step = t_sample / every
    res["monitor"] = {
        "speedup_vs_full_count": t_full / per_step,
        "abs_error_pp": max(errs),
        "mean_abs_error_pp": statistics.mean(errs),
        "refresh_every": every,
        "sample_pixels": 512,
        "sample_elements": mons[0].elements,
        "full_count_ms_per_step": t_full * 1e3,
        "monitor_ms_per_step": per_step * 1e3,
        "monitor_ms_per_refresh": t_sample * 1e3,
        "layers": len(xs),
        "note": "layers on the sparse path get the exact count for free from compaction",
    }
    print(f"[monitor] {res['monitor']}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one model, fewer steps (< 3 minutes)")
    ap.add_argument(
        "--models",
        nargs="+",
        choices=ALL_MODELS,
        default=None,
        help="models to train (default: all four; --quick: vgg16)",
    )
    ap.add_argument(
        "--dtypes",
        nargs="+",
        choices=["fp32", "bf16"],
        default=None,
        help="training dtypes (default: fp32, plus bf16 autocast where the CPU has bf16 hardware)",
    )
    ap.add_argument("--out", default=str(results_dir() / "adaptive_training.json"))
    ap.add_argument(
        "--no-retain-memory",
        dest="retain_memory",
        action="store_false",
        help="do not opt in to enable(retain_memory=True) (glibc mallopt: freed heap memory stays in "
        "the process, so per-step buffers stop page-faulting, dense and adaptive alike)",
    )
    args = ap.parse_args(argv)
    t_start = time.time()
    quick = args.quick
    models = args.models or (["vgg16"] if quick else ALL_MODELS)
    dtypes = args.dtypes or (["fp32", "bf16"] if _bf16_hardware() else ["fp32"])
    batch = 16 if quick else 32
    steps = 12 if quick else 100
    warm = 3
    reps = 2 if quick else 9
    res = {
        "config": {
            "quick": quick,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(),
            "batch": batch,
            "steps": steps,
            "image": "sklearn digits 8x8 -> bilinear 32x32, 3 channels",
            "native": K.native_available(),
            "dense_baseline": "PyTorch conv2d/linear fwd+bwd (oneDNN/MKL), same threads, the faster of "
            "NCHW and channels-last (both timed side by side)",
            "conv_kernels": "union (bitmask operand, AVX-512) where supported, else list"
            if U.union_native() and conv_union.kernels_setting() != "list"
            else "list",
            # enable()'s default is off since issue #17; this benchmark opts in explicitly (as its
            # results before then did by default): it holds from the first model's enable() on
            "retain_memory": args.retain_memory,
        },
        "cpu": sparsa.cpu.cpu_info(),
        "dtypes": dtypes,
        "monitor": {},
        "layers": [],
        "sweep": [],
        "models": [],
        "compaction": [],
    }
    default_calibration()
    ref = res["config"]["dense_reference_ms"] = {}

    def reference(stage):
        ref[stage] = dense_reference_ms()
        print(f"[reference] {stage}: dense conv fwd+bwd {ref[stage]:.1f} ms", flush=True)

    reference("start")
    for name in models:
        for dt in dtypes[1:]:
            run_model(
                name, batch, steps, warm, res, dtype=dt, bf16_steps=3 if quick else 10, retain_memory=args.retain_memory
            )
        model, rt, x, labels = run_model(
            name,
            batch,
            steps,
            warm,
            res,
            dtype=dtypes[0],
            bf16_steps=(3 if quick else 10) if _bf16_hardware() else 3,
            retain_memory=args.retain_memory,
        )
        reference(f"{name} layers")
        acts = layer_rows(name, model, rt, x, labels, reps, res)
        if name == "vgg16":
            monitor_numbers(acts, 10, res)
            compaction_rows(acts, res, limit=14 if not quick else 6)
            names = [n for n in ("2", "7", "12", "19") if n in acts]
            if quick:
                names = [n for n in ("7", "19") if n in acts]
            reference("sweep")
            sweep(acts, names, [0.5, 0.6, 0.75, 0.8, 0.9, 0.95] if not quick else [0.5, 0.75, 0.9, 0.95], reps, res)
    reference("end")
    res["config"]["seconds"] = time.time() - t_start
    write_results(res, args.out)


def write_results(res: dict, path) -> None:
    """``res`` as indented JSON at ``path`` (folders created), with the run time from ``res["config"]``."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out} in {res['config']['seconds']:.0f} s")


if __name__ == "__main__":
    main()
