"""Where benchmark results go: ``$SPARSA_RESULTS_DIR`` if set, else ``benchmarks/results/<cpu class>``.

Results are kept per CPU class (``sparsa.cpu.cpu_class()``, e.g. ``amd-avx2``), so one machine's figures
never overwrite another kind's; the tests point ``SPARSA_RESULTS_DIR`` elsewhere to keep the committed
results intact.
"""

from __future__ import annotations

import os
from pathlib import Path

import sparsa.cpu

__all__ = ["results_dir"]


def results_dir() -> Path:
    """The results folder of this machine's CPU class (``$SPARSA_RESULTS_DIR`` overrides it)."""
    env = os.environ.get("SPARSA_RESULTS_DIR")
    return Path(env) if env else Path(__file__).resolve().parent / "results" / sparsa.cpu.cpu_class()
