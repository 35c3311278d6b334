"""Native kernels (C++ AVX2/FMA + OpenMP, JIT-built) and their pure-PyTorch fallbacks."""

from .loader import load, native_enabled, build_info  # noqa: F401
