"""Before/after: one benchmark script run on two commits, alternating, on this machine.

A speed change is claimed against the code before it, measured side by side: this runs
``benchmarks/<script>`` from a checkout of each commit in turn (old, new, new, old, ... so neither side
always runs first), each run writing its results JSON into its own folder through
``$SPARSA_RESULTS_DIR``, and compares the two sides metric by metric (the median over rounds). Every
run imports the ``sparsa`` of its own checkout (``PYTHONPATH``; checked before timing), with this
environment's Python and packages.

Rows are matched by their fields that do not change from run to run (mode, shape, sparsity...); the
float fields that do change are the metrics. Writes ``ab_commits.json`` (with the CPU) to
``$SPARSA_RESULTS_DIR`` or the CPU class's results folder, and prints one line per metric.

    python benchmarks/ab_commits.py OLD [--new NEW] [--rounds 5] -- dispatch_overhead.py --quick
    python benchmarks/ab_commits.py OLD --rows models --key model,dtype -- adaptive_training.py --quick
    python benchmarks/ab_commits.py OLD --script-from new -- bitmask_stream.py --quick

``--script-from new`` runs the new side's copy of the benchmark (and its helpers) on both sides, each still
importing its own ``sparsa``: for a benchmark written with or after the change it measures.

``NEW`` defaults to the working tree as it is (uncommitted changes included).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent

#: a row's identity (its unchanging fields) and a metric name
Key = Tuple[Tuple[Tuple[str, Any], ...], str]


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _checkout(rev: str, where: Path) -> Path:
    """A detached worktree of ``rev`` at ``where`` (an error naming ``rev`` if git does not know it)."""
    try:
        sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError:
        raise SystemExit(f"ab_commits: {rev!r} is not a commit of {ROOT}; pass a commit, tag or branch") from None
    _git("worktree", "add", "--detach", "--force", str(where), sha)
    return where


def _run(tree: Path, script: str, args: List[str], out: Path, script_tree: Optional[Path] = None) -> Dict[str, Any]:
    """Run ``benchmarks/<script>`` of ``script_tree`` (default ``tree``) on ``tree``'s ``sparsa``, with results
    going to ``out``; returns the JSON it wrote."""
    out.mkdir(parents=True)
    env = dict(os.environ, SPARSA_RESULTS_DIR=str(out), PYTHONPATH=str(tree))
    path = (script_tree or tree) / "benchmarks" / script
    subprocess.run([sys.executable, str(path), *args], cwd=tree, env=env, check=True)
    written = sorted(out.rglob("*.json"), key=lambda p: p.stat().st_mtime)
    if not written:
        raise SystemExit(f"ab_commits: {script} in {tree} wrote no JSON under $SPARSA_RESULTS_DIR")
    return json.loads(written[-1].read_text())


def _copy_benchmarks(src: Path, dst: Path) -> None:
    """The new side's benchmark scripts and helpers into the old side's (temporary) checkout: a benchmark
    puts its own checkout's root first on ``sys.path``, so run from the new tree it would import the new
    ``sparsa`` on both sides, whatever ``PYTHONPATH`` says."""
    for f in (src / "benchmarks").glob("*.py"):
        shutil.copy2(f, dst / "benchmarks" / f.name)


def _check_import(tree: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(tree))
    got = subprocess.run(
        [sys.executable, "-c", "import sparsa; print(sparsa.__file__)"],
        cwd=tree,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not Path(got).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"ab_commits: with PYTHONPATH={tree}, sparsa is imported from {got}, not from that checkout")


def _rows(result: Dict[str, Any], rows_key: str = "rows") -> List[Dict[str, Any]]:
    rows = result.get(rows_key)
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise SystemExit(
            f"ab_commits: the benchmark's JSON has no {rows_key!r} list of objects to compare; name its list "
            "with --rows (e.g. --rows models for adaptive_training.py)"
        )
    return rows


def compare(
    old: List[Dict[str, Any]],
    new: List[Dict[str, Any]],
    rows_key: str = "rows",
    key: Optional[Sequence[str]] = None,
) -> List[Dict[str, Any]]:
    """Per-metric medians of two sides' runs (each a results JSON) and their ratio new / old.

    Rows are the objects of the list ``rows_key``. Without ``key``, a float field whose value differs
    between any two runs is a metric and every other field identifies the row; with ``key`` (field
    names), those fields identify the row and every float field outside them is a metric (for rows
    whose other fields, e.g. the faster memory format, may change from run to run). Rows present on
    one side only are left out.

    >>> run = lambda t: {"rows": [{"mode": "a", "sparsity": 0.5, "ms": t}]}
    >>> r = compare([run(2.0), run(4.0)], [run(1.0)])[0]
    >>> r["row"], r["metric"], r["old"], r["new"], r["new_over_old"]
    ({'mode': 'a', 'sparsity': 0.5}, 'ms', 3.0, 1.0, 0.333)
    """
    runs = [_rows(r, rows_key) for r in old + new]
    varying = set()
    if key is not None:
        missing = [k for k in key if not all(k in row for rows in runs for row in rows)]
        if missing:
            raise SystemExit(f"ab_commits: --key names fields that some rows lack: {missing}")
        varying = {k for rows in runs for row in rows for k, v in row.items() if isinstance(v, float)} - set(key)
    for rows in zip(*runs) if key is None else ():
        for k in rows[0]:
            vals = {repr(r.get(k)) for r in rows}
            if isinstance(rows[0][k], float) and len(vals) > 1:
                varying.add(k)

    def collect(side: List[Dict[str, Any]]) -> Dict[Key, List[float]]:
        got: Dict[Key, List[float]] = {}
        for result in side:
            seen = set()
            for row in _rows(result, rows_key):
                fields = row.items() if key is None else ((k, row[k]) for k in key)
                ident = tuple(sorted((k, json.dumps(v)) for k, v in fields if k not in varying))
                if ident in seen:  # two rows of one run would be pooled as runs of one row
                    raise SystemExit(
                        f"ab_commits: two rows of one run share {dict((k, json.loads(v)) for k, v in ident)}; "
                        "add the field that tells them apart to --key (e.g. --key model,dtype)"
                    )
                seen.add(ident)
                for k in varying:
                    if isinstance(row.get(k), (int, float)):
                        got.setdefault((ident, k), []).append(float(row[k]))
        return got

    a, b = collect(old), collect(new)
    out = []
    for key in a:
        if key not in b:
            continue
        ident, metric = key
        mo, mn = statistics.median(a[key]), statistics.median(b[key])
        out.append(
            {
                "row": {k: json.loads(v) for k, v in ident},
                "metric": metric,
                "old": round(mo, 4),
                "new": round(mn, 4),
                "new_over_old": round(mn / mo, 3) if mo else None,
                "old_runs": a[key],
                "new_runs": b[key],
            }
        )
    return out


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    asks_help = "--" not in argv and any(a in ("-h", "--help") for a in argv)
    if "--" not in argv and not asks_help:
        raise SystemExit("ab_commits: put the benchmark after '--', e.g. ... OLD -- dispatch_overhead.py --quick")
    cut = len(argv) if asks_help else argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", help="the commit before the change")
    ap.add_argument("--new", default=None, help="the commit after it (default: the working tree as it is)")
    ap.add_argument("--rounds", type=int, default=5, help="runs per side, alternating (default 5)")
    ap.add_argument("--out", default=None, help="output JSON (default: <results dir>/ab_commits.json)")
    ap.add_argument("--rows", default="rows", help="the JSON's list of rows to compare (default: rows)")
    ap.add_argument(
        "--key",
        default=None,
        help="comma-separated fields that identify a row (default: every field that does not vary), "
        "e.g. --rows models --key model,dtype for adaptive_training.py",
    )
    ap.add_argument(
        "--script-from",
        choices=("each", "new"),
        default="each",
        help="each side runs its own copy of the benchmark (default), or both run the new side's",
    )
    a = ap.parse_args(argv[:cut])
    if not argv[cut + 1 :]:
        raise SystemExit("ab_commits: name the benchmark script after '--', e.g. dispatch_overhead.py")
    script, sargs = argv[cut + 1], argv[cut + 2 :]
    if a.rounds < 1:
        raise SystemExit(f"ab_commits: --rounds must be at least 1, got {a.rounds}")
    with tempfile.TemporaryDirectory(prefix="sparsa-ab-") as tmp:
        tmp_path = Path(tmp)
        trees = {"old": _checkout(a.old, tmp_path / "old")}
        trees["new"] = _checkout(a.new, tmp_path / "new") if a.new else ROOT
        try:
            if a.script_from == "new":
                _copy_benchmarks(trees["new"], trees["old"])
            script_trees = dict(trees)
            for side, tree in trees.items():
                if not (script_trees[side] / "benchmarks" / script).exists():
                    hint = "" if a.script_from == "new" else " (--script-from new runs the new side's copy on both)"
                    raise SystemExit(
                        f"ab_commits: the {side} side ({script_trees[side]}) has no benchmarks/{script}{hint}"
                    )
                _check_import(tree)
            results: Dict[str, List[Dict[str, Any]]] = {"old": [], "new": []}
            for i in range(a.rounds):
                order = ("old", "new") if i % 2 == 0 else ("new", "old")
                for side in order:
                    print(f"ab_commits: round {i + 1}/{a.rounds}, {side}", flush=True)
                    out_dir = tmp_path / "out" / f"{side}{i}"
                    results[side].append(_run(trees[side], script, sargs, out_dir, script_trees[side]))
        finally:
            for side in ("old", "new"):
                if trees.get(side) is not None and trees[side] != ROOT:
                    subprocess.run(["git", "worktree", "remove", "--force", str(trees[side])], cwd=ROOT, check=False)
    rows = compare(results["old"], results["new"], a.rows, None if a.key is None else a.key.split(","))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import sparsa.cpu
    from _results import results_dir

    res = {
        "benchmark": "ab_commits",
        "cpu": sparsa.cpu.cpu_info(),
        "script": [script, *sargs],
        "script_from": a.script_from,
        "old": _git("rev-parse", a.old),
        "new": _git("rev-parse", a.new) if a.new else f"working tree at {_git('rev-parse', 'HEAD')}",
        "rounds": a.rounds,
        "compared": {"rows": a.rows, "key": a.key},
        "order": "alternating, old first in odd rounds",
        "rows": rows,
    }
    out = Path(a.out) if a.out else results_dir() / "ab_commits.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    for r in rows:
        ident = ", ".join(f"{k}={v}" for k, v in r["row"].items() if not isinstance(v, (list, dict)))
        print(f"{ident}: {r['metric']} {r['old']} -> {r['new']} (x{r['new_over_old']})")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
