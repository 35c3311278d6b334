"""Sparsifiers: exact counts, valid structures, determinism, errors, schedules."""

import copy
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from sparsa.sparsifiers import (
    NM,
    BlockMagnitude,
    ConstantSparsity,
    CubicSchedule,
    GroupedNM,
    KeepAll,
    Magnitude,
    Random,
    Sparsifier,
    Threshold,
)
from sparsa.sparsifiers.base import n_removed
from sparsa.sparsifiers.nm import local_nm_mask

SETTINGS = settings(max_examples=40, deadline=None)
shapes = st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple)
fractions = st.floats(0.0, 0.99, allow_nan=False)


def _tensor(shape, seed, ties=False):
    g = torch.Generator().manual_seed(seed)
    if ties:  # few distinct values -> many ties
        return torch.randint(-2, 3, shape, generator=g).float()
    return torch.randn(shape, generator=g)


@SETTINGS
@given(shape=shapes, s=fractions, seed=st.integers(0, 2**16), ties=st.booleans())
def test_magnitude_exact_count_and_keeps_largest(shape, s, seed, ties):
    x = _tensor(shape, seed, ties)
    m = Magnitude(s).mask(x)
    assert m.dtype == torch.bool and m.shape == x.shape
    assert int(m.sum()) == x.numel() - n_removed(s, x.numel())
    if 0 < int(m.sum()) < x.numel():
        assert x.abs()[m].min() >= x.abs()[~m].max()
    assert torch.equal(m, Magnitude(s).mask(x.clone()))  # deterministic (ties too)


@SETTINGS
@given(shape=shapes, s=fractions, seed=st.integers(0, 2**16), ties=st.booleans())
def test_magnitude_per_row_count(shape, s, seed, ties):
    x = _tensor(shape, seed, ties)
    m = Magnitude(s, per="row").mask(x)
    cols = x.shape[-1]
    rows = m.reshape(-1, cols)
    assert (rows.sum(-1) == cols - n_removed(s, cols)).all()
    xr = x.abs().reshape(-1, cols)
    for r in range(rows.shape[0]):
        k, d = rows[r], xr[r]
        if 0 < int(k.sum()) < cols:
            assert d[k].min() >= d[~k].max()


def test_magnitude_ties_break_to_lower_index():
    assert Magnitude(0.5).mask(torch.ones(4)).tolist() == [True, True, False, False]


@SETTINGS
@given(shape=shapes, seed=st.integers(0, 2**16), t=st.floats(0, 2))
def test_threshold(shape, seed, t):
    x = _tensor(shape, seed)
    assert torch.equal(Threshold(t).mask(x), x.abs() > t)


@SETTINGS
@given(shape=shapes, s=fractions, seed=st.integers(0, 1000))
def test_random_exact_and_reproducible(shape, s, seed):
    x = torch.ones(shape)
    m = Random(s, seed=seed).mask(x)
    assert int(m.sum()) == x.numel() - n_removed(s, x.numel())
    assert torch.equal(m, Random(s, seed=seed).mask(x))
    g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    assert torch.equal(Random(s, generator=g1).mask(x), Random(s, generator=g2).mask(x))


def test_random_is_not_constant():
    x = torch.ones(64)
    assert not torch.equal(Random(0.5, seed=0).mask(x), Random(0.5, seed=1).mask(x))


@SETTINGS
@given(
    rows=st.integers(1, 6),
    groups=st.integers(1, 5),
    nm=st.sampled_from([(1, 2), (2, 4), (1, 4), (3, 8)]),
    seed=st.integers(0, 2**16),
    ties=st.booleans(),
)
def test_nm_structure(rows, groups, nm, seed, ties):
    n, m = nm
    x = _tensor((rows, groups * m), seed, ties)
    mask = NM(n, m).mask(x)
    g = mask.reshape(rows, groups, m)
    assert (g.sum(-1) == n).all()
    xa = x.abs().reshape(rows, groups, m)
    kept_min = torch.where(g, xa, torch.full_like(xa, math.inf)).amin(-1)
    drop_max = torch.where(~g, xa, torch.full_like(xa, -math.inf)).amax(-1)
    assert (kept_min >= drop_max).all()
    assert torch.equal(mask, local_nm_mask(x, n, m))  # library mask == local reference


def test_nm_partial_tail_group():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    m = local_nm_mask(x, 2, 4)
    assert m.tolist() == [[False, False, True, True, True, True]]


def test_grouped_nm_uses_layout_mask():
    pytest.importorskip("sparsa.layouts.grouped_nm", reason="grouped_nm layout not installed yet")
    from sparsa.layouts.grouped_nm import grouped_nm_mask

    x = torch.randn(8, 16)
    s = GroupedNM(2, 4, g=4)
    assert torch.equal(s.mask(x), grouped_nm_mask(x, 2, 4, 4))
    assert s.layout_params() == {"n": 2, "m": 4, "g": 4}


@SETTINGS
@given(
    r=st.integers(1, 11),
    c=st.integers(1, 11),
    b=st.sampled_from([(1, 1), (2, 2), (4, 4), (2, 3)]),
    s=fractions,
    seed=st.integers(0, 2**16),
)
def test_block_structure(r, c, b, s, seed):
    x = _tensor((r, c), seed)
    mask = BlockMagnitude(s, block=b).mask(x)
    br, bc = b
    nr, nc = -(-r // br), -(-c // bc)
    kept = 0
    norms = {}
    for i in range(nr):
        for j in range(nc):
            blk = mask[i * br : (i + 1) * br, j * bc : (j + 1) * bc]
            assert blk.all() or not blk.any()  # whole blocks only
            kept += int(blk.all())
            norms[(i, j)] = (float(x[i * br : (i + 1) * br, j * bc : (j + 1) * bc].norm()), bool(blk.all()))
    assert kept == nr * nc - n_removed(s, nr * nc)
    k = [v for v, keep in norms.values() if keep]
    d = [v for v, keep in norms.values() if not keep]
    if k and d:
        assert min(k) >= max(d) - 1e-6


def test_keep_all_and_call_zeroes():
    x = torch.tensor([1.0, -2.0, 0.5])
    assert KeepAll().mask(x).all()
    y = Magnitude(1 / 3)(x)
    assert y.tolist() == [1.0, -2.0, 0.0]
    assert x.tolist() == [1.0, -2.0, 0.5]  # input untouched


def test_call_is_differentiable():
    x = torch.randn(6, requires_grad=True)
    Magnitude(0.5)(x).sum().backward()
    assert torch.equal(x.grad, Magnitude(0.5).mask(x).float())


@pytest.mark.parametrize(
    "make, arg",
    [
        (lambda: Magnitude(1.0), "sparsity"),
        (lambda: Magnitude(-0.1), "sparsity"),
        (lambda: Magnitude(0.5, per="col"), "per"),
        (lambda: Random(1.5), "sparsity"),
        (lambda: NM(4, 4), "n must be smaller"),
        (lambda: NM(0, 4), "n"),
        (lambda: NM(2, 0), "m"),
        (lambda: GroupedNM(2, 4, g=0), "g"),
        (lambda: BlockMagnitude(0.5, block=(0, 4)), "block"),
        (lambda: BlockMagnitude(0.5, block=4), "block"),
        (lambda: Threshold(-1), "threshold"),
        (lambda: Threshold(float("nan")), "threshold"),
        (lambda: CubicSchedule(0, 0.5, 10, 5), "end_step"),
        (lambda: CubicSchedule(0, 0.5, 0, 5, every=0), "every"),
        (lambda: Random(0.5, seed="a"), "seed"),
    ],
)
def test_bad_arguments(make, arg):
    with pytest.raises(ValueError, match=arg):
        make()


@pytest.mark.parametrize(
    "sp", [Magnitude(0.5), NM(2, 4), BlockMagnitude(0.5, (2, 2)), Threshold(0.1), Random(0.5, seed=0), KeepAll()]
)
def test_integer_input_is_type_error(sp):
    with pytest.raises(TypeError, match="floating-point"):
        sp.mask(torch.ones(4, 4, dtype=torch.int64))


@pytest.mark.parametrize("sp", [Magnitude(0.5), Magnitude(0.5, per="row"), NM(2, 4), BlockMagnitude(0.5, (2, 2))])
def test_nan_raises(sp):
    x = torch.randn(4, 4)
    x[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        sp.mask(x)


def test_threshold_drops_nan():
    assert Threshold(0.0).mask(torch.tensor([float("nan"), 1.0])).tolist() == [False, True]


def test_repr_eq_deepcopy_and_layout_params():
    s = NM(2, 4)
    assert repr(s) == "NM(n=2, m=4)" and s.layout_params() == {"n": 2, "m": 4}
    assert copy.deepcopy(s) == s and s != NM(1, 4)
    assert repr(Magnitude(0.5, per="row")) == "Magnitude(sparsity=0.5, per='row')"
    assert Magnitude(0.5).layout_params() == {}
    assert BlockMagnitude(0.5, (2, 2)).layout_params() == {"blocksize": (2, 2)}
    assert Magnitude(0.5).with_sparsity(0.9).sparsity == 0.9
    with pytest.raises(TypeError):
        NM(2, 4).with_sparsity(0.5)
    assert isinstance(KeepAll(), Sparsifier)


def test_dtype_and_device_kept():
    for dt in (torch.float16, torch.bfloat16, torch.float64):
        x = torch.randn(4, 8).to(dt)
        for sp in (Magnitude(0.5), NM(2, 4), BlockMagnitude(0.5, (2, 2)), Random(0.5, seed=1)):
            m = sp.mask(x)
            assert m.dtype == torch.bool and m.shape == x.shape
            assert sp(x).dtype == dt


def test_cubic_schedule():
    s = CubicSchedule(0.1, 0.9, start_step=10, end_step=110, every=10)
    assert s(0) == 0.1 and s(10) == 0.1 and s(110) == 0.9 and s(10_000) == 0.9
    assert s(59) == s(50)  # piecewise constant between updates
    assert abs(s(60) - (0.9 + (0.1 - 0.9) * (1 - 0.5) ** 3)) < 1e-12
    vals = [s(t) for t in range(0, 120)]
    assert all(a <= b for a, b in zip(vals, vals[1:]))  # monotone
    assert s.is_update_step(20) and not s.is_update_step(25)
    assert s.sparsifier_at(Magnitude(0.0), 110).sparsity == 0.9
    with pytest.raises(ValueError, match="step"):
        s(-1)


def test_constant_schedule():
    c = ConstantSparsity(0.5, begin_step=3)
    assert c(0) == 0.0 and c(3) == 0.5 and c(100) == 0.5
