"""Operators: registry, dispatcher and the built-in implementations."""
from .registry import implements, register_impl, registered_impls, Impl, OPS  # noqa: F401
from .dispatch import fallback_counts, reset_fallback_counts, SparseFallbackWarning, explain  # noqa: F401
