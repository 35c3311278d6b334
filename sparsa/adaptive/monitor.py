"""Monitor: a cheap, periodically refreshed per-layer estimate of activation sparsity, on any device.

Counting every zero of every activation every step ("full profiling") costs a pass over all
activations. The monitor instead refreshes every ``every`` calls and then

- on the CPU, either takes the exact count for free when the layer just ran the sparse path (the
  compaction's per-(pixel, slice) counts are the measurement: counting fused into the ReLU +
  compaction), or samples ``pixels`` random pixels (all their channels; at most ``elements`` values)
  of the activation: the element-wise zero fraction and, at the kernels' granularity, the fraction of
  empty (pixel, channel-slice) lists;
- on a GPU, counts the nonzeros of a strided sample of ``samples`` elements (rotating offset) on the
  device (sparsa's Triton kernel where it runs, else PyTorch ops) into a device tensor, so a refresh
  never waits for the GPU; reading :attr:`SparsityMonitor.sparsity` or ``density`` is the only sync,
  :attr:`SparsityMonitor.density_tensor` none.

This is the one monitor of sparsa (``sparsa.gpu.monitor.SparsityMonitor`` is the same class).

Example::

    >>> import torch
    >>> from sparsa.adaptive import SparsityMonitor
    >>> m = SparsityMonitor(every=1, pixels=64)
    >>> x = torch.relu(torch.randn(4, 16, 8, 8))
    >>> m.observe(x)
    True
    >>> abs(m.sparsity - 0.5) < 0.1
    True
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..gpu._triton import gpu_eligible
from ..kernels import adaptive as _k
from .compaction import DEFAULT_SLICE

__all__ = ["SparsityMonitor", "sampled_counts", "sampled_density"]


def _sample_plan(numel: int, samples: int, offset: int):
    if samples <= 0:
        raise ValueError(f"samples must be positive, got {samples}; e.g. samples=4096")
    stride = max(1, numel // samples)
    return stride, offset % stride, min(samples, numel)


def sampled_counts(x: Tensor, samples: int = 4096, offset: int = 0, out: Optional[Tensor] = None) -> Tensor:
    """Add (nonzeros, samples) of every ``numel // samples``-th element of ``x`` (from ``offset``) into
    ``out`` (int32, 2 elements, on ``x``'s device; created zeroed when None) and return it, without a
    host sync. Counted by sparsa's Triton kernel where :func:`sparsa.gpu.gpu_eligible`, else with
    PyTorch ops (the same sample)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    flat = x.detach().reshape(-1)
    if out is None:
        out = torch.zeros(2, dtype=torch.int32, device=x.device)
    n = flat.numel()
    if n == 0:
        return out
    stride, off, ns = _sample_plan(n, int(samples), int(offset))
    if gpu_eligible(flat):
        from ..gpu.act_sparse import _sampled_count  # Triton: imported only where it runs

        _sampled_count(flat.contiguous(), out, n, ns, stride, off)
    else:
        s = flat[off::stride][:ns]
        out += torch.stack([(s != 0).sum(), torch.tensor(s.numel(), device=s.device)]).to(out.dtype)
    return out


def sampled_density(x: Tensor, samples: int = 4096, offset: int = 0) -> Tensor:
    """Estimated fraction of nonzeros of ``x`` as a 0-dim float32 tensor on ``x``'s device (no sync)."""
    c = sampled_counts(x, samples, offset)
    return c[0].float() / c[1].clamp_min(1).float()


class SparsityMonitor:
    """Per-layer sparsity estimate, refreshed every ``every`` calls from a sample or a fused count.

    ``pixels``, ``elements``, ``slice`` and ``seed`` shape the CPU sample, ``samples`` the device one.
    """

    def __init__(
        self,
        every: int = 10,
        pixels: int = 512,
        slice: int = DEFAULT_SLICE,
        seed: int = 0,
        elements: int = 32768,
        samples: int = 4096,
    ):
        if int(every) < 1:
            raise ValueError(f"every must be a positive number of calls, got {every!r}; e.g. every=10")
        if int(pixels) < 1:
            raise ValueError(f"pixels must be a positive sample size, got {pixels!r}; e.g. pixels=512")
        if int(samples) < 1:
            raise ValueError(f"samples must be a positive sample size, got {samples!r}; e.g. samples=4096")
        self.every = int(every)
        self.pixels = int(pixels)
        self.elements = int(elements)
        self.slice = int(slice)
        self.samples = int(samples)
        self.calls = 0
        self.refreshes = 0
        self._sparsity: Optional[float] = None
        #: the device sample's (nonzeros, samples) counts not read yet (the host has not synced)
        self._counts: Optional[Tensor] = None
        #: fraction of (pixel, channel-slice) lists with no nonzero (CPU estimates only)
        self.empty_slices: Optional[float] = None
        #: "sample" or "count": where the last estimate came from
        self.source: Optional[str] = None
        self._gen = torch.Generator().manual_seed(int(seed))
        self._key = None
        self._index = None

    @property
    def sparsity(self) -> Optional[float]:
        """Element-wise zero fraction (None until the first refresh); reading a device estimate syncs."""
        if self._counts is not None:
            c = self._counts.tolist()
            self._counts = None
            self._sparsity = 1.0 - c[0] / max(1, c[1])
        return self._sparsity

    @sparsity.setter
    def sparsity(self, value: Optional[float]) -> None:
        self._counts = None
        self._sparsity = value

    @property
    def density(self) -> Optional[float]:
        """``1 - sparsity`` (None until the first refresh)."""
        s = self.sparsity
        return None if s is None else 1.0 - s

    @property
    def density_tensor(self) -> Optional[Tensor]:
        """The latest density as a 0-dim float32 tensor, on the device it was measured on, without a sync."""
        if self._counts is not None:
            c = self._counts
            return c[0].float() / c[1].clamp_min(1).float()
        return None if self._sparsity is None else torch.tensor(1.0 - self._sparsity)

    @property
    def steps(self) -> int:
        """Calls counted so far (the name the GPU monitor used)."""
        return self.calls

    def due(self) -> bool:
        """True when the next call refreshes the estimate."""
        return self.calls % self.every == 0

    def observe(self, x: Tensor) -> bool:
        """Count one call; on refresh calls, sample ``x`` (``[N, C, H, W]`` or ``[..., K]``). Returns
        True when the estimate was refreshed."""
        refresh = self.tick()
        if refresh:
            if x.device.type == "cpu":
                self._sample(x.detach())
            else:
                self._counts = sampled_counts(x, self.samples, offset=self.refreshes - 1)
                self.empty_slices = None
                self.source = "sample"
        return refresh

    def tick(self) -> bool:
        """Count one call without sampling; True when this call is a refresh (the caller then
        provides the measurement through :meth:`record_count` or :meth:`observe`'s sample)."""
        refresh = self.due()
        self.calls += 1
        if refresh:
            self.refreshes += 1
        return refresh

    def record_count(self, cnt: Tensor, numel: int) -> None:
        """Set the estimate from an exact per-(pixel, slice) nonzero count (fused into compaction)."""
        nnz = int(cnt.sum(dtype=torch.int64))
        self.sparsity = 1.0 - nnz / max(1, numel)
        self.empty_slices = float((cnt == 0).float().mean()) if cnt.numel() else 1.0
        self.source = "count"

    # ------------------------------------------------------------------ sampling
    def _rows(self, x: Tensor) -> Tensor:
        """A ``[m, C]`` sample: m random pixels (rows), every channel, gathered with one ``take``."""
        x4 = x if x.dim() == 4 else x.reshape(-1, x.shape[-1]).t().unsqueeze(0).unsqueeze(-1)
        N, C, H, W = x4.shape
        P = N * H * W
        key = (tuple(x4.shape), tuple(x4.stride()))
        if self._key != key:
            m = min(self.pixels, P, max(32, self.elements // max(1, C)))
            q = torch.randperm(P, generator=self._gen)[:m]
            sn, sc, sh, sw = x4.stride()
            base = (q // (H * W)) * sn + ((q // W) % H) * sh + (q % W) * sw
            self._index = (base.view(-1, 1) + torch.arange(C).view(1, -1) * sc).reshape(-1)
            self._m = m
            self._key = key
        if x4.is_contiguous() or x4.is_contiguous(memory_format=torch.channels_last):
            flat = x4.as_strided((x4.numel(),), (1,))  # dense storage: strided offsets are flat ones
        else:
            flat = x4.contiguous().view(-1)
            sn, sc, sh, sw = x4.contiguous().stride()
            self._key = None  # offsets above assumed the original strides; rebuild next time
            return flat[self._rebuild(x4.shape, (sn, sc, sh, sw))].view(self._m, C)
        return flat[self._index].view(self._m, C)

    def _sample_native(self, x: Tensor) -> bool:
        """One native call over the sampled pixels (no intermediate tensors); False if unavailable."""
        x4 = x if x.dim() == 4 else x.reshape(-1, x.shape[-1]).t().unsqueeze(0).unsqueeze(-1)
        N, C, H, W = x4.shape
        key = ("native", tuple(x4.shape), tuple(x4.stride()))
        if self._key != key:
            P = N * H * W
            m = min(self.pixels, P, max(32, self.elements // max(1, C)))
            q = torch.randperm(P, generator=self._gen)[:m]
            sn, sc, sh, sw = x4.stride()
            self._base = ((q // (H * W)) * sn + ((q // W) % H) * sh + (q % W) * sw).contiguous()
            self._m = m
        res = _k.sample_zeros(x4, self._base, self.slice)
        if res is None:
            return False
        self._key = key
        zeros, empty = res
        S = -(-C // self.slice)
        self.sparsity = zeros / max(1, self._m * C)
        self.empty_slices = empty / max(1, self._m * S)
        self.source = "sample"
        return True

    def _rebuild(self, shape, stride) -> Tensor:
        N, C, H, W = shape
        q = torch.randperm(N * H * W, generator=self._gen)[: self._m]
        base = (q // (H * W)) * stride[0] + ((q // W) % H) * stride[2] + (q % W) * stride[3]
        return (base.view(-1, 1) + torch.arange(C).view(1, -1) * stride[1]).reshape(-1)

    def _sample(self, x: Tensor) -> None:
        if self._sample_native(x):
            return
        rows = self._rows(x)
        m, C = rows.shape
        nz = rows != 0
        self.sparsity = 1.0 - int(torch.count_nonzero(nz)) / max(1, nz.numel())
        S = -(-C // self.slice)
        pad = S * self.slice - C
        if pad:
            nz = torch.nn.functional.pad(nz, (0, pad))
        self.empty_slices = 1.0 - int(torch.count_nonzero(nz.view(m, S, self.slice).any(-1))) / max(1, m * S)
        self.source = "sample"
