"""``import sparsa`` has a documented ``__all__`` (with ``adaptive``); every module imports on its own.

Importing any ``sparsa.x.y`` first runs ``sparsa/__init__.py`` to the end, so "each module alone in a
fresh interpreter" is: ``import sparsa`` in a fresh interpreter, then every module it did not load,
each in a process forked from that state (a fresh ``python -c "import sparsa.x.y"`` per module would
cost a torch import each). An import cycle that only works from some entry point fails here. The import
graph itself (module-level and deferred imports, no cycles) is checked in ``tests/test_import_graph.py``.
"""

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import sparsa

ROOT = Path(__file__).resolve().parent.parent


def test_all_names_resolve_and_include_adaptive():
    assert "adaptive" in sparsa.__all__
    assert len(set(sparsa.__all__)) == len(sparsa.__all__)
    missing = [n for n in sparsa.__all__ if not hasattr(sparsa, n)]
    assert not missing, f"sparsa.__all__ names that do not resolve: {missing}"
    assert sparsa.adaptive is sys.modules["sparsa.adaptive"] and callable(sparsa.adaptive.enable)
    ns: dict = {}
    exec("from sparsa import *", ns)
    assert set(sparsa.__all__) <= set(ns)


def test_every_public_attribute_is_in_all():
    public = {n for n, v in vars(sparsa).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    assert public <= set(sparsa.__all__), f"public names missing from sparsa.__all__: {public - set(sparsa.__all__)}"


def _module_names():
    out = []
    for p in sorted((ROOT / "sparsa").rglob("*.py")):
        if "__pycache__" in p.parts or not (p.parent / "__init__.py").exists():
            continue
        parts = p.relative_to(ROOT).with_suffix("").parts
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


# Run in a fresh interpreter: import sparsa, then fork once per module it did not load and import that
# module in the child. A module whose only failure is a missing third-party package is skipped.
_CHECK = r"""
import importlib, os, sys, traceback
import sparsa
loaded = set(sys.modules)
bad = []
for name in sys.argv[1:]:
    if name in loaded:
        continue
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        msg = ""
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] == "sparsa":
                msg = traceback.format_exc()
        except BaseException:
            msg = traceback.format_exc()
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    chunks = []
    while True:
        b = os.read(r, 65536)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    msg = b"".join(chunks).decode()
    if msg or status:
        bad.append(f"--- import {name} (status {status})\n{msg}")
print("\n".join(bad))
sys.exit(1 if bad else 0)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_each_module_imports_alone():
    names = _module_names()
    assert "sparsa.adaptive" in names and "sparsa.ops.dispatch" in names
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHECK, *names], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"modules that fail to import alone:\n{proc.stdout}{proc.stderr}"


def test_import_sparsa_and_adaptive_builds_nothing_and_sets_no_environment():
    code = (
        "import os, sys; before = dict(os.environ); import sparsa, sparsa.adaptive; "
        "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items()); "
        "assert 'torch.utils.cpp_extension' not in sys.modules, 'a native build module was imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
