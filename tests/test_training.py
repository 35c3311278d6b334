"""Acceptance: sparse training on digits keeps every pattern exactly and matches dense accuracy."""

import copy

import pytest
import torch
import torch.nn as nn

import sparsa
from examples.demo import accuracy, load_digits_split, make_mlp, train
from sparsa.sparsifiers import Magnitude

pytestmark = pytest.mark.filterwarnings("ignore::sparsa.SparseFallbackWarning")

PRETRAIN_STEPS = 300  # ~14 epochs of 64-sample batches: a converged dense model before pruning
FINETUNE_STEPS = 50


@pytest.fixture(scope="module")
def pretrained():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: one thread is fastest and deterministic
    try:
        data = load_digits_split(seed=0)
        model = make_mlp(seed=0)
        opt = train(model, data[0], data[1], PRETRAIN_STEPS, seed=0)
        yield data, model, opt.state_dict()
    finally:
        torch.set_num_threads(threads)


def _patterns(model):
    return {n: p.pattern().clone() for n, p in sparsa.nn.sparse_parameters(model)}


def test_adam_sparse_finetune_keeps_pattern_and_accuracy(pretrained):
    (Xtr, ytr, Xte, yte), model, opt_state = pretrained
    dense = copy.deepcopy(model)
    dopt = torch.optim.Adam(dense.parameters(), lr=1e-3)
    dopt.load_state_dict(opt_state)
    train(dense, Xtr, ytr, FINETUNE_STEPS, seed=1, optimizer=dopt)  # same budget as the sparse model
    acc_dense = accuracy(dense, Xte, yte)

    sparse = sparsa.sparsify(copy.deepcopy(model), sparsa.Rule(sparsifier=Magnitude(0.75), module_types=nn.Linear))
    before = _patterns(sparse)
    assert len(before) == 3
    values_before = {n: p.sparse_layout.to_dense().clone() for n, p in sparsa.nn.sparse_parameters(sparse)}
    train(sparse, Xtr, ytr, FINETUNE_STEPS, seed=1)
    acc_sparse = accuracy(sparse, Xte, yte)

    for n, p in sparsa.nn.sparse_parameters(sparse):
        assert torch.equal(p.pattern(), before[n]), f"{n}: pattern changed during training"
        assert p.nnz == p.numel() - round(0.75 * p.numel())
        w = p.sparse_layout.to_dense()
        assert (w[~before[n]] == 0).all() and not torch.equal(w, values_before[n])
    assert acc_dense > 90.0, acc_dense
    assert acc_sparse >= acc_dense - 3.0, (acc_sparse, acc_dense)


@pytest.mark.parametrize(
    "opt_cls, kw",
    [(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}), (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01})],
)
@pytest.mark.parametrize("layout", ["masked", "csr"])
def test_sgd_and_adamw_keep_pattern(pretrained, opt_cls, kw, layout):
    (Xtr, ytr, Xte, yte), model, _ = pretrained
    sparse = sparsa.sparsify(
        copy.deepcopy(model), sparsa.Rule(sparsifier=Magnitude(0.75), layout=layout, module_types=nn.Linear)
    )
    before = _patterns(sparse)
    acc_pruned = accuracy(sparse, Xte, yte)
    train(sparse, Xtr, ytr, 20, seed=2, optimizer=opt_cls(sparse.parameters(), **kw))
    for n, p in sparsa.nn.sparse_parameters(sparse):
        assert p.layout_name == layout and torch.equal(p.pattern(), before[n]), n
    assert accuracy(sparse, Xte, yte) >= acc_pruned - 2.0  # training helps (or at least does not break it)
