"""Where benchmark results go: ``$SPARSA_RESULTS_DIR`` if set, else ``benchmarks/results/<cpu class>``.

Results are kept per CPU class (``sparsa.cpu.cpu_class()``, e.g. ``amd-avx2``), so one machine's figures
never overwrite another kind's; the tests point ``SPARSA_RESULTS_DIR`` elsewhere to keep the committed
results intact.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Optional

import sparsa.cpu

__all__ = ["results_dir", "write_results"]


def results_dir() -> Path:
    """The results folder of this machine's CPU class (``$SPARSA_RESULTS_DIR`` overrides it)."""
    env = os.environ.get("SPARSA_RESULTS_DIR")
    return Path(env) if env else Path(__file__).resolve().parent / "results" / sparsa.cpu.cpu_class()


def write_results(res: Dict[str, Any], name: str, out: Optional[Path] = None) -> Path:
    """Write ``res`` (with ``rows`` and ``seconds``) as JSON to ``out``, or to ``<results dir>/<name>.json``, and
    say where; returns the path."""
    out = out or results_dir() / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out} ({len(res['rows'])} rows, {res['seconds']} s)")
    return out
