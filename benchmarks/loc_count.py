"""Count the lines of code of named functions and classes, the same way for sparsa and a reference.

A definition covers its ``ast`` line range (decorators included). Its *code* lines are that range
without blank lines, comment-only lines and the lines of docstrings (of the definition and of every
function or class nested in it); *raw* lines are the whole range. Names may be dotted to pick a
method of a class (``MaskedLinear.forward``). Only Python 3 source is parsed.

    python benchmarks/loc_count.py sparsa/methods/wanda.py Wanda wanda
    python benchmarks/loc_count.py FILE            # every top-level function and class in FILE
    git -C rigl show HEAD:rigl/sparse_utils.py | python benchmarks/loc_count.py - get_sparsities_erdos_renyi
    python benchmarks/loc_count.py --skip 58-60,113 sparsegpt.py SparseGPT    # leave out lines 58-60 and 113

Prints one line per definition and the total (code / raw). ``--skip`` leaves out file lines that
implement features the other side lacks (to count like for like; say which in the docs), and
``--show`` prints every counted line with its number, to choose them.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from typing import Dict, List, Optional, Sequence, Set, Tuple

DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _docstring_lines(node: ast.AST) -> Set[int]:
    lines: Set[int] = set()
    for n in ast.walk(node):
        body = getattr(n, "body", None)
        if (
            isinstance(n, (ast.Module,) + DEFS)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def _code_lines(source: str) -> Set[int]:
    """Lines holding at least one token other than comments, newlines and indentation."""
    skip = {
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
        tokenize.ENCODING,
    }
    lines: Set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return lines


def _find(tree: ast.Module, dotted: str) -> ast.AST:
    scope: Sequence[ast.AST] = tree.body
    node: Optional[ast.AST] = None
    for part in dotted.split("."):
        node = next((n for n in scope if isinstance(n, DEFS) and n.name == part), None)
        if node is None:
            raise SystemExit(f"no function or class {dotted!r} (missing part {part!r})")
        scope = node.body
    return node


def count(
    source: str, names: Optional[Sequence[str]] = None, skip: Set[int] = frozenset(), show: bool = False
) -> List[Tuple[str, int, int]]:
    """``(name, code_lines, raw_lines)`` for each of ``names`` (default: every top-level definition),
    leaving out the line numbers in ``skip`` from the code lines."""
    tree = ast.parse(source)
    code, docs = _code_lines(source) - set(skip), _docstring_lines(tree)
    text = source.splitlines()
    nodes: Dict[str, ast.AST] = (
        {n: _find(tree, n) for n in names} if names else {n.name: n for n in tree.body if isinstance(n, DEFS)}
    )
    rows = []
    for name, node in nodes.items():
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        span = set(range(first, node.end_lineno + 1))
        counted = sorted((span & code) - docs)
        if show:
            print("\n".join(f"{i:5d}  {text[i - 1]}" for i in counted))
        rows.append((name, len(counted), len(span)))
    return rows


def main(argv: Sequence[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    argv = list(argv)
    show = "--show" in argv
    if show:
        argv.remove("--show")
    skip: Set[int] = set()
    if argv[0] == "--skip":
        for part in argv[1].split(","):
            lo, _, hi = part.partition("-")
            skip.update(range(int(lo), int(hi or lo) + 1))
        argv = argv[2:]
    path, names = argv[0], argv[1:]
    source = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    rows = count(source, names or None, skip, show)
    for name, c, r in rows:
        print(f"{name:40s} {c:5d} {r:5d}")
    print(f"{'total':40s} {sum(r[1] for r in rows):5d} {sum(r[2] for r in rows):5d}")


if __name__ == "__main__":
    main(sys.argv[1:])
