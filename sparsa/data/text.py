"""Offline English text: sentences from the docstrings of Python standard-library modules.

Deterministic (a fixed module list, sorted attribute walk, de-duplicated) and disjoint splits for
calibration and evaluation, so pruning is never scored on the text it was calibrated on.

>>> calib, held_out = calibration_and_evaluation(32, 32)
>>> len(calib), len(held_out), set(calib).isdisjoint(held_out)
(32, 32, True)
"""
from __future__ import annotations

import importlib
import inspect
import random
import re
import warnings
from functools import lru_cache
from typing import List, Tuple

__all__ = ["MODULES", "stdlib_sentences", "calibration_and_evaluation"]

#: modules whose docstrings are read (importing them has no side effects)
MODULES = ("abc", "argparse", "ast", "base64", "bisect", "calendar", "collections", "csv", "dataclasses",
           "datetime", "decimal", "difflib", "email.message", "enum", "fractions", "functools", "gzip", "hashlib",
           "heapq", "html.parser", "http.client", "inspect", "ipaddress", "itertools", "json", "logging",
           "mimetypes", "os", "pathlib", "pickle", "pprint", "queue", "random", "re", "shutil", "socket",
           "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "typing",
           "unittest", "urllib.parse", "uuid", "warnings", "zipfile")

_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def _docstrings(module_name: str) -> List[str]:
    try:
        mod = importlib.import_module(module_name)
    except ImportError:
        return []
    docs = [inspect.getdoc(mod) or ""]
    for name in sorted(vars(mod)):
        with warnings.catch_warnings():  # e.g. typing.io warns when touched
            warnings.simplefilter("ignore", DeprecationWarning)
            obj = getattr(mod, name, None)
        if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
            continue
        docs.append(inspect.getdoc(obj) or "")
        if inspect.isclass(obj):
            docs += [inspect.getdoc(v) or "" for k, v in sorted(vars(obj).items()) if not k.startswith("_")
                     and (inspect.isfunction(v) or isinstance(v, property))]
    return docs


def stdlib_sentences(min_chars: int = 40, max_chars: int = 200) -> List[str]:
    """English sentences from stdlib docstrings: prose only (no code, no ``>>>``), de-duplicated, in a
    fixed order."""
    return list(_sentences(min_chars, max_chars))


@lru_cache(maxsize=4)
def _sentences(min_chars: int, max_chars: int) -> tuple:
    seen, out = set(), []
    for mod in MODULES:
        for doc in _docstrings(mod):
            for para in doc.split("\n\n"):
                if ">>>" in para or para.lstrip().startswith(("-", "*", ":", "|")):
                    continue
                for s in _SPLIT.split(" ".join(para.split())):
                    letters = sum(c.isalpha() or c == " " for c in s)
                    if min_chars <= len(s) <= max_chars and letters > 0.85 * len(s) and s not in seen:
                        seen.add(s)
                        out.append(s)
    return tuple(out)


def calibration_and_evaluation(n_calibration: int, n_evaluation: int, seed: int = 0) -> Tuple[List[str], List[str]]:
    """Two disjoint, deterministic samples of :func:`stdlib_sentences`."""
    pool = stdlib_sentences()
    if n_calibration + n_evaluation > len(pool):
        raise ValueError(f"asked for {n_calibration} + {n_evaluation} sentences but only {len(pool)} are available; "
                         "ask for fewer")
    random.Random(seed).shuffle(pool)
    return pool[:n_calibration], pool[n_calibration:n_calibration + n_evaluation]
