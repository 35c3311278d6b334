"""Conversions: direct edges, multi-hop paths and the dense route all give the same tensor."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from sparsa.layouts import BSR, COO, CSR, GroupedNM, Masked, NM, conversion_path, convert, nm_mask
from sparsa.layouts.conversions import coo_to_csr, csr_to_bsr, csr_to_coo, to_masked


def _x(shape, seed):
    torch.manual_seed(seed)
    x = torch.randn(shape)
    x[torch.rand(shape) < 0.6] = 0.0
    return x


@settings(max_examples=30, deadline=None)
@given(r=st.integers(0, 11), c=st.integers(0, 11), seed=st.integers(0, 1000))
def test_direct_multihop_and_dense_paths_agree(r, c, seed):
    x = _x((r, c), seed)
    mask = (x != 0) | (torch.rand(r, c) < 0.1)  # explicit zeros in the pattern
    coo = COO.from_dense(x, mask=mask)
    csr = convert(coo, CSR)  # direct
    assert isinstance(csr, CSR)
    csr.validate()
    assert torch.equal(csr.to_dense(), x) and torch.equal(csr.mask(), mask)
    back = convert(csr, COO)
    back.validate()
    assert torch.equal(back.indices, coo.indices) and torch.equal(back.values, coo.values)
    bsr = convert(coo, BSR)  # multi-hop COO -> CSR -> BSR
    assert isinstance(bsr, BSR)
    bsr.validate()
    via_dense = convert(coo, BSR, blocksize=(4, 4))  # params force the dense route
    assert torch.equal(bsr.to_dense(), x) and torch.equal(bsr.mask(), mask)
    for name in ("crow_indices", "col_indices", "values", "block_mask"):
        assert torch.equal(bsr.components()[name], via_dense.components()[name]), name
    masked = convert(bsr, Masked)
    assert torch.equal(masked.values, x) and torch.equal(masked.mask(), mask)


def test_paths_are_registered_with_costs():
    assert len(conversion_path(COO, CSR)[1]) == 1
    cost, fns = conversion_path(COO, BSR)
    assert fns == (coo_to_csr, csr_to_bsr) and cost == pytest.approx(1.5)
    assert conversion_path(CSR, COO)[1] == (csr_to_coo,)
    for cls in (COO, CSR, BSR, NM, GroupedNM):
        assert conversion_path(cls, Masked)[1] == (to_masked,)


@pytest.mark.parametrize(
    "layout,params",
    [(NM, {"n": 2, "m": 4}), (GroupedNM, {"n": 2, "m": 4, "g": 1}), (COO, {}), (CSR, {}), (BSR, {"blocksize": (2, 2)})],
)
def test_every_layout_to_masked_keeps_pattern(layout, params):
    x = _x((7, 9), 3)
    lay = layout.from_dense(x, **params)
    m = convert(lay, Masked)
    assert torch.equal(m.values, lay.to_dense()) and torch.equal(m.mask(), lay.mask())


def test_dense_route_to_structured_layout():
    x = torch.randn(5, 10)
    mask = nm_mask(x, 2, 4)
    csr = CSR.from_dense(x, mask=mask)
    nm = convert(csr, NM, n=2, m=4)
    assert isinstance(nm, NM) and torch.equal(nm.to_dense(), x * mask)
    with pytest.raises(ValueError, match=r"sparsifiers\.NM\(n="):
        convert(CSR.from_dense(x), NM, n=2, m=4)  # a dense pattern does not fit 2:4


def test_coo_to_csr_needs_2d():
    with pytest.raises(ValueError, match="2-D"):
        convert(COO.from_dense(torch.randn(2, 3, 4)), CSR)
