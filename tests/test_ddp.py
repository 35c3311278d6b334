"""DistributedDataParallel (gloo, 2 processes on 127.0.0.1) with sparse weights and RigL.

Each rank trains on its half of every global batch; the result must equal single-process training
on the whole batch: same values, same patterns, patterns identical on both ranks.
"""

import os
import socket
import sys
import time
import traceback
import warnings
from datetime import timedelta

import pytest

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import sparsa
from sparsa.methods import RigL, broadcast_sparse_parameters, patterns_in_sync
from sparsa.sparsifiers import Magnitude

STEPS, GLOBAL_BATCH, WORLD = 9, 16, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4)).double()
    return sparsa.sparsify(m, Magnitude(0.8))


def _data():
    g = torch.Generator().manual_seed(123)
    xs = torch.randn(STEPS, GLOBAL_BATCH, 10, generator=g, dtype=torch.float64)
    ys = torch.randint(0, 4, (STEPS, GLOBAL_BATCH), generator=g)
    return xs, ys


def _train(model: nn.Module, inner: nn.Module, xs, ys):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    rigl = RigL(inner, opt, update_every=3, drop_fraction=0.3, end_step=STEPS)
    for step in range(STEPS):
        opt.zero_grad()
        nn.functional.cross_entropy(model(xs[step]), ys[step]).backward()
        rigl.step(step + 1)
        opt.step()


def _state(model: nn.Module):
    return {
        n: (p.to_dense().detach().clone(), p.pattern().clone() if isinstance(p, sparsa.SparseTensor) else None)
        for n, p in model.named_parameters()
    }


#: seconds the two ranks get in all (they take a few here); past it the test fails instead of hanging
DEADLINE = 240


def _worker(rank: int, port: int, out_path: str) -> None:
    warnings.simplefilter("ignore")
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
        model = _model(seed=rank)  # deliberately different on each rank
        assert broadcast_sparse_parameters(model) == 2  # DDP broadcasts only the dense ones
        ddp = nn.parallel.DistributedDataParallel(model)
        assert patterns_in_sync(model)
        xs, ys = _data()
        half = GLOBAL_BATCH // WORLD
        local = slice(rank * half, (rank + 1) * half)
        _train(ddp, model, xs[:, local], ys[:, local])
        in_sync = patterns_in_sync(model)
        if rank == 0:
            torch.save({"state": _state(model), "in_sync": in_sync}, out_path)
        dist.barrier()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    # Leave without destroy_process_group: ProcessGroupGloo's destructor joins its run-loop thread while
    # holding the GIL, and that thread can be waiting for the GIL (a deadlock seen in CI).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_ddp_matches_single_process_with_rigl(tmp_path):
    out = str(tmp_path / "rank0.pt")
    ctx = mp.start_processes(_worker, args=(_free_port(), out), nprocs=WORLD, join=False, start_method="spawn")
    end = time.monotonic() + DEADLINE
    while not ctx.join(timeout=2):  # raises if a rank failed
        if time.monotonic() > end:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {WORLD} DDP ranks did not finish within {DEADLINE} s")
    got = torch.load(out, weights_only=False)
    assert got["in_sync"]

    warnings.simplefilter("ignore")
    ref = _model(seed=0)
    start = _state(ref)
    xs, ys = _data()
    _train(ref, ref, xs, ys)
    want = _state(ref)
    changed = False
    for name, (values, mask) in want.items():
        g_values, g_mask = got["state"][name]
        torch.testing.assert_close(g_values, values, rtol=1e-7, atol=1e-9)
        if mask is not None:
            assert torch.equal(g_mask, mask), name
            changed |= not torch.equal(mask, start[name][1])
    assert changed  # RigL really moved the patterns
