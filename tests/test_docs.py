"""Every ```python block in README.md and docs/*.md runs as written (blocks of one file share state).

Blocks fenced ```py are illustrations that need an environment a test cannot give (several processes,
a GPU); they are not run, so use them sparingly.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks(path: Path):
    return BLOCK.findall(path.read_text())


@pytest.mark.parametrize("path", [p for p in DOCS if p.exists() and _blocks(p)], ids=lambda p: p.name)
def test_doc_code_blocks_run(path, tmp_path):
    code = "\n\n".join(_blocks(path))
    script = tmp_path / f"{path.stem}_blocks.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, f"code blocks of {path.name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"


BASH = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)


@pytest.mark.parametrize("path", [p for p in DOCS if p.exists() and BASH.findall(p.read_text())], ids=lambda p: p.name)
def test_doc_shell_blocks_run(path, tmp_path):
    """```bash blocks run line by line in the test's virtual environment (`make` lines excluded:
    they are the test and demo commands themselves)."""
    lines = [
        l
        for b in BASH.findall(path.read_text())
        for l in b.splitlines()
        if l.strip() and not l.lstrip().startswith(("make ", "#"))
    ]
    venv_bin = os.path.dirname(sys.executable)
    env = dict(
        os.environ,
        PATH=venv_bin + os.pathsep + os.environ.get("PATH", ""),
        PYTHONWARNINGS="ignore",
        SPARSA_RESULTS_DIR=str(tmp_path),
    )  # benchmark output goes here, not over the committed results
    script = "set -euo pipefail\n" + "\n".join(lines) + "\n"
    r = subprocess.run(["bash", "-c", script], cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, f"shell block of {path.name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
