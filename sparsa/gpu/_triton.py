"""Optional Triton: import it once, say clearly why it is missing, and build kernels lazily.

Triton decides at decoration time whether a kernel is compiled for the GPU or run by its CPU
interpreter (``TRITON_INTERPRET=1``). :class:`LazyKernel` keeps the plain Python function and
decorates it on first use for the mode that is active *then*, so the same kernel serves GPU runs and
interpreter tests in one process.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional

import torch

__all__ = ["triton_available", "why_unavailable", "require_triton", "interpreting", "LazyKernel", "gpu_eligible"]

_STATE: Dict[str, Any] = {}


def _load() -> Optional[Any]:
    if "mod" not in _STATE:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401

            _STATE["mod"], _STATE["why"] = triton, ""
        except Exception as e:  # ImportError, or a broken install
            _STATE["mod"] = None
            _STATE["why"] = (
                f"Triton is not importable ({type(e).__name__}: {e}); install it with "
                "`pip install triton` (Linux) to use sparsa's GPU kernels"
            )
    return _STATE["mod"]


def triton_available() -> bool:
    """True when ``import triton`` works."""
    return _load() is not None


def why_unavailable() -> str:
    """Empty when Triton is available, else the reason (and the fix)."""
    _load()
    return _STATE["why"]


def require_triton() -> Any:
    """The ``triton`` module, or ImportError with the reason."""
    mod = _load()
    if mod is None:
        raise ImportError(_STATE["why"])
    return mod


def interpreting() -> bool:
    """True when Triton's CPU interpreter is on (``TRITON_INTERPRET=1``) and Triton is importable."""
    v = os.environ.get("TRITON_INTERPRET", "").strip().lower()
    return v in ("1", "true", "on", "yes") and triton_available()


def gpu_eligible(*tensors: Any) -> bool:
    """Whether sparsa's Triton kernels should run for these tensors: all tensors on CUDA (and Triton
    available), or all on the CPU while the interpreter is on. Non-tensors are ignored."""
    ts = [t for t in tensors if isinstance(t, torch.Tensor)]
    if not ts:
        return False
    if all(t.is_cuda for t in ts):
        return triton_available()
    if all(t.device.type == "cpu" for t in ts):
        return interpreting()
    return False


class LazyKernel:
    """A Triton kernel decorated on first launch, once per mode (compiled or interpreted).

    >>> # @LazyKernel
    >>> # def _add(x_ptr, ...): ...
    >>> # _add[grid](x, ...)
    """

    def __init__(self, fn: Callable):
        self.fn = fn
        self.__name__ = fn.__name__
        self._jitted: Dict[bool, Any] = {}

    def jitted(self) -> Any:
        mode = interpreting()
        k = self._jitted.get(mode)
        if k is None:
            k = self._jitted[mode] = require_triton().jit(self.fn)
        return k

    def __getitem__(self, grid: Any) -> Any:
        return self.jitted()[grid]
