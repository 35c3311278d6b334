"""The native-kernel loader: processes that start together share one build and never load a partial one."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparsa.kernels import loader

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import ctypes, sys
from sparsa.kernels import loader
lib = loader.load("probe")
assert lib is not None, loader.build_info()
lib.sparsa_probe_version.restype = ctypes.c_int
print(lib.sparsa_probe_version(), loader.build_info()["probe"]["cached"])
"""


@pytest.mark.skipif(not loader.native_enabled(), reason="SPARSA_NO_NATIVE is set")
def test_concurrent_first_builds_share_one_finished_library(tmp_path):
    env = dict(os.environ, SPARSA_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert out.split()[0] == "1"
    assert sorted(o.split()[1] for o, _ in outs).count("False") == 1  # exactly one process built it
    built = list(tmp_path.glob("probe_*/sparsa_probe.done"))
    assert len(built) == 1


def test_build_hash_covers_an_included_source():
    # the emulated-AMX build is row_group_linear.cpp under a define: editing that file must rebuild it
    files = loader.hashed_files([loader.CSRC / "row_group_linear_amxemu.cpp"])
    names = [p.name for p in files]
    assert "row_group_linear.cpp" in names and "row_group_amx.h" in names
    assert loader.hashed_files([loader.CSRC / "probe.cpp"])[0].name == "probe.cpp"
