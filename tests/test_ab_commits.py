"""benchmarks/ab_commits.py: runs a benchmark on two commits, alternating, and compares their metrics."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import ab_commits  # noqa: E402

FAKE = """import json, os, random, pathlib
ms = float(pathlib.Path(__file__).with_name("speed.txt").read_text())
out = pathlib.Path(os.environ["SPARSA_RESULTS_DIR"]) / "fake.json"
rows = [{"mode": m, "sparsity": 0.5, "ms": ms * k + random.random() * 1e-3} for m, k in (("a", 1), ("b", 3))]
out.write_text(json.dumps({"rows": rows}))
"""


def _git(repo, *args):
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    """A repository whose fake benchmark reports 2 ms, then (second commit) 1 ms."""
    (tmp_path / "benchmarks").mkdir()
    for name in ("ab_commits.py", "_results.py"):
        shutil.copy(BENCH / name, tmp_path / "benchmarks" / name)
    (tmp_path / "sparsa").mkdir()
    (tmp_path / "sparsa" / "__init__.py").write_text("")  # the checkout's own package, as the harness checks
    (tmp_path / "benchmarks" / "fake.py").write_text(FAKE)
    _git(tmp_path, "init", "-q")
    shas = []
    for ms in ("2.0", "1.0"):
        (tmp_path / "benchmarks" / "speed.txt").write_text(ms)
        _git(tmp_path, "add", "-A")
        _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", f"speed {ms}")
        shas.append(_git(tmp_path, "rev-parse", "HEAD"))
    return tmp_path, shas


def _ab(repo, *args):
    return subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "ab_commits.py"), *args],
        cwd=repo,
        capture_output=True,
        text=True,
    )


def test_two_commits_compared_metric_by_metric(repo):
    root, (old, new) = repo
    out = root / "ab.json"
    p = _ab(root, old, "--new", new, "--rounds", "2", "--out", str(out), "--", "fake.py")
    assert p.returncode == 0, p.stderr
    res = json.loads(out.read_text())
    assert res["old"] == old and res["new"] == new and res["rounds"] == 2 and "flags" in res["cpu"]
    got = {r["row"]["mode"]: r for r in res["rows"]}
    assert sorted(got) == ["a", "b"] and all(r["metric"] == "ms" for r in got.values())
    assert got["a"]["old"] == pytest.approx(2.0, abs=1e-2) and got["a"]["new"] == pytest.approx(1.0, abs=1e-2)
    assert got["b"]["new_over_old"] == pytest.approx(0.5, abs=1e-2)
    assert len(got["a"]["old_runs"]) == len(got["a"]["new_runs"]) == 2
    assert got["a"]["row"]["sparsity"] == 0.5  # unchanging floats identify the row
    assert len(_git(root, "worktree", "list").splitlines()) == 1  # the checkouts are removed


def test_the_working_tree_is_the_default_new_side(repo):
    root, (old, _) = repo
    (root / "benchmarks" / "speed.txt").write_text("4.0")  # uncommitted
    out = root / "ab.json"
    p = _ab(root, old, "--rounds", "1", "--out", str(out), "--", "fake.py")
    assert p.returncode == 0, p.stderr
    got = {r["row"]["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert got["a"]["new_over_old"] == pytest.approx(2.0, abs=1e-2)


@pytest.mark.parametrize(
    "args, message",
    [
        (["nosuchrev", "--", "fake.py"], "is not a commit"),
        (["HEAD", "fake.py"], "after '--'"),
        (["HEAD", "--"], "name the benchmark script"),
        (["HEAD", "--rounds", "0", "--", "fake.py"], "--rounds"),
        (["HEAD", "--", "missing.py"], "has no benchmarks/missing.py"),
    ],
)
def test_bad_arguments_are_named(repo, args, message):
    root, _ = repo
    p = _ab(root, *args)
    assert p.returncode != 0 and message in p.stderr


def test_compare_leaves_out_rows_of_one_side():
    old = [
        {"rows": [{"m": "a", "t": 1.0}, {"m": "b", "t": 5.0}]},
        {"rows": [{"m": "a", "t": 3.0}, {"m": "b", "t": 7.0}]},
    ]
    new = [{"rows": [{"m": "a", "t": 1.0}, {"m": "c", "t": 2.0}]}]
    rows = ab_commits.compare(old, new)
    assert [(r["row"], r["old"], r["new"]) for r in rows] == [({"m": "a"}, 2.0, 1.0)]


def test_compare_with_a_key_matches_rows_whose_other_fields_change():
    """adaptive_training.py's ``models`` rows: the faster format (a string) and counts change between runs;
    with --key the rows still match on (model, dtype) and every float outside the key is a metric."""
    run = lambda fmt, n, t: {"models": [{"model": "vgg16", "dtype": "fp32", "fmt": fmt, "layers": n, "ms": t}]}  # noqa: E731
    old, new = [run("nchw", 12, 4.0), run("cl", 11, 6.0)], [run("cl", 12, 3.0)]
    rows = ab_commits.compare(old, new, "models", ["model", "dtype"])
    assert [(r["row"], r["metric"], r["old"], r["new"]) for r in rows] == [
        ({"dtype": "fp32", "model": "vgg16"}, "ms", 5.0, 3.0)
    ]
    assert ab_commits.compare(old, new, "models") == []  # without a key no row matches across runs
    with pytest.raises(SystemExit, match="--rows"):
        ab_commits.compare(old, new)
    with pytest.raises(SystemExit, match="lack"):
        ab_commits.compare(old, new, "models", ["model", "nope"])


def test_compare_refuses_a_key_that_two_rows_of_one_run_share():
    # the new side of adaptive_training.py has fp32 and bf16 rows per model: keyed by model alone they were
    # pooled as runs of one row (the medians mixed both dtypes)
    old = [{"models": [{"model": "vgg16", "dtype": "fp32", "ms": 4.0}]}]
    new = [{"models": [{"model": "vgg16", "dtype": "fp32", "ms": 3.0}, {"model": "vgg16", "dtype": "bf16", "ms": 1.0}]}]
    with pytest.raises(SystemExit, match="two rows of one run share .*vgg16.*--key"):
        ab_commits.compare(old, new, "models", ["model"])
    rows = ab_commits.compare(old, new, "models", ["model", "dtype"])
    assert [(r["row"]["dtype"], r["old"], r["new"]) for r in rows] == [("fp32", 4.0, 3.0)]


FAKE_ON_CODE = """import json, os, pathlib, random, sparsa
ms = float(pathlib.Path(sparsa.__file__).with_name("speed.txt").read_text())  # the code under test
out = pathlib.Path(os.environ["SPARSA_RESULTS_DIR"]) / "fake.json"
out.write_text(json.dumps({"rows": [{"mode": "a", "ms": ms + random.random() * 1e-3}]}))
"""


def _code_change(root, script: str) -> str:
    """Commits code that runs at 2 ms and returns that commit; the working tree then has the change (1 ms)
    and, uncommitted, its new benchmark ``on_code.py``."""
    (root / "sparsa" / "speed.txt").write_text("2.0")
    _git(root, "add", "-A")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "code at 2 ms")
    old = _git(root, "rev-parse", "HEAD")
    (root / "sparsa" / "speed.txt").write_text("1.0")
    (root / "benchmarks" / "on_code.py").write_text(script)
    return old


def test_script_from_new_times_the_old_code_with_a_benchmark_it_lacks(repo):
    root, _ = repo
    old = _code_change(root, FAKE_ON_CODE)
    p = _ab(root, old, "--rounds", "1", "--", "on_code.py")
    assert p.returncode != 0 and "--script-from new" in p.stderr
    out = root / "ab.json"
    p = _ab(root, old, "--rounds", "1", "--script-from", "new", "--out", str(out), "--", "on_code.py")
    assert p.returncode == 0, p.stderr
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    assert res["script_from"] == "new"
    assert row["old"] == pytest.approx(2.0, abs=1e-2) and row["new"] == pytest.approx(1.0, abs=1e-2)


FAKE_ON_CODE_OWN_ROOT = (
    """import sys, pathlib
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # as the real benchmarks do
"""
    + FAKE_ON_CODE
)


def test_script_from_new_imports_the_old_code_although_the_script_puts_its_root_first(repo):
    # the real benchmarks put their checkout's root first on sys.path; run from the new tree, both sides
    # imported the new sparsa and the comparison read 1.0x
    root, _ = repo
    old = _code_change(root, FAKE_ON_CODE_OWN_ROOT)
    out = root / "ab.json"
    p = _ab(root, old, "--rounds", "1", "--script-from", "new", "--out", str(out), "--", "on_code.py")
    assert p.returncode == 0, p.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["old"] == pytest.approx(2.0, abs=1e-2) and row["new"] == pytest.approx(1.0, abs=1e-2)
