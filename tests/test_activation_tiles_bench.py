"""benchmarks/activation_tiles.py: the tile-granular nonzero fractions of real activations (nothing timed)."""

import json
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import activation_tiles as A  # noqa: E402


def test_tile_densities_count_groups_of_pixels_channels_and_tiles():
    t = torch.zeros(1, 20, 4, 4)  # 16 pixels, 20 channels: channel groups of 16 are padded to 2 groups
    t[0, 5, 0, 0] = 1.0
    t[0, 17, 3, 3] = 2.0
    d = A.tile_densities(t, "x")
    assert d["x_density"] == round(2 / (16 * 20), 4)
    assert d["x_union16_pixels"] == round(2 / 20, 4)  # one 16-pixel group, 2 of its 20 channels set
    assert d["x_union16_channels"] == round(2 / (16 * 2), 4)  # 16 pixels x 2 channel groups, 2 set
    assert d["x_tiles_16x32"] == 1.0  # one 16 x 32 block (channels padded), and it has a nonzero
    assert A.tile_densities(torch.zeros(2, 8, 3, 3), "dy")["dy_union16_pixels"] == 0.0


def test_rows_bound_each_gemm_by_its_tile_fraction(tmp_path):
    out = tmp_path / "t.json"
    threads = torch.get_num_threads()
    try:
        A.main(["--models", "alexnet", "--steps", "1", "--batch", "4", "--threads", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    d = json.loads(out.read_text())
    assert d["cpu"]["flags"] and d["rows"]
    assert all(r["layer"] != "features.0" for r in d["rows"])  # the first conv reads the image, not a ReLU
    for r in d["rows"]:
        for p in ("x", "dy"):
            assert 0 <= r[f"{p}_density"] <= r[f"{p}_union16_pixels"] <= r[f"{p}_tiles_16x32"] <= 1
            assert r[f"{p}_density"] <= r[f"{p}_union16_channels"] <= 1
        assert r["work_bound_fwd"] == r["x_union16_pixels"] and r["work_bound_dx"] == r["dy_union16_pixels"]
        assert r["work_bound_dw"] == min(r["x_union16_channels"], r["dy_union16_channels"])
