"""``sparsa prune``'s pattern x layout check, the grouped N:M fast paths and the frontier/prune split."""

import ast
from pathlib import Path

import pytest
import torch

import sparsa.layouts.grouped_nm as gnm
from sparsa.layouts.base import registered_layouts
from sparsa.prune import check_pattern_layout, default_layout
from sparsa.sparsifiers import NM, GroupedNM

ROOT = Path(__file__).resolve().parent.parent
PATTERNS = ["unstructured", "2:4", "4:8", "1:4", "grouped_2:4", "grouped_nm", "row_group16"]


@pytest.mark.parametrize("pattern", ["2:4", "4:8", "1:4"])
def test_nm_pattern_in_the_grouped_nm_layout_is_grouped_nm(pattern):
    n, m = (int(v) for v in pattern.split(":"))
    sp = check_pattern_layout(pattern, 0.5, "grouped_nm")
    assert isinstance(sp, GroupedNM) and (sp.n, sp.m) == (n, m)
    assert isinstance(check_pattern_layout(pattern, 0.5, "nm"), NM)


@pytest.mark.parametrize("layout", sorted(registered_layouts()))
@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_pattern_layout_pair_works_or_names_the_fix(pattern, layout):
    try:
        check_pattern_layout(pattern, 0.5, layout)
    except ValueError as e:
        msg = str(e)
        assert "\n" not in msg and f"--layout {layout!r} cannot store --pattern {pattern!r}" in msg
        if layout == "relu_compact":  # an activation layout (it stores relu(x)): no weight pattern fits it
            assert "negative values" in msg and f"--pattern {pattern} can be stored with --layout" in msg
            return
        assert f"--layout {layout} stores --pattern" in msg
        assert f"--pattern {pattern} can be stored with --layout" in msg
        assert "GroupedNMSparsifier" not in msg  # a Python-API hint does not help a command-line user
        assert layout in ("nm", "grouped_nm", "row_group"), f"{layout} stores any mask: {msg}"


def test_default_layouts():
    assert [default_layout(p) for p in PATTERNS] == [
        "sliced_ell",
        "nm",
        "nm",
        "nm",
        "grouped_nm",
        "grouped_nm",
        "row_group",
    ]


@pytest.mark.parametrize(
    "sparsity, layout", [(0.3, "masked"), (0.49, "masked"), (0.5, "sliced_ell"), (0.9, "sliced_ell")]
)
def test_an_encoders_unstructured_default_is_sliced_ell_from_half(sparsity, layout):
    """sliced_ell computes sparsely (as fast as dense fp32 at 50%, faster above and in bf16); masked
    always runs a dense product, so it is the default only below SLICED_ELL_MIN_SPARSITY."""
    from sparsa.prune import SLICED_ELL_MIN_SPARSITY

    assert SLICED_ELL_MIN_SPARSITY == 0.5
    assert default_layout("unstructured", False, sparsity) == layout
    assert default_layout("unstructured", True, sparsity) == "bitmask"  # causal LMs: decode first
    assert default_layout("2:4", False, sparsity) == "nm"


@pytest.mark.parametrize(
    "pattern, needle", [("2:x", "--pattern must be"), ("5:4", "--pattern '5:4'"), ("blocky", "--pattern must be")]
)
def test_bad_pattern_names_the_argument(pattern, needle):
    with pytest.raises(ValueError, match=needle):
        check_pattern_layout(pattern, 0.5, "masked")


def _old_assign(monkeypatch):
    """The layout built by the greedy search alone (the forced-assignment fast path off)."""
    monkeypatch.setattr(
        gnm,
        "_forced_assign",
        lambda kb, counts, n, g, pat: (
            torch.zeros(kb.shape[:2], dtype=torch.int64),
            torch.zeros(kb.shape[0], dtype=torch.bool),
        ),
    )


@pytest.mark.parametrize("shape", [(8, 24), (13, 30), (64, 50), (1, 5), (0, 7)])
@pytest.mark.parametrize("nmg", [(2, 4, 4), (1, 4, 2), (1, 3, 3), (3, 5, 1)])
def test_grouped_nm_fast_paths_match_the_search(shape, nmg, monkeypatch):
    n, m, g = nmg
    torch.manual_seed(0)
    for w in (torch.randn(shape), torch.randint(-1, 2, shape).float()):
        mask = gnm.grouped_nm_mask(w, n, m, g)
        fast = gnm.GroupedNM.from_dense(w, mask=mask, n=n, m=m, g=g)
        assert torch.equal(fast.mask(), mask)  # grouped_nm_mask = the positions the layout keeps
        assert torch.equal(gnm.GroupedNM.from_dense(w, n=n, m=m, g=g).mask(), mask)
        partial = mask & (torch.rand(shape) > 0.3)
        with monkeypatch.context() as mp:
            _old_assign(mp)
            slow = gnm.GroupedNM.from_dense(w, mask=mask, n=n, m=m, g=g)
            try:
                slow_p = gnm.GroupedNM.from_dense(w, mask=partial, n=n, m=m, g=g)
            except ValueError as e:
                slow_p = str(e)
        assert torch.equal(fast.columns, slow.columns) and torch.equal(fast.values, slow.values)
        try:
            fast_p = gnm.GroupedNM.from_dense(w, mask=partial, n=n, m=m, g=g)
        except ValueError as e:
            assert slow_p == str(e)
        else:
            assert torch.equal(fast_p.columns, slow_p.columns) and torch.equal(fast_p.values, slow_p.values)


def _imports(path: Path):
    """(module-level?, module) of every ``from . import x`` / ``from .x import`` in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(n) for n in tree.body}
    return [
        (id(n) in top, n.module or ".".join(a.name for a in n.names))
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.level
    ]


def test_frontier_and_prune_import_one_way():
    frontier, prune = _imports(ROOT / "sparsa/frontier.py"), _imports(ROOT / "sparsa/prune.py")
    assert not [mod for _, mod in frontier if mod == "prune"], "sparsa.frontier must not import sparsa.prune"
    assert [top for top, mod in prune if mod == "frontier"] == [True], "sparsa.prune imports frontier once, at the top"
