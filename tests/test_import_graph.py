"""sparsa's modules form one import graph without cycles, and each module imports on its own.

The graph is read from the source (``ast``), not from a running interpreter, so it does not depend on
which module happened to be imported first. An edge ``a -> b`` means that importing ``a`` runs ``b``:
the module it names, and every package above that module that is not also above ``a`` (importing
``sparsa.ops.registry`` from ``sparsa.gpu`` runs ``sparsa/ops/__init__.py`` too, which is how a
package-level cycle hides behind submodule imports).

Two graphs are checked: imports at module level must have no cycle at all; imports deferred into a
function body (late binding) may only close the cycles listed in ``KNOWN_DEFERRED_CYCLES`` (none now),
each with its reason, so a new one fails here instead of being held together by import order. This graph
is a superset of a plain module -> imported-module graph (it adds the packages an import runs and the
imports in class bodies), so it also covers the cycle check ``tests/test_imports.py`` used to make.

Quick check by hand: ``python -X importtime -c "import sparsa, sparsa.adaptive"``.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "sparsa"

# Imports inside a function that close a cycle, as (importing package, imported package): any module
# of the first importing any module of the second inside a function -> why it stays for now.
KNOWN_DEFERRED_CYCLES: Dict[Tuple[str, str], str] = {}

# Modules that import a third-party package absent here; each is imported anyway and must fail with
# exactly this missing package, so nothing is skipped silently.
OPTIONAL_DEPENDENCY = {
    "sparsa.gpu.act_sparse": "triton",
    "sparsa.gpu.monitor": "triton",
    "sparsa.gpu.weight_sparse": "triton",
}


def _modules() -> Dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        if "__pycache__" in p.parts or not (p.parent / "__init__.py").exists():
            continue
        parts = p.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _ancestors(name: str) -> List[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _imports(tree: ast.AST, deferred: bool):
    """Import statements at module level (deferred=False) or inside function bodies (deferred=True)."""
    stack = [(n, False) for n in ast.iter_child_nodes(tree)]
    while stack:
        node, in_func = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if in_func == deferred:
                yield node
            continue
        inner = in_func or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        stack += [(c, inner) for c in ast.iter_child_nodes(node)]


def _within(name: str, pkg: str) -> bool:
    return name == pkg or name.startswith(pkg + ".")


def import_graph(deferred: bool = False, skip: Iterable[Tuple[str, str]] = ()) -> Dict[str, Set[str]]:
    """Module -> the sparsa modules importing it runs (see the module docstring); ``skip`` leaves out
    the imports from (importing package) of (imported package)."""
    skip = list(skip)
    mods = _modules()
    graph: Dict[str, Set[str]] = {}
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in _imports(ast.parse(path.read_text(encoding="utf-8")), deferred):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
                continue
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets.add(base)
            targets.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods)
        edges = set()
        mine = set(_ancestors(name))
        for t in targets:
            # a package above this module is already being imported: no edge
            if t not in mods or t in mine or any(_within(name, a) and _within(t, b) for a, b in skip):
                continue
            edges.add(t)
            edges.update(a for a in _ancestors(t) if a not in mine and a != "sparsa")
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_graph_sees_the_modules_and_their_package_edges():
    g = import_graph()
    assert {"sparsa", "sparsa.tensor", "sparsa.ops.dispatch", "sparsa.adaptive"} <= set(g)
    assert "sparsa.layouts.base" in g["sparsa.tensor"]


def test_module_level_imports_have_no_cycle():
    found = cycles(import_graph())
    assert not found, "module-level import cycles (move the shared piece into a lower module):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def _with_deferred(skip: Iterable[Tuple[str, str]] = ()) -> Dict[str, Set[str]]:
    g = import_graph()
    for k, v in import_graph(deferred=True, skip=skip).items():
        g[k] |= v
    return g


def test_deferred_imports_close_only_the_known_cycles():
    found = cycles(_with_deferred(skip=KNOWN_DEFERRED_CYCLES))
    assert not found, "import cycles closed by an import inside a function (late binding):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )
    # each listed exception must still be needed, or it would hide the next cycle through that import
    for edge in KNOWN_DEFERRED_CYCLES:
        rest = [e for e in KNOWN_DEFERRED_CYCLES if e != edge]
        assert cycles(_with_deferred(skip=rest)), f"{edge} closes no cycle now: remove it from KNOWN_DEFERRED_CYCLES"


# A fresh interpreter imports torch (the slow part) once, then forks once per module: each child
# imports its module as the first sparsa module of its process. Prints "name<TAB>outcome" lines.
_CHECK = r"""
import importlib, os, sys, traceback
import torch  # noqa: F401
for name in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            importlib.import_module(name)
            msg = "ok"
        except ModuleNotFoundError as e:
            msg = "missing:" + (e.name or "") if not (e.name or "").startswith("sparsa") else traceback.format_exc()
        except BaseException:
            msg = traceback.format_exc()
        if msg == "ok" and any(m.startswith("sparsa") and sys.modules[m] is None for m in list(sys.modules)):
            msg = "a sparsa module is left half-imported in sys.modules"
        os.write(w, msg.replace("\n", "\\n").encode())
        os._exit(0)
    os.close(w)
    data = b""
    while True:
        b = os.read(r, 65536)
        if not b:
            break
        data += b
    os.close(r)
    os.waitpid(pid, 0)
    print(name + "\t" + (data.decode() or "child died"))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_each_module_imports_alone():
    names = sorted(_modules())
    assert set(OPTIONAL_DEPENDENCY) <= set(names), "OPTIONAL_DEPENDENCY names a module that no longer exists"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHECK, *names], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr
    outcome = dict(line.split("\t", 1) for line in proc.stdout.splitlines() if "\t" in line)
    assert sorted(outcome) == names, f"no answer for: {sorted(set(names) - set(outcome))}"
    bad = []
    for name, res in outcome.items():
        want = OPTIONAL_DEPENDENCY.get(name)
        if res == "ok" or (want and res == f"missing:{want}"):
            continue
        bad.append(f"--- import {name}\n{res}".replace("\\n", "\n"))
    assert not bad, "modules that fail to import alone:\n" + "\n".join(bad)
