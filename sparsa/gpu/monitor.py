"""GPU-side activation-sparsity monitor: a sampled nonzero count that never syncs the host.

A Triton kernel reads every ``stride``-th element (at most ``samples`` of them, from a rotating
offset) and atomically adds the nonzero and sample counts into a 2-element device tensor, so the
estimate can be refreshed every k steps inside a training loop without a host round-trip; reading it
(``float(...)``) is the only sync.

Example (on a GPU, or on the CPU with ``TRITON_INTERPRET=1``)::

    >>> import torch
    >>> from sparsa.gpu.monitor import sampled_density
    >>> d = sampled_density(torch.relu(torch.randn(1000)))       # doctest: +SKIP
    >>> 0.3 < float(d) < 0.7                                    # doctest: +SKIP
    True
"""
from typing import Optional

import torch
from torch import Tensor

from ._launch import launch_opts
from ._triton import LazyKernel, gpu_eligible, require_triton

triton = require_triton()
import triton.language as tl  # noqa: E402

__all__ = ["sampled_counts", "sampled_density", "SparsityMonitor"]


@LazyKernel
def _sampled_count_kernel(x_ptr, out_ptr, numel, n_samples, stride, offset, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    i = (pid * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    idx = i * stride + offset
    ok = (i < n_samples) & (idx < numel)
    v = tl.load(x_ptr + idx, mask=ok, other=0)
    tl.atomic_add(out_ptr, tl.sum(((v != 0) & ok).to(tl.int32), axis=0))
    tl.atomic_add(out_ptr + 1, tl.sum(ok.to(tl.int32), axis=0))


def _plan(numel: int, samples: int, offset: int):
    if samples <= 0:
        raise ValueError(f"samples must be positive, got {samples}")
    stride = max(1, numel // samples)
    return stride, offset % stride, min(samples, numel)


def sampled_counts(x: Tensor, samples: int = 4096, offset: int = 0, out: Optional[Tensor] = None) -> Tensor:
    """Add (nonzeros, samples) of a strided sample of ``x`` into ``out`` (int32, 2 elements; created
    zeroed when None) and return it. Runs in Triton where :func:`~sparsa.gpu._triton.gpu_eligible`,
    else with plain torch ops (same sample)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    flat = x.detach().reshape(-1)
    if out is None:
        out = torch.zeros(2, dtype=torch.int32, device=x.device)
    n = flat.numel()
    if n == 0:
        return out
    stride, off, ns = _plan(n, samples, offset)
    if gpu_eligible(flat):
        flat = flat.contiguous()
        block = 1024
        _sampled_count_kernel[(triton.cdiv(ns, block),)](flat, out, n, ns, stride, off, BLOCK=block,
                                                          **launch_opts(4, 1))
    else:
        s = flat[off::stride][:ns]
        out += torch.stack([(s != 0).sum(), torch.tensor(s.numel(), device=s.device)]).to(out.dtype)
    return out


def sampled_density(x: Tensor, samples: int = 4096, offset: int = 0) -> Tensor:
    """Estimated fraction of nonzeros of ``x`` as a 0-dim float32 tensor on ``x``'s device (no sync)."""
    c = sampled_counts(x, samples, offset)
    return c[0].float() / c[1].clamp_min(1).float()


class SparsityMonitor:
    """Running sampled density of an activation, refreshed every ``every`` calls of :meth:`observe`.

    >>> mon = SparsityMonitor(every=10)
    >>> # mon.observe(act) in forward; mon.density (a float, syncs) when the policy decides
    """

    def __init__(self, every: int = 10, samples: int = 4096):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every, self.samples = int(every), int(samples)
        self.steps = 0
        self._counts: Optional[Tensor] = None

    def observe(self, x: Tensor) -> None:
        """Count a fresh sample of ``x`` (rotating offset) when the step is due; otherwise nothing."""
        if self.steps % self.every == 0:
            self._counts = sampled_counts(x, self.samples, offset=self.steps // self.every)
        self.steps += 1

    @property
    def density_tensor(self) -> Optional[Tensor]:
        """Latest estimate as a device tensor (no sync), or None before the first observation."""
        c = self._counts
        return None if c is None else c[0].float() / c[1].clamp_min(1).float()

    @property
    def density(self) -> Optional[float]:
        """Latest estimate as a float (syncs), or None before the first observation."""
        d = self.density_tensor
        return None if d is None else float(d)
