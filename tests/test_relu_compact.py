"""The relu_compact layout: relu(x) compacted per (pixel, channel slice); building, reading, validation,
conversions and the sparsa.adaptive helpers that return it."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import sparsa
import sparsa.adaptive as sa
from sparsa.kernels import adaptive as K
from sparsa.layouts import Masked, ReluCompact, convert


# ----------------------------------------------------------------------------- the layout
@pytest.mark.parametrize("shape", [(2, 5, 3, 4), (7, 9), (1, 130, 2, 2), (0, 4), (3, 0)])
@pytest.mark.parametrize("slice", [1, 3, 128])
def test_from_dense_is_relu_and_components_are_canonical(shape, slice):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    a = ReluCompact.from_dense(x, slice=slice)
    a.validate()
    assert a.shape == x.shape and a.params() == {"slice": slice}
    assert torch.equal(a.to_dense(), x.relu()) and a.nnz == int((x > 0).sum())
    assert torch.equal(a.mask(), x > 0)
    # the same activation gives the same components, bit for bit (nothing undefined past the counts)
    b = ReluCompact.from_dense(x.clone(), slice=slice)
    for k, t in a.components().items():
        assert torch.equal(t, b.components()[k]), k


@pytest.mark.parametrize("form", ["nchw", "channels_last", "strided"])
def test_the_zeroed_compaction_kernel_writes_every_entry(form):
    """The native kernel behind ReluCompact.from_dense writes 0 past each count itself, whatever the buffers
    held before (here -1 and NaN), on each of its three input paths; equal to the reference compaction."""
    lib = K.native_library()
    if lib is None:
        pytest.skip("native kernels unavailable")
    x = torch.randn(2, 21, 3, 10, generator=torch.Generator().manual_seed(4))
    if form == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif form == "strided":
        x = torch.randn(2, 21, 3, 20)[..., ::2]  # neither channels nor pixels contiguous
    slice = 8
    cnt, idx, val = K._compact_empty(x, slice, torch.float32)
    cnt.fill_(-1), idx.fill_(-1), val.fill_(float("nan"))
    N, C, H, W = x.shape
    lib.sparsa_adaptive_compact_zeroed_f32(
        x.data_ptr(), N, C, H, W, *x.stride(), slice, cnt.data_ptr(), idx.data_ptr(), val.data_ptr(), 1
    )
    ref = K._compact_reference(x, slice)
    P = N * H * W
    for got, want in zip((cnt, idx[: P * C], val[: P * C]), ref):
        assert torch.equal(got, want[: got.numel()])
    assert torch.equal(K.compact_zeroed(x, slice)[2], ref[2]) and torch.equal(K.compact_zeroed(x, slice)[1], ref[1])


@pytest.mark.parametrize("backend", ["native", "fallback"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shape=st.sampled_from([(2, 5, 3, 4), (1, 130, 2, 2), (3, 16, 1, 7), (7, 9), (33, 20), (0, 4), (2, 0, 3, 3)]),
    slice=st.sampled_from([1, 3, 8, 128]),
    form=st.sampled_from(["contiguous", "channels_last", "strided"]),
    seed=st.integers(0, 999),
)
def test_restrict_is_the_relu_derivative(monkeypatch, backend, shape, slice, form, seed):
    """ReluCompact.restrict(g) == where(x > 0, g, 0) for any strides of g, NaN and inf outside the pattern
    included, on the native masking kernel and on its PyTorch fallback; g itself is left unchanged."""
    if backend == "fallback":
        monkeypatch.setenv("SPARSA_NO_NATIVE", "1")
    else:
        monkeypatch.delenv("SPARSA_NO_NATIVE", raising=False)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    a = ReluCompact.from_dense(x, slice=slice)
    g = torch.randn(shape, generator=gen)
    g[(torch.rand(shape, generator=gen) < 0.1) & (x <= 0)] = float("nan")
    g[(torch.rand(shape, generator=gen) < 0.1) & (x <= 0)] = float("inf")
    if form == "channels_last" and len(shape) == 4:
        g = g.contiguous(memory_format=torch.channels_last)
    elif form == "strided":
        g = torch.stack([g, g], -1)[..., 0]
    before = g.clone()
    assert torch.equal(a.to_dense(), x.relu())
    got = a.restrict(g)
    assert got.shape == x.shape and got.dtype == g.dtype
    assert torch.equal(got, torch.where(x > 0, g, torch.zeros(()))), "kept where relu(x) > 0, 0 elsewhere"
    assert torch.equal(g.nan_to_num(), before.nan_to_num()) and torch.equal(g.isnan(), before.isnan())


@pytest.mark.parametrize("backend", ["native", "fallback"])
def test_operand_readers_skip_the_entries_past_each_count(monkeypatch, backend):
    """K.to_dense and K.restrict read only the entries inside each list's count: garbage past them (what
    the non-zeroed compaction leaves) changes nothing."""
    if backend == "fallback":
        monkeypatch.setenv("SPARSA_NO_NATIVE", "1")
    else:
        monkeypatch.delenv("SPARSA_NO_NATIVE", raising=False)
    gen = torch.Generator().manual_seed(9)
    x, g = torch.randn(2, 21, 3, 5, generator=gen), torch.randn(2, 21, 3, 5, generator=gen)
    slice = 8
    cnt, idx, val = K.compact_zeroed(x, slice)
    P, C = 2 * 3 * 5, 21
    past = ~K._entries(cnt, P, C, slice).reshape(-1)
    idx, val = idx.clone(), val.clone()
    idx[: P * C][past] = torch.randint(0, C, (int(past.sum()),), generator=gen, dtype=torch.int32)
    val[: P * C][past] = float("nan")
    assert torch.equal(K.to_dense(cnt, idx, val, [2, 21, 3, 5], slice), x.relu())
    assert torch.equal(K.restrict(cnt, idx, g, slice), torch.where(x > 0, g, torch.zeros(())))


def test_restrict_rejects_a_wrong_shape():
    a = ReluCompact.from_dense(torch.randn(2, 3, 4, 4))
    with pytest.raises(ValueError, match="restrict: dense must have the layout's shape"):
        a.restrict(torch.randn(2, 3, 4, 5))


def test_matrix_and_image_forms_share_components():
    x = torch.randn(6, 20)
    m, img = ReluCompact.from_dense(x, slice=8), sa.compact_matrix(x, slice=8)
    assert img.shape == (1, 20, 6, 1) and m.shape == (6, 20)
    for k in ("cnt", "idx", "val"):
        assert torch.equal(m.components()[k], img.components()[k])


def test_mask_keeping_a_negative_value_is_an_error():
    x = torch.tensor([[1.0, -2.0], [0.0, 3.0]])
    with pytest.raises(ValueError, match="mask keeps negative values"):
        ReluCompact.from_dense(x, mask=torch.ones(2, 2, dtype=torch.bool))
    a = ReluCompact.from_dense(x, mask=torch.tensor([[True, False], [True, False]]))
    assert torch.equal(a.to_dense(), torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="mask"):
        a.refill(torch.full((2, 2), -1.0))


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(shape=(2, 3, 4)), "N, C, H, W"),
        (dict(slice=0), "slice"),
        (dict(dtype=torch.int64), "floating-point"),
    ],
)
def test_from_dense_rejects_bad_arguments(bad, match):
    x = torch.randn(bad.get("shape", (2, 3))).to(bad.get("dtype", torch.float32))
    with pytest.raises((ValueError, TypeError), match=match):
        ReluCompact.from_dense(x, slice=bad.get("slice", 4))


def _broken(what):
    a = ReluCompact.from_dense(torch.tensor([[1.0, 2.0, -1.0, 3.0]]), slice=4)
    c = {k: v.clone() for k, v in a.components().items()}
    if what == "negative":
        c["val"][0] = -1.0
    elif what == "padding":
        c["val"][3] = 5.0
    elif what == "order":
        c["idx"][0], c["idx"][1] = 1, 0
    elif what == "slice":
        c["idx"][2] = 7
    elif what == "count":
        c["cnt"][0] = 5
    elif what == "dtype":
        c["cnt"] = c["cnt"].long()
    return c, a.shape


@pytest.mark.parametrize(
    "what, match",
    [
        ("negative", "positive"),
        ("padding", "past a count"),
        ("order", "increasing"),
        ("slice", "slice"),
        ("count", "cnt"),
        ("dtype", "int32"),
    ],
)
def test_validate_names_the_malformed_component(what, match):
    comps, shape = _broken(what)
    with pytest.raises(ValueError, match=match):
        ReluCompact.from_components(comps, shape, slice=4)


def test_compact_helpers_return_the_layout():
    assert sa.CompactActivation is ReluCompact
    x = torch.randn(2, 3, 4, 5)
    a = sa.compact(x, slice=2)
    assert isinstance(a, ReluCompact) and a.slice == 2 and torch.equal(a.to_dense(), x.relu())
    assert a.density == pytest.approx(float((x > 0).float().mean()))


def test_masked_conversions():
    x = torch.randn(5, 12)
    a = ReluCompact.from_dense(x, slice=5)
    m = convert(a, Masked)
    assert torch.equal(m.values, x.relu()) and torch.equal(m.mask(), x > 0)
    back = convert(m, ReluCompact)
    assert torch.equal(back.to_dense(), x.relu())
    with pytest.raises(ValueError, match="mask keeps negative values"):
        convert(Masked.from_dense(x), ReluCompact)
    t = sparsa.to_sparse(x, "relu_compact").to_layout("masked")
    assert t.layout_name == "masked" and torch.equal(t.to_dense(), x.relu())
