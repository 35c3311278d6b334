"""SparseTensor behaves like a tensor: metadata, printing, deepcopy, Parameter, autograd, compile."""

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sparsa
from sparsa.layouts import Masked, Dense


def _sp(shape=(4, 6), seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g)
    return w, sparsa.to_sparse(w, Masked, mask=w.abs() > 0.5, requires_grad=requires_grad)


def test_metadata_and_repr():
    w, s = _sp()
    assert s.shape == w.shape and s.dtype == w.dtype and s.device == w.device
    assert s.dim() == 2 and s.size(1) == 6 and s.numel() == 24
    assert not s.requires_grad
    r = repr(s)
    assert "layout=masked" in r and "nnz=" in r
    assert s.layout_name == "masked"
    assert s.nnz == int((w.abs() > 0.5).sum())
    assert 0 < s.density < 1 and abs(s.sparsity + s.density - 1) < 1e-12


def test_to_dense_matches_mask():
    w, s = _sp()
    assert torch.equal(s.to_dense(), w * (w.abs() > 0.5))
    assert torch.equal(s.pattern(), w.abs() > 0.5)


def test_to_sparse_rejects_integer_dtype():
    with pytest.raises(TypeError, match="floating-point"):
        sparsa.to_sparse(torch.ones(3, 3, dtype=torch.int64), Masked)


def test_sparse_tensor_rejects_non_layout():
    with pytest.raises(TypeError, match="Layout"):
        sparsa.SparseTensor(torch.ones(2))


def test_parameter_and_deepcopy():
    w, s = _sp()
    p = nn.Parameter(s)
    assert isinstance(p, nn.Parameter) and isinstance(p, sparsa.SparseTensor) and p.requires_grad
    q = copy.deepcopy(p)
    assert isinstance(q, nn.Parameter) and isinstance(q, sparsa.SparseTensor)
    assert torch.equal(q.to_dense(), p.to_dense())
    # independent storage
    q.sparse_layout.values.add_(1.0)
    assert not torch.equal(q.to_dense(), p.to_dense())


def test_pickle_roundtrip():
    _, s = _sp()
    t = pickle.loads(pickle.dumps(s))
    assert isinstance(t, sparsa.SparseTensor) and torch.equal(t.to_dense(), s.to_dense())


def test_detach_clone_to_keep_layout():
    _, s = _sp(requires_grad=True)
    for t in (s.detach(), s.clone(), s.to(torch.float64)):
        assert isinstance(t, sparsa.SparseTensor) and t.layout_name == "masked"
    assert s.to(torch.float64).dtype == torch.float64
    assert torch.equal(s.to(torch.float64).pattern(), s.pattern())


def test_grad_flows_to_dense_source_restricted_to_pattern():
    w = torch.randn(4, 6, requires_grad=True)
    mask = torch.rand(4, 6) > 0.5
    x = torch.randn(3, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sparsa.SparseFallbackWarning)
        y = F.linear(x, sparsa.to_sparse(w, Masked, mask=mask))
    y.sum().backward()
    expected = (torch.ones(3, 4).T @ x) * mask
    torch.testing.assert_close(w.grad, expected)


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
def test_optimizer_steps_keep_pattern(opt_cls):
    w, s = _sp(requires_grad=True)
    p = nn.Parameter(s)
    opt = opt_cls([p], lr=0.1)
    x = torch.randn(8, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sparsa.SparseFallbackWarning)
        for _ in range(3):
            opt.zero_grad()
            F.linear(x, p).pow(2).sum().backward()
            opt.step()
    assert isinstance(p, sparsa.SparseTensor)
    assert torch.equal(p.pattern(), w.abs() > 0.5)
    assert torch.all(p.to_dense()[~(w.abs() > 0.5)] == 0)
    assert not torch.equal(p.to_dense(), w * (w.abs() > 0.5))  # it did train


def test_inline_sparsifier_reapplied_after_update():
    class KeepTop:  # minimal sparsifier protocol: mask(dense) -> bool
        def mask(self, d):
            return d.abs() >= d.abs().flatten().kthvalue(d.numel() - 3).values

    _, s = _sp()
    p = nn.Parameter(s)
    p.inline_sparsifier = KeepTop()
    with torch.no_grad():
        p.add_(torch.randn(4, 6))
    assert p.nnz == 4


def test_compile_matches_eager():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    w = m[0].weight.detach()
    m[0].weight = nn.Parameter(sparsa.to_sparse(w, Masked, mask=w.abs() > 0.2))
    x = torch.randn(5, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = m(x)
        torch._dynamo.reset()
        out = torch.compile(m, backend="eager")(x)
    torch.testing.assert_close(out, ref)


def test_dense_layout_is_identity():
    x = torch.randn(3, 3)
    d = Dense.from_dense(x)
    assert d.nnz == 9 and torch.equal(d.to_dense(), x)
