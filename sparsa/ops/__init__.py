"""Operators: the op table, registry, dispatcher and the built-in implementations."""

from .registry import implements, register_impl, registered_impls, Impl, Registration, OPS  # noqa: F401
from .dispatch import fallback_counts, reset_fallback_counts, SparseFallbackWarning, explain  # noqa: F401
from .strict import strict, is_strict, SparseFallbackError  # noqa: F401
from . import aten_fallback  # noqa: F401  (the aten-level handler SparseTensor.__torch_dispatch__ calls)
from . import builtin  # noqa: F401  (registers every built-in implementation, CPU and GPU)
