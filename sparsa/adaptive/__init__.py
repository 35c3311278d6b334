"""Sparsity-adaptive training (Spartan, in software, on the CPU).

ReLU outputs are often 45-80% zeros. This runtime monitors each layer's input sparsity cheaply,
compacts the activation with a fused ReLU + compaction kernel and runs all three training GEMMs of
Conv2d / Linear (forward, weight gradient, input gradient) on the compacted operand, where a cost
model calibrated on this machine says it pays, with hysteresis.

Example::

    >>> import torch, sparsa.adaptive as sa
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
    ...                           torch.nn.Conv2d(16, 16, 3, padding=1))
    >>> rt = sa.enable(net)                 # calibrates each new layer shape on first use (cached)
    >>> net(torch.randn(2, 3, 8, 8)).sum().backward()
    >>> rows = rt.report()                  # per-layer sparsity, path, predicted/measured time
"""

from .compaction import CompactActivation, compact, compact_matrix, DEFAULT_SLICE  # noqa: F401
from .conv import relu_conv2d  # noqa: F401
from .linear import relu_linear  # noqa: F401
from .monitor import SparsityMonitor  # noqa: F401
from .policy import Policy  # noqa: F401
from .calibration import Calibration, CostEntry, default_calibration  # noqa: F401
from .modules import AdaptiveConv2d, AdaptiveLinear, LayerState  # noqa: F401
from .report import report, format_report  # noqa: F401
from .enable import enable, AdaptiveRuntime, runtime_of  # noqa: F401
