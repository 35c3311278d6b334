"""Is adaptive training's loss equal to dense training's? Separate rounding from bugs.

Trains three copies of a model from the same initial weights on the same batches (SGD, momentum):
dense; adaptive with *every* ReLU-fed layer forced onto the sparse kernels; and dense again with the
weights perturbed by a relative 1e-7 (rounding-sized noise). Prints the per-step loss differences.
If adaptive-vs-dense stays at rounding level in the first steps and then grows no faster than the
perturbed-dense control, the divergence is the model's sensitivity to rounding, not a kernel error.

    python benchmarks/adaptive_loss_check.py [--model vgg16] [--steps 40] [--batch 16]
"""

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import adaptive_training as B  # noqa: E402
import sparsa.adaptive as sa  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="vgg16")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    dense = B.build(args.model)
    adaptive, control = copy.deepcopy(dense), copy.deepcopy(dense)
    with torch.no_grad():
        for p in control.parameters():
            p.mul_(1 + 1e-7 * torch.randn_like(p))
    rt = sa.enable(adaptive, every=10, policy=sa.Policy(force="sparse"))
    models = (dense, adaptive, control)
    opts = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in models]
    print("step  loss_dense  |adaptive-dense|  |perturbed-dense|")
    for i, (x, y) in enumerate(B.digits_batches(args.batch, args.steps)):
        ld, la, lc = (B.train_step(m, o, x, y) for m, o in zip(models, opts))
        print(f"{i:4d}  {ld:10.6f}  {abs(la - ld):15.2e}  {abs(lc - ld):17.2e}", flush=True)
    print(f"layers on the sparse kernels: {sum(r['path'] == 'sparse' for r in rt.report())} of {len(rt.report())}")


if __name__ == "__main__":
    main()
