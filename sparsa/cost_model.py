"""Which implementation is fastest here: measured per-call costs, cached per CPU model.

Decisions such as ``only_if_faster`` time their candidates (dense float32, dense bfloat16, the
sparse kernel, ...) side by side, round robin, once per CPU model, thread count and shape, and keep
the medians in a JSON table under ``~/.cache/sparsa/cost/`` (``SPARSA_COST_DIR`` moves it;
``SPARSA_COST_DIR=off`` keeps it in memory only). A second run on the same machine answers from the
table at once; ``sparsa cost`` lists it and ``sparsa cost --clear`` (or :meth:`CostModel.clear`) forgets it.
Measurements made in real use can be fed back with :meth:`CostModel.observe`, which moves the stored figure
towards them. Cost *models* fitted from such timings (e.g. the adaptive runtime's per-layer
``fixed + slope * density``) are kept in the same table with :meth:`CostModel.set_fit`, so one file per
CPU holds every answer to "which implementation is fastest here", and one command lists or clears it.

Example::

    >>> from sparsa.cost_model import CostModel
    >>> cm = CostModel(path=None)                     # in memory only
    >>> costs = cm.measure("demo", {"a": lambda: sum(range(1000)), "b": lambda: sum(range(10))})
    >>> cm.fastest(costs)
    'b'
    >>> cm.measure("demo", {"a": None, "b": None}) == costs   # cached: nothing runs again
    True
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Optional

import torch

from . import cpu
from .environ import raw
from .timing import round_robin_ms

__all__ = ["CostModel", "default_cost_model", "cost_path"]

_VERSION = 1


def cost_path() -> Optional[Path]:
    """The table file for this CPU model and torch version, or None when ``SPARSA_COST_DIR=off``."""
    d = os.environ.get("SPARSA_COST_DIR", "")
    if d.lower() in ("off", "0", "none"):
        return None
    base = Path(d) if d else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sparsa" / "cost"
    slug = re.sub(r"[^a-z0-9]+", "-", str(cpu.cpu_info()["model"]).lower()).strip("-") or "cpu"
    return base / f"{slug}-torch{torch.__version__.split('+')[0]}.json"


class CostModel:
    """A table ``key -> {option: median ms}`` measured on this machine (see the module docs).

    A key names what was timed (op, shape, dtype, density, threads, kernel path); every option of a key
    is measured in the same round-robin run, so their ratios are steady even on a noisy machine.
    """

    def __init__(self, path: Optional[Path] = None):
        self.path = path
        self._lock = threading.Lock()
        self._table: Dict[str, Dict[str, float]] = {}
        self._fits: Dict[str, Dict[str, Any]] = {}
        self._fits_version = 0
        if path is not None and path.is_file():
            try:
                data = json.loads(path.read_text())
                if data.get("version") == _VERSION:
                    self._table = {k: {o: float(ms) for o, ms in v.items()} for k, v in data["entries"].items()}
                    self._fits = {k: dict(v) for k, v in data.get("fits", {}).items()}
            except (ValueError, KeyError, TypeError, AttributeError):
                self._table, self._fits = {}, {}  # a damaged table is re-measured, never trusted

    def __getstate__(self) -> Dict[str, Any]:
        # a lock cannot be pickled; the copy gets its own
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Timed keys plus fitted models."""
        return len(self._table) + len(self._fits)

    @property
    def fits_version(self) -> int:
        """Changes whenever a fitted model is stored or forgotten, so readers can cache what they derive."""
        return self._fits_version

    def keys(self):
        """The timed keys, sorted."""
        return sorted(self._table)

    def fit_keys(self, prefix: str = ""):
        """The keys of the fitted models that start with ``prefix``, sorted."""
        return sorted(k for k in self._fits if k.startswith(prefix))

    def fit(self, key: str) -> Optional[Dict[str, Any]]:
        """The fitted model stored under ``key`` (a copy of its parameters), or None."""
        v = self._fits.get(key)
        return dict(v) if v is not None else None

    def set_fit(self, key: str, params: Dict[str, Any], save: bool = True) -> None:
        """Store a model fitted from timings on this machine (JSON-serialisable parameters)."""
        if not isinstance(params, dict):
            raise TypeError(f"set_fit: params must be a dict of the model's parameters, got {type(params).__name__}")
        with self._lock:
            self._fits[key] = dict(params)
            self._fits_version += 1
        if save:
            self.save()

    def forget(self, prefix: str) -> int:
        """Forget the timings and fitted models whose key starts with ``prefix``; returns how many."""
        if not prefix:
            raise ValueError("forget: prefix must be non-empty (use clear() to forget everything)")
        with self._lock:
            gone = [k for k in self._table if k.startswith(prefix)]
            gone_fits = [k for k in self._fits if k.startswith(prefix)]
            for k in gone:
                del self._table[k]
            for k in gone_fits:
                del self._fits[k]
            self._fits_version += 1
        self.save()
        return len(gone) + len(gone_fits)

    def lookup(self, key: str) -> Optional[Dict[str, float]]:
        """The stored costs of ``key`` (a copy), or None."""
        v = self._table.get(key)
        return dict(v) if v is not None else None

    def measure(
        self, key: str, options: Dict[str, Optional[Callable[[], object]]], rounds: int = 5
    ) -> Dict[str, float]:
        """Median ms per call of each option, from the table when every option of ``key`` is there,
        else timed side by side now (round robin, warm-up first) and stored."""
        if not options:
            raise ValueError("measure: options must name at least one implementation to time")
        known = self._table.get(key)
        if known is not None and all(o in known for o in options):
            return {o: known[o] for o in options}
        missing = [o for o, fn in options.items() if fn is None]
        if missing:
            raise ValueError(f"measure: no stored cost for {missing} under {key!r}, and no function to time")
        costs = round_robin_ms(dict(options), rounds)  # type: ignore[arg-type]
        with self._lock:
            self._table[key] = dict(costs)
        self.save()
        return costs

    def observe(self, key: str, option: str, ms: float, weight: float = 0.25) -> None:
        """Online feedback: move the stored cost of ``option`` towards a time measured in real use."""
        if not (ms > 0):
            raise ValueError(f"observe: ms must be a positive time, got {ms!r}")
        if not 0 < weight <= 1:
            raise ValueError(f"observe: weight must be in (0, 1], got {weight!r}")
        with self._lock:
            entry = self._table.setdefault(key, {})
            old = entry.get(option)
            entry[option] = ms if old is None else (1 - weight) * old + weight * ms
        self.save()

    @staticmethod
    def fastest(costs: Dict[str, float], allowed: Optional[Iterable[str]] = None) -> str:
        """The option with the lowest cost among ``allowed`` (default: all)."""
        names = [o for o in (costs if allowed is None else allowed) if o in costs]
        if not names:
            raise ValueError(f"fastest: none of {list(allowed or [])} was measured (have {sorted(costs)})")
        return min(names, key=lambda o: costs[o])

    def clear(self) -> None:
        """Forget every measurement and fitted model (and the file)."""
        with self._lock:
            self._table.clear()
            self._fits.clear()
            self._fits_version += 1
        if self.path is not None and self.path.exists():
            self.path.unlink()

    def save(self) -> None:
        """Write the table atomically (no-op in memory-only mode; an empty table removes the file)."""
        if self.path is None:
            return
        with self._lock:
            if not self._table and not self._fits:
                self.path.unlink(missing_ok=True)
                return
            data = {"version": _VERSION, "cpu": cpu.cpu_info()["model"], "entries": self._table, "fits": self._fits}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".cost-")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=0, sort_keys=True)
            os.replace(tmp, self.path)


_DEFAULT: Dict[Optional[Path], CostModel] = {}
_BY_ENV: Dict[tuple, CostModel] = {}


def default_cost_model() -> CostModel:
    """The process's cost model for :func:`cost_path` (one per path, so tests can point it elsewhere)."""
    # the path depends only on these variables (and the CPU): skip rebuilding it on every call
    env = (raw(b"SPARSA_COST_DIR"), raw(b"XDG_CACHE_HOME"), raw(b"HOME"))
    cm = _BY_ENV.get(env)
    if cm is None:
        p = cost_path()
        if p not in _DEFAULT:
            _DEFAULT[p] = CostModel(p)
        cm = _BY_ENV[env] = _DEFAULT[p]
    return cm
