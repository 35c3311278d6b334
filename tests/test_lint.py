"""The code base is ruff-clean (rules and settings in pyproject.toml's ``[tool.ruff]``)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(
    importlib.util.find_spec("ruff") is None, reason="ruff is not installed (pip install -e '.[test]' brings it)"
)
def test_ruff_check_is_clean():
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "sparsa", "examples", "benchmarks", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, f"ruff check failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"


@pytest.mark.skipif(
    importlib.util.find_spec("ruff") is None, reason="ruff is not installed (pip install -e '.[test]' brings it)"
)
def test_ruff_format_is_clean():
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, f"not formatted (run `ruff format .`):\n{proc.stdout}{proc.stderr}"
