"""The GPU activation-sparsity monitor: the one :class:`sparsa.adaptive.SparsityMonitor`, device-aware.

On a GPU tensor the monitor counts the nonzeros of a strided sample with sparsa's Triton kernel
(:mod:`sparsa.gpu.act_sparse`) into a device tensor, so a refresh every k steps never syncs the host;
on a CPU tensor it samples as the CPU runtime does. This module keeps the old import path of the
monitor and of its sampled counter.

Example (on a GPU, or on the CPU with ``TRITON_INTERPRET=1``)::

    >>> import torch
    >>> from sparsa.gpu.monitor import sampled_density
    >>> d = sampled_density(torch.relu(torch.randn(1000)))       # doctest: +SKIP
    >>> 0.3 < float(d) < 0.7                                    # doctest: +SKIP
    True
"""

from ..adaptive.monitor import SparsityMonitor, sampled_counts, sampled_density

__all__ = ["sampled_counts", "sampled_density", "SparsityMonitor"]
