"""RowGroup with a row permutation: rows of similar column importance share a group."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st

import sparsa
from sparsa.kernels import row_group as rg_kernels
from sparsa.layouts import RowGroup, row_group_mask
from sparsa.layouts._row_grouping import group_rows, kept_importance
from sparsa.layouts.row_group import GROUP_SIZES
from sparsa.methods import RowGroupSparsifier

PATHS = ["native", "fallback"]


@pytest.fixture
def path(request, monkeypatch):
    if request.param == "fallback":
        monkeypatch.setenv("SPARSA_NO_NATIVE", "1")
        assert rg_kernels.native_library() is None
    else:
        monkeypatch.delenv("SPARSA_NO_NATIVE", raising=False)
        assert rg_kernels.native_library() is not None, "native row_group kernel failed to build"
    return request.param


def _close(y, ref):
    scale = max(1.0, float(ref.detach().abs().max())) if ref.numel() else 1.0
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * scale)


def _clustered(R, K, clusters, gen, noise=0.3):
    """Rows drawn from ``clusters`` column-importance profiles, in shuffled order."""
    proto = torch.rand(clusters, K, generator=gen).pow(4) + 0.01
    which = torch.randint(0, clusters, (R,), generator=gen)
    rows = (proto[which] * (1 + noise * torch.randn(R, K, generator=gen))).abs().sqrt()
    return rows * torch.randn(R, K, generator=gen).sign()


# ---------------------------------------------------------------------------------------------- layout
@settings(max_examples=30, deadline=None)
@given(
    R=st.integers(1, 70),
    K=st.integers(1, 50),
    group=st.sampled_from(GROUP_SIZES),
    sparsity=st.floats(0.0, 0.95),
    seed=st.integers(0, 2**16),
)
def test_permuted_layout_roundtrip(R, K, group, sparsity, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(R, K, generator=gen)
    rg = RowGroup.from_dense(w, group=group, sparsity=sparsity, permute=True)
    n = rg.n_groups * group
    assert rg.row_perm.dtype == torch.int32 and rg.row_perm.shape == (n,)
    assert sorted(rg.row_perm.tolist()) == list(range(n))
    m = rg.mask()
    assert torch.equal(rg.to_dense(), w * m)
    assert torch.all(m.sum(1) == rg.kept)
    assert torch.equal(m, row_group_mask(w, sparsity, group, permute=True))
    # the mask alone recovers an equivalent layout (what sparsify / set_pattern do)
    again = RowGroup.from_dense(w, mask=m, group=group)
    assert torch.equal(again.to_dense(), rg.to_dense()) and torch.equal(again.mask(), m)
    # refill keeps the pattern, takes the new values
    assert torch.equal(rg.refill(torch.ones(R, K)).to_dense(), m.float())
    # rows of a group (in slot order) share their columns; padding slots come last
    assert rg.row_perm[R:].tolist() == list(range(R, n))
    slots = torch.cat([m, m.new_zeros(n - R, K)])[rg.row_perm.long()].view(-1, group, K)
    real = (rg.row_perm < R).view(-1, group)
    assert torch.all((slots == slots[:, :1])[real])


def test_permute_false_is_consecutive_and_mask_errors():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(16, 12, generator=gen)
    plain = RowGroup.from_dense(w, group=4, sparsity=0.5)
    assert not plain.permuted
    assert torch.equal(plain.row_perm, torch.arange(16, dtype=torch.int32))
    perm_mask = row_group_mask(w, 0.5, 4, permute=True)
    assert RowGroup.from_dense(w, mask=perm_mask, group=4).permuted or torch.equal(perm_mask, plain.mask())
    with pytest.raises(ValueError, match="permute=False"):
        RowGroup.from_dense(w, mask=torch.eye(16, 12, dtype=torch.bool), group=4, permute=False)
    with pytest.raises(ValueError, match="group-shared"):  # 12 distinct patterns: no grouping of 4 equal rows
        RowGroup.from_dense(w, mask=torch.eye(16, 12, dtype=torch.bool), group=4)
    with pytest.raises(TypeError, match="permute"):
        RowGroup.from_dense(w, group=4, sparsity=0.5, permute="yes")
    with pytest.raises(ValueError, match="scores"):
        RowGroup.from_dense(w, group=4, sparsity=0.5, scores=torch.ones(5))
    with pytest.raises(ValueError, match="row_perm"):
        RowGroup(plain.columns, plain.values, (16, 12), torch.zeros(16, dtype=torch.int32))
    with pytest.raises(ValueError, match="row_perm"):
        RowGroup(plain.columns, plain.values, (16, 12), torch.arange(16))


def test_scores_choose_the_pattern():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(32, 20, generator=gen)
    norm = torch.ones(20)
    norm[:5] = 100.0  # Wanda-style input norms: the first 5 features dominate
    for permute in (False, True):
        m = row_group_mask(w, 0.75, 8, permute=permute, scores=norm)
        assert torch.all(m[:, :5])
        full = RowGroup.from_dense(w, group=8, sparsity=0.75, permute=permute, scores=w.abs() * norm)
        assert torch.equal(full.mask(), m)


# ---------------------------------------------------------------------------------------------- grouping
@pytest.mark.parametrize("group", [4, 16])
@pytest.mark.parametrize("sparsity", [0.5, 0.9])
def test_grouping_improves_kept_importance(group, sparsity):
    gen = torch.Generator().manual_seed(group)
    R, K = 256, 96
    w = _clustered(R, K, clusters=R // (2 * group), gen=gen)
    imp = w.pow(2)
    k = round(K * (1 - sparsity))
    perm = group_rows(imp, group, k)
    assert sorted(perm.tolist()) == list(range(R))
    ident = kept_importance(imp, torch.arange(R), group, k)
    grouped = kept_importance(imp, perm, group, k)
    # per-row optimum (unstructured): an upper bound
    best = float(imp.double().topk(k, dim=1).values.sum())
    assert grouped > ident * 1.05
    assert grouped >= ident + 0.5 * (best - ident)  # recovers most of the gap on clustered rows
    rg_id = RowGroup.from_dense(w, group=group, sparsity=sparsity)
    rg_p = RowGroup.from_dense(w, group=group, sparsity=sparsity, permute=True)
    assert rg_p.to_dense().norm() > rg_id.to_dense().norm()


def test_grouping_padding_and_edge_cases():
    gen = torch.Generator().manual_seed(2)
    imp = torch.rand(37, 10, generator=gen)
    perm = group_rows(imp, 8, 3)
    assert perm.shape == (40,) and perm[37:].tolist() == [37, 38, 39]
    assert kept_importance(imp, perm, 8, 3) >= kept_importance(imp, torch.arange(40), 8, 3)
    assert group_rows(imp[:3], 8, 3).tolist() == list(range(8))  # one group: nothing to choose
    assert group_rows(imp, 8, 10).tolist() == list(range(40))  # everything kept
    with pytest.raises(ValueError, match="2-D"):
        group_rows(torch.rand(4), 4, 2)


# ---------------------------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("path", PATHS, indirect=True)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    T=st.integers(1, 40),
    R=st.integers(1, 70),
    K=st.integers(1, 90),
    group=st.sampled_from(GROUP_SIZES),
    sparsity=st.floats(0.0, 0.97),
    bias=st.booleans(),
    three_d=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_permuted_forward_matches_dense(path, T, R, K, group, sparsity, bias, three_d, seed):
    gen = torch.Generator().manual_seed(seed)
    w = sparsa.to_sparse(torch.randn(R, K, generator=gen), "row_group", sparsity=sparsity, group=group, permute=True)
    lead = (2, -(-T // 2)) if three_d else (T,)
    x = torch.randn(*lead, K, generator=gen)
    b = torch.randn(R, generator=gen) if bias else None
    y = F.linear(x, w, b)
    assert y.shape == (*lead, R)
    _close(y, F.linear(x, w.to_dense(), b))
    assert sparsa.fallback_counts() == {}


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("group", GROUP_SIZES)
def test_kernel_with_explicit_permutation(path, group):
    """Any permutation (padding slots anywhere), many tokens and a wide K (column blocks)."""
    gen = torch.Generator().manual_seed(group)
    R, K, T = 5 * group - 3, 1700, 29
    rg = RowGroup.from_dense(torch.randn(R, K, generator=gen), group=group, sparsity=0.7)
    perm = torch.randperm(rg.n_groups * group, generator=gen).to(torch.int32)
    shuffled = RowGroup(rg.columns, rg.values, rg.shape, perm)
    x, b = torch.randn(T, K, generator=gen), torch.randn(R, generator=gen)
    y = rg_kernels.row_group_linear(x, shuffled.columns, shuffled.values, b, R, shuffled.row_perm)
    _close(y, F.linear(x, shuffled.to_dense(), b))
    ident = rg_kernels.row_group_linear(x, rg.columns, rg.values, b, R, rg.row_perm)  # identity: fast path
    _close(ident, F.linear(x, rg.to_dense(), b))


@pytest.mark.parametrize("sparsity", [0.5, 0.9])
def test_gradcheck_float64(sparsity):
    gen = torch.Generator().manual_seed(0)
    wd = torch.randn(11, 13, generator=gen, dtype=torch.float64)
    mask = row_group_mask(wd, sparsity, 4, permute=True)
    assert RowGroup.from_dense(wd, mask=mask, group=4).permuted
    x = torch.randn(2, 3, 13, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(11, generator=gen, dtype=torch.float64, requires_grad=True)
    wd.requires_grad_()

    def fn(x, wd, b):
        return F.linear(x, sparsa.to_sparse(wd, "row_group", mask=mask, group=4), b)

    assert torch.autograd.gradcheck(fn, (x, wd, b), fast_mode=True)
    assert sparsa.fallback_counts() == {}


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("sparsity", [0.5, 0.92])
def test_backward_matches_dense_fp32(path, sparsity):
    gen = torch.Generator().manual_seed(1)
    wd = torch.randn(45, 64, generator=gen).requires_grad_()
    w = sparsa.to_sparse(wd, "row_group", sparsity=sparsity, group=8, permute=True)
    assert w.sparse_layout.permuted
    x = torch.randn(3, 11, 64, generator=gen).requires_grad_()
    b = torch.randn(45, generator=gen).requires_grad_()
    g = torch.randn(3, 11, 45, generator=gen)
    F.linear(x, w, b).backward(g)
    wr = w.to_dense().detach().requires_grad_()
    xr, br = x.detach().requires_grad_(), b.detach().requires_grad_()
    F.linear(xr, wr, br).backward(g)
    _close(x.grad, xr.grad)
    _close(wd.grad, wr.grad * w.pattern())
    _close(b.grad, br.grad)


# ---------------------------------------------------------------------------------------------- model level
def test_sparsifier_training_step_and_save_load(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 8))
    sp = RowGroupSparsifier(0.75, group=8, permute=True)
    assert "permute=True" in repr(sp)
    sparsa.sparsify(model, [sparsa.Rule(sparsifier=sp, layout="row_group", module_types=torch.nn.Linear)])
    w = model[0].weight
    assert w.layout_name == "row_group" and w.sparse_layout.permuted
    pattern = w.pattern().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 24)
    model(x).pow(2).mean().backward()
    opt.step()
    assert torch.equal(model[0].weight.pattern(), pattern)  # the optimizer step kept the permuted pattern
    ref = model(x)
    path = tmp_path / "m.safetensors"
    sparsa.save(model, path)
    fresh = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 8))
    sparsa.load(fresh, path)
    lay = fresh[0].weight.sparse_layout
    assert isinstance(lay, RowGroup) and torch.equal(lay.row_perm, w.sparse_layout.row_perm)
    _close(fresh(x), ref)


def test_components_without_row_perm_still_load():
    w = torch.randn(20, 16)
    rg = RowGroup.from_dense(w, group=8, sparsity=0.5)
    old = {"columns": rg.columns, "values": rg.values}  # what layouts written before row_perm hold
    back = RowGroup.from_components(old, (20, 16), group=8)
    assert not back.permuted and torch.equal(back.to_dense(), rg.to_dense())
    assert set(rg.components()) == {"columns", "values", "row_perm"}
