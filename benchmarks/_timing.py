"""Benchmark timing helpers; they live in :mod:`sparsa.timing` (also used by the demo)."""

from sparsa.timing import Comparison, compare, median_time  # noqa: F401

__all__ = ["Comparison", "compare", "median_time"]
