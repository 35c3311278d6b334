"""torch.compile and deepcopy of sparsified models match eager outputs, for every layout."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import sparsa

LAYOUTS = [
    ("masked", {}),
    ("coo", {}),
    ("csr", {}),
    ("bsr", {}),
    ("nm", dict(n=2, m=4)),
    ("grouped_nm", dict(n=2, m=4, g=2)),
    ("row_group", dict(group=8, sparsity=0.5)),
    ("sliced_ell", {}),
]


def _model(layout, params):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    w = m[0].weight.detach()
    mask = None if layout in ("nm", "grouped_nm", "row_group") else torch.rand_like(w) > 0.5
    m[0].weight = nn.Parameter(sparsa.to_sparse(w, layout, mask=mask, **params))
    return m


@pytest.mark.parametrize("layout, params", LAYOUTS, ids=[l for l, _ in LAYOUTS])
def test_compile_and_deepcopy_match_eager(layout, params):
    m = _model(layout, params)
    x = torch.randn(5, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = m(x)
        torch._dynamo.reset()
        out = torch.compile(m, backend="aot_eager")(x)
        cp = copy.deepcopy(m)
        out_cp = cp(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_cp, ref)
    assert cp[0].weight.layout_name == layout


def test_compile_inductor_fast_layout():
    m = _model("row_group", dict(group=8, sparsity=0.5))
    x = torch.randn(7, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = m(x)
        torch._dynamo.reset()
        out = torch.compile(m)(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
