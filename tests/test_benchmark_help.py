"""Every benchmark script answers ``--help`` with its usage and exit status 0 (and does no work)."""

import runpy
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_exits_cleanly(script, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("SPARSA_RESULTS_DIR", str(tmp_path))  # nothing may be written, even by mistake
    monkeypatch.setattr(sys, "argv", [str(BENCH / script), "--help"])
    monkeypatch.setattr(sys, "path", [str(BENCH)] + sys.path)
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(BENCH / script), run_name="__main__")
    assert e.value.code in (0, None), f"{script} --help exited with {e.value.code!r}"
    out = capsys.readouterr().out
    assert "usage" in out.lower() or script in out, f"{script} --help printed no usage"
    assert not any(tmp_path.iterdir()), f"{script} --help wrote {sorted(p.name for p in tmp_path.iterdir())}"
