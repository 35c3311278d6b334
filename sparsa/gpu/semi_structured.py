"""PyTorch's own 2:4 semi-structured sparse path (cuSPARSELt / CUTLASS sparse tensor cores).

Where a CUDA GPU of compute capability 8.0+ is present, a 2:4 :class:`~sparsa.layouts.NM` weight is
converted once (cached on the layout) with ``torch.sparse.to_sparse_semi_structured`` and
``F.linear`` runs on the sparse tensor cores. Never used on the CPU. Shapes or dtypes PyTorch rejects
are remembered per layout and served by the Triton N:M kernel instead.

Example::

    >>> from sparsa.gpu.semi_structured import semi_structured_supported
    >>> ok, why = semi_structured_supported()      # (False, 'no CUDA device ...') on a CPU machine
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["semi_structured_supported", "semi_structured_weight", "semi_structured_linear", "SEMI_STRUCTURED_DTYPES"]

SEMI_STRUCTURED_DTYPES = (torch.float16, torch.bfloat16)


def semi_structured_supported(device=None) -> Tuple[bool, str]:
    """(supported, reason): whether this torch build and GPU run 2:4 semi-structured matmuls."""
    if not torch.cuda.is_available():
        return False, "no CUDA device (semi-structured 2:4 needs an NVIDIA GPU of compute capability >= 8.0)"
    dev = torch.device(device if device is not None else "cuda")
    if dev.type != "cuda":
        return False, f"device {dev} is not a CUDA device"
    if getattr(torch.version, "hip", None):
        return False, "ROCm build: sparsa does not use semi-structured sparsity there"
    cap = torch.cuda.get_device_capability(dev)
    if cap < (8, 0):
        return False, f"compute capability {cap[0]}.{cap[1]} < 8.0 has no sparse tensor cores"
    try:
        from torch.sparse import to_sparse_semi_structured  # noqa: F401
    except ImportError:
        return False, "this torch build has no torch.sparse.to_sparse_semi_structured"
    return True, ""


def semi_structured_weight(layout) -> Optional[Tensor]:
    """The layout's weight as a semi-structured sparse tensor (cached), or None where not possible."""
    cache = layout.__dict__.setdefault("_gpu_cache", {})
    if "semi" in cache:
        return cache["semi"]
    w = None
    if (
        (layout.n, layout.m) == (2, 4)
        and len(layout.shape) == 2
        and layout.dtype in SEMI_STRUCTURED_DTYPES
        and layout.values.is_cuda
        and semi_structured_supported(layout.values.device)[0]
    ):
        from torch.sparse import to_sparse_semi_structured

        try:
            w = to_sparse_semi_structured(layout.to_dense().contiguous())
        except (RuntimeError, ValueError, NotImplementedError) as e:  # shape/dtype rejected by the backend
            cache["semi_error"] = f"{type(e).__name__}: {e}"
            w = None
    cache["semi"] = w
    return w


def semi_structured_linear(x: Tensor, layout, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear(x, W, bias)`` on the sparse tensor cores; ValueError where unavailable for ``layout``."""
    w = semi_structured_weight(layout)
    if w is None:
        why = (
            layout.__dict__.get("_gpu_cache", {}).get("semi_error")
            or semi_structured_supported()[1]
            or "the weight must be a 2-D 2:4 NM layout in float16/bfloat16 on a CUDA device"
        )
        raise ValueError(f"semi-structured path unavailable for this weight: {why}")
    lead = x.shape[:-1]
    y = F.linear(x.reshape(-1, x.shape[-1]), w, bias)
    return y.reshape(*lead, y.shape[-1])
