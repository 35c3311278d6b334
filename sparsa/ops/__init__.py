"""Operators: registry, dispatcher and the built-in implementations."""
from .registry import implements, register_impl, registered_impls, Impl, OPS  # noqa: F401
from .dispatch import fallback_counts, reset_fallback_counts, SparseFallbackWarning, explain  # noqa: F401
from .strict import strict, is_strict, SparseFallbackError  # noqa: F401
from . import aten_fallback  # noqa: F401  (installs the aten-level handler of SparseTensor)
from . import native_linear  # noqa: F401
from . import bitmask_linear  # noqa: F401
from . import builtin  # noqa: F401  (registers the pure-PyTorch implementations)
from . import native_grouped_nm  # noqa: F401  (after builtin: replaces its grouped_nm linear)
from ..gpu import register as _gpu_register  # noqa: F401,E402  (GPU implementations, chosen by device)
