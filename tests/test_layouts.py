"""Layout-specific tests: formats, structure choices, parameter checks and validation messages."""

import itertools
import math

import pytest
import torch

from sparsa.layouts import BSR, COO, CSR, GroupedNM, Masked, NM, get_layout, grouped_nm_mask, nm_mask

# The round trip, pattern, from_components and refill properties of every layout live in
# tests/test_layout_conformance.py; this file keeps the layout-specific tests.


def test_nm_keeps_largest_magnitudes():
    x = torch.tensor([[1.0, -4.0, 3.0, 2.0, 0.5, -0.125, 0.25]])
    lay = NM.from_dense(x, n=2, m=4)
    assert lay.to_dense().tolist() == [[0.0, -4.0, 3.0, 0.0, 0.5, 0.0, 0.25]]
    assert lay.indices.dtype == torch.uint8
    assert lay.values.shape == (1, 2, 2)
    assert torch.equal(nm_mask(x, 2, 4), lay.mask())
    # each group of m keeps n (the short last group keeps min(n, its length))
    y = torch.randn(5, 11)
    mk = nm_mask(y, 2, 4)
    assert mk[:, :8].reshape(5, 2, 4).sum(-1).eq(2).all()
    assert mk[:, 8:].sum(-1).eq(2).all()


def test_nm_large_m_uses_int16_indices():
    lay = NM.from_dense(torch.randn(2, 600), n=3, m=300)
    assert lay.indices.dtype == torch.int16
    assert lay.nnz == 12


def test_nm_mask_too_dense_names_group():
    x = torch.randn(3, 8)
    mask = nm_mask(x, 2, 4)
    mask[1, 4:8] = True
    with pytest.raises(ValueError, match=r"group \(1, 1\).*sparsifiers\.NM\(n="):
        NM.from_dense(x, mask=mask, n=2, m=4)


def test_nm_sparse_mask_is_filled_with_stored_zeros():
    x = torch.randn(2, 8)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, 1] = True
    lay = NM.from_dense(x, mask=mask, n=2, m=4)
    assert torch.equal(lay.to_dense(), x * mask)
    assert lay.nnz == 8  # n stored per group; documented superset of the given mask
    assert lay.mask()[0, 1]


def _grouped_structure_ok(lay: GroupedNM) -> None:
    b, c, p, chunk, rp, kp = lay.geometry
    pats = list(itertools.combinations(range(lay.m), lay.n))
    mask = torch.zeros(rp, kp, dtype=torch.bool)
    mask[: lay.shape[0], : lay.shape[1]] = lay.mask()
    for bi in range(b):
        for ci in range(c):
            used = {}
            for pi in range(p):
                for j in range(lay.g):
                    col = int(lay.columns[bi, ci, pi, j])
                    assert ci * chunk <= col < (ci + 1) * chunk
                    used[col] = pi
                    kept = mask[bi * lay.m : (bi + 1) * lay.m, col].nonzero().flatten().tolist()
                    assert set(kept) <= set(pats[pi])
            assert sorted(used) == list(range(ci * chunk, (ci + 1) * chunk))


@pytest.mark.parametrize(
    "shape,n,m,g", [((8, 24), 2, 4, 2), ((5, 13), 2, 4, 1), ((9, 7), 1, 3, 2), ((1, 30), 2, 4, 3), ((6, 10), 3, 5, 1)]
)
def test_grouped_nm_exact_format(shape, n, m, g):
    torch.manual_seed(0)
    x = torch.randn(shape)
    lay = GroupedNM.from_dense(x, n=n, m=m, g=g)
    b, c, p, chunk, rp, kp = lay.geometry
    assert p == math.comb(m, n) and chunk == p * g
    assert lay.values.shape == (b, c, p, g, n) and lay.columns.shape == (b, c, p, g)
    assert lay.columns.dtype == torch.int32
    _grouped_structure_ok(lay)
    # values are in the pattern's row order
    pats = list(itertools.combinations(range(m), n))
    xp = torch.zeros(rp, kp)
    xp[: shape[0], : shape[1]] = x
    for bi, ci, pi, j in [(0, 0, 0, 0), (b - 1, c - 1, p - 1, g - 1)]:
        col = int(lay.columns[bi, ci, pi, j])
        want = [float(xp[bi * m + r, col]) for r in pats[pi]]
        assert lay.values[bi, ci, pi, j].tolist() == pytest.approx(want)
    # the mask function and the mask route agree with the greedy build
    mk = grouped_nm_mask(x, n, m, g)
    assert torch.equal(mk, lay.mask())
    again = GroupedNM.from_dense(x, mask=mk, n=n, m=m, g=g)
    assert torch.equal(again.to_dense(), lay.to_dense())


def test_grouped_nm_greedy_prefers_large_magnitudes():
    # one block of 4 rows, 6 columns, g=1: each pattern once; column k's big values sit on pattern k
    pats = list(itertools.combinations(range(4), 2))
    x = torch.full((4, 6), 0.01)
    for k, (r0, r1) in enumerate(pats):
        x[r0, k] = x[r1, k] = 10.0 + k
    lay = GroupedNM.from_dense(x, n=2, m=4, g=1)
    assert torch.equal(lay.mask(), x > 1)


def test_grouped_nm_rejects_unstructured_mask():
    x = torch.randn(4, 12)
    mask = torch.zeros(4, 12, dtype=torch.bool)
    mask[0:2, :] = True  # every column uses pattern (0, 1): more than g=2 columns per chunk
    with pytest.raises(ValueError, match=r"sparsa\.sparsifiers\.GroupedNM\(n=2, m=4, g=2\)"):
        GroupedNM.from_dense(x, mask=mask, n=2, m=4, g=2)
    mask3 = torch.zeros(4, 12, dtype=torch.bool)
    mask3[0:3, 0] = True  # 3 kept of m=4 with n=2
    with pytest.raises(ValueError, match="more than n=2"):
        GroupedNM.from_dense(x, mask=mask3, n=2, m=4, g=2)


# ----------------------------------------------------------------------------- parameter and dtype checks
@pytest.mark.parametrize(
    "layout,params", [(COO, {}), (CSR, {}), (BSR, {}), (NM, {"n": 2, "m": 4}), (GroupedNM, {"n": 2, "m": 4, "g": 1})]
)
def test_integer_dtype_rejected(layout, params):
    with pytest.raises(TypeError, match="floating-point"):
        layout.from_dense(torch.ones(4, 8, dtype=torch.int64), **params)


@pytest.mark.parametrize("layout", [NM, GroupedNM])
@pytest.mark.parametrize("n,m", [(4, 4), (5, 4), (0, 4), (-1, 4)])
def test_bad_n_m_rejected(layout, n, m):
    with pytest.raises(ValueError, match=rf"n={n}, m={m}"):
        layout.from_dense(torch.randn(4, 8), n=n, m=m)


def test_bad_g_and_blocksize_rejected():
    with pytest.raises(ValueError, match="g=0"):
        GroupedNM.from_dense(torch.randn(4, 8), n=2, m=4, g=0)
    with pytest.raises(ValueError, match="blocksize"):
        BSR.from_dense(torch.randn(4, 8), blocksize=(0, 2))


def test_wrong_ndim_and_mask_shape_rejected():
    with pytest.raises(ValueError, match="2-D"):
        CSR.from_dense(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="mask has shape"):
        COO.from_dense(torch.randn(3, 4), mask=torch.ones(4, 3, dtype=torch.bool))


def test_registered_by_name():
    for name, cls in [("coo", COO), ("csr", CSR), ("bsr", BSR), ("nm", NM), ("grouped_nm", GroupedNM)]:
        assert get_layout(name) is cls


# ----------------------------------------------------------------------------- validation, one test per failure
def _sample(layout, **params):
    torch.manual_seed(1)
    x = torch.randn(6, 10)
    x[torch.rand(6, 10) < 0.5] = 0
    return layout.from_dense(x, **params)


def _bad(layout, lay, match, **changes):
    comps = dict(lay.components())
    comps.update(changes)
    with pytest.raises(ValueError, match=match):
        layout.from_components(comps, lay.shape, **lay.params())


def test_coo_validation():
    lay = _sample(COO)
    _bad(COO, lay, "'indices'.*dtype", indices=lay.indices.int())
    _bad(COO, lay, "'values'.*floating", values=lay.values.long())
    _bad(COO, lay, "'values'.*shape", values=lay.values[:-1])
    _bad(COO, lay, "'indices'.*shape", indices=lay.indices[:1])
    big = lay.indices.clone()
    big[1, 0] = 10
    _bad(COO, lay, "out-of-range", indices=big)
    _bad(COO, lay, "sorted", indices=lay.indices.flip(1), values=lay.values.flip(0))
    dup = lay.indices.clone()
    dup[:, 1] = dup[:, 0]
    _bad(COO, lay, "duplicates", indices=dup)


def test_csr_validation():
    lay = _sample(CSR)
    _bad(CSR, lay, "'col_indices'.*dtype", col_indices=lay.col_indices.int())
    _bad(CSR, lay, "'crow_indices'.*dtype", crow_indices=lay.crow_indices.int())
    _bad(CSR, lay, "'values'.*shape", values=lay.values[:-1])
    _bad(CSR, lay, "'crow_indices'.*shape", crow_indices=lay.crow_indices[:-1])
    crow = lay.crow_indices.clone()
    crow[-1] += 1
    _bad(CSR, lay, "'crow_indices'.*end", crow_indices=crow)
    crow = lay.crow_indices.clone()
    crow[2] = int(crow[3]) + 1
    _bad(CSR, lay, "'crow_indices'.*non-decreasing", crow_indices=crow)
    col = lay.col_indices.clone()
    col[0] = 10
    _bad(CSR, lay, "out-of-range", col_indices=col)
    r0 = int(lay.crow_indices[1])  # row 0 has >= 2 entries in this sample
    col = lay.col_indices.clone()
    col[:r0] = col[:r0].flip(0)
    _bad(CSR, lay, "sorted", col_indices=col)


def test_bsr_validation():
    lay = _sample(BSR, blocksize=(4, 4))
    _bad(BSR, lay, "'block_mask'.*bool", block_mask=lay.block_mask.float())
    _bad(BSR, lay, "'values'.*shape", values=lay.values[:, :2])
    _bad(BSR, lay, "'col_indices'.*dtype", col_indices=lay.col_indices.int())
    col = lay.col_indices.clone()
    col[0] = 3
    _bad(BSR, lay, "out-of-range", col_indices=col)
    off = lay.values.clone()
    off[~lay.block_mask] = 1.0
    _bad(BSR, lay, "outside 'block_mask'", values=off)
    bm = lay.block_mask.clone()
    vals = lay.values.clone()
    last = int((lay.block_row_indices() == 1).nonzero()[0])  # a block in the padded last block row
    bm[last, 3, :] = True  # row 7 >= 6 rows
    _bad(BSR, lay, "padding", block_mask=bm, values=vals)


def test_nm_validation():
    lay = _sample(NM, n=2, m=4)
    _bad(NM, lay, "'indices'.*dtype", indices=lay.indices.long())
    _bad(NM, lay, "'values'.*shape", values=lay.values[:, :, :1])
    big = lay.indices.clone()
    big[0, 0, 1] = 4
    _bad(NM, lay, r"\[0, m=4\)", indices=big)
    _bad(NM, lay, "strictly increasing", indices=lay.indices.flip(-1))
    pad = lay.values.clone()  # K=10: positions 10, 11 are padding
    idx = lay.indices.clone()
    idx[0, 2] = torch.tensor([2, 3], dtype=torch.uint8)
    pad[0, 2] = 1.0
    _bad(NM, lay, "padding", indices=idx, values=pad)


def test_grouped_nm_validation():
    lay = GroupedNM.from_dense(torch.randn(6, 10), n=2, m=4, g=1)  # R_pad=8, K_pad=12
    _bad(GroupedNM, lay, "'columns'.*dtype", columns=lay.columns.long())
    _bad(GroupedNM, lay, "'values'.*shape", values=lay.values[..., :1])
    cols = lay.columns.clone()
    cols[0, 0, 0, 0] = cols[0, 0, 1, 0]
    _bad(GroupedNM, lay, "exactly once", columns=cols)
    vals = lay.values.clone()
    vals[1] = 1.0  # block 1 has padded rows 6, 7
    _bad(GroupedNM, lay, "padding", values=vals)


def test_validate_reports_component_name_via_init():
    lay = _sample(CSR)
    with pytest.raises(ValueError, match="'values'"):
        CSR(lay.crow_indices, lay.col_indices, lay.values.long().float()[:-1], lay.shape)


def test_masked_explicit_zero_and_empty():
    x = torch.zeros(0, 3)
    for layout, params in [
        (COO, {}),
        (CSR, {}),
        (BSR, {}),
        (NM, {"n": 1, "m": 2}),
        (GroupedNM, {"n": 1, "m": 2, "g": 1}),
        (Masked, {}),
    ]:
        lay = layout.from_dense(x, **params)
        assert lay.nnz == 0 and lay.density == 0.0 and lay.to_dense().shape == (0, 3)
