"""GPU path: Triton kernels for activation-sparse training and sparse-weight inference.

Importing ``sparsa.gpu`` is cheap; Triton is imported on first use of a kernel. This package holds the
kernels only and imports nothing of the dispatcher; :mod:`sparsa.ops.gpu_impls` registers them, chosen
by device: on CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``) they run, elsewhere the CPU
implementations do. The activation-sparsity monitor is one class for CPU and GPU,
:class:`sparsa.adaptive.SparsityMonitor` (``sparsa.gpu.SparsityMonitor`` is the same class).

>>> import sparsa.gpu
>>> ok = sparsa.gpu.triton_available()     # False (with sparsa.gpu.why_unavailable()) without Triton
"""

from ._triton import triton_available, why_unavailable, interpreting, gpu_eligible  # noqa: F401
from .semi_structured import semi_structured_supported  # noqa: F401

_LAZY = {
    "bsr_linear": "weight_sparse",
    "nm_linear": "weight_sparse",
    "bsr_supported": "weight_sparse",
    "act_sparse_linear": "act_sparse",
    "act_sparse_conv2d": "act_sparse",
    "sampled_density": "monitor",
    "SparsityMonitor": "monitor",
}
# former names, still resolved: the panel compaction is private now (sparsa.adaptive.compact is the public one)
_FORMER = {"compact": "act_sparse"}


def __getattr__(name: str):
    mod = _LAZY.get(name) or _FORMER.get(name)
    if mod is None:
        raise AttributeError(f"module 'sparsa.gpu' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{mod}"), name)


__all__ = ["triton_available", "why_unavailable", "interpreting", "gpu_eligible", "semi_structured_supported", *_LAZY]
