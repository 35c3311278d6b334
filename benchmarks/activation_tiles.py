"""How much of a conv's work an AMX-tiled activation-sparse kernel could skip, on real ReLU activations.

AMX multiplies 16 x 32 bf16 tiles, so a kernel can only skip work in whole tiles, or gather a tile's operand
from the nonzeros of 16 rows at once: a channel is needed for a 16-pixel tile when any of the 16 pixels has
it. This script trains each network for ``--steps`` steps (bf16 autocast, SGD, sklearn's digits as in
``adaptive_training.py``), then, on a held-out batch, records per conv layer the input's (relu(x)) and the
output gradient's (dY) nonzero fraction and:

- ``*_union16_pixels``: the fraction of (16 consecutive pixels, channel) with a nonzero: the K work left
  to a forward / input gradient whose 16-pixel tiles gather only the channels set in them;
- ``*_union16_channels``: the fraction of (pixel, 16 consecutive channels) with a nonzero: the K work left to
  a weight gradient (K = pixels) whose 16-channel tiles gather only the pixels set in them;
- ``*_tiles_16x32``: the fraction of 16-pixel x 32-channel blocks with a nonzero (a kernel that skips zero
  tiles);
- ``work_bound_fwd`` / ``_dx`` / ``_dw``: the smallest of those for each GEMM, so ``1 / work_bound`` bounds
  what such a kernel could gain over dense AMX, before any cost of gathering (the elementwise kernels'
  bound is the nonzero fraction, at the vector units' much lower rate).

Nothing here is timed, so the figures do not depend on the CPU; the JSON still records it. Writes
``benchmarks/results/<cpu class>/activation_tiles.json`` (``--out`` or ``$SPARSA_RESULTS_DIR`` move it).

    python benchmarks/activation_tiles.py [--models vgg16 resnet18] [--steps 50]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import sparsa.cpu  # noqa: E402
from _results import write_results  # noqa: E402
from adaptive_training import ALL_MODELS, digits_batches  # noqa: E402
from examples.convnets import build  # noqa: E402

CL = torch.channels_last
TILE_ROWS, TILE_K = 16, 32  # AMX: 16 rows, 32 bf16 of K per row


def tile_densities(t: torch.Tensor, prefix: str) -> Dict[str, float]:
    """Of ``t`` ``[N, C, H, W]``: its nonzero fraction and the tile-granular fractions of the module doc
    (pixels in row-major order within an image; a partial last group counts as a group)."""
    N, C, H, W = t.shape
    nz = (t != 0).permute(0, 2, 3, 1).reshape(N * H * W, C)
    P = nz.shape[0]

    def groups(m: torch.Tensor, size: int, dim: int) -> torch.Tensor:
        # pad with zeros to a whole number of groups along dim, then "any" within each group
        pad = (-m.shape[dim]) % size
        if pad:
            shape = list(m.shape)
            shape[dim] = pad
            m = torch.cat([m, torch.zeros(shape, dtype=m.dtype)], dim=dim)
        if dim == 0:
            return m.reshape(-1, size, m.shape[1]).any(1)
        return m.reshape(m.shape[0], -1, size).any(2)

    pix16 = groups(nz, TILE_ROWS, 0)
    ch16 = groups(nz, TILE_ROWS, 1)
    tiles = groups(pix16, TILE_K, 1)
    out = {
        f"{prefix}_density": nz.float().mean().item(),
        f"{prefix}_union16_pixels": pix16.float().mean().item() if P else 0.0,
        f"{prefix}_union16_channels": ch16.float().mean().item(),
        f"{prefix}_tiles_16x32": tiles.float().mean().item(),
    }
    return {k: round(v, 4) for k, v in out.items()}


def capture(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Dict[str, tuple]:
    """Each conv's input and output gradient for one forward and backward (fp32, as the activation-sparse
    kernels see them before any cast)."""
    inputs, grads, hooks = {}, {}, []

    def keep_grad(name):
        def hook(mod, inp, out):
            out.register_hook(lambda g: grads.__setitem__(name, g.detach().clone()))

        return hook

    for name, m in model.named_modules():
        if isinstance(m, nn.Conv2d):
            hooks.append(m.register_forward_pre_hook(lambda mod, inp, n=name: inputs.__setitem__(n, inp[0].detach())))
            hooks.append(m.register_forward_hook(keep_grad(name)))
    F.cross_entropy(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    for h in hooks:
        h.remove()
    return {n: (inputs[n], grads[n]) for n in inputs}


def model_rows(name: str, steps: int, batch: int) -> List[dict]:
    torch.manual_seed(0)
    model = build(name).to(memory_format=CL)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = digits_batches(batch, steps + 1)
    loss = torch.tensor(float("nan"))  # no step taken (--steps 0)
    for x, y in data[:steps]:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    rows = []
    for layer, (a, gy) in capture(model, *data[steps]).items():
        if bool((a < 0).any()):  # not behind a ReLU (the first conv): no activation sparsity to use
            continue
        row = {
            "model": name,
            "layer": layer,
            "shape": list(a.shape),
            "steps": steps,
            "loss": round(float(loss.detach()), 4),
        }
        row.update(tile_densities(a, "x"))
        row.update(tile_densities(gy, "dy"))
        row["work_bound_fwd"] = row["x_union16_pixels"]
        row["work_bound_dx"] = row["dy_union16_pixels"]
        row["work_bound_dw"] = min(row["x_union16_channels"], row["dy_union16_channels"])
        rows.append(row)
        print(
            f"{name:9s} {layer:12s} {str(tuple(a.shape)):18s} x {row['x_density']:.2f} "
            f"union16 px {row['x_union16_pixels']:.2f} ch {row['x_union16_channels']:.2f} | dY {row['dy_density']:.2f} "
            f"px {row['dy_union16_pixels']:.2f} ch {row['dy_union16_channels']:.2f} | work fwd/dx/dw "
            f"{row['work_bound_fwd']:.2f}/{row['work_bound_dx']:.2f}/{row['work_bound_dw']:.2f}",
            flush=True,
        )
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=ALL_MODELS, choices=ALL_MODELS)
    ap.add_argument("--steps", type=int, default=50, help="training steps before the capture (default 50)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.steps < 0 or args.batch < 1:
        raise SystemExit("--steps must be >= 0 and --batch >= 1")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    rows = [r for name in args.models for r in model_rows(name, args.steps, args.batch)]
    res = {
        "benchmark": "activation_tiles",
        "cpu": sparsa.cpu.cpu_info(),
        "method": f"{args.steps} SGD steps of bf16 autocast training on sklearn digits (batch {args.batch}), then "
        "one held-out batch's conv inputs and output gradients; tile fractions as in the module doc",
        "rows": rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    write_results(res, "activation_tiles", args.out)


if __name__ == "__main__":
    main()
