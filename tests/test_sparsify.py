"""Model-level sparsify / densify / report: rules, optimizers, outputs, gradients, copy & compile."""

import copy
import re

import pytest
import torch
import torch.nn as nn

import sparsa
from sparsa import Rule
from sparsa.sparsifiers import NM, BlockMagnitude, KeepAll, Magnitude, Threshold

pytestmark = pytest.mark.filterwarnings("ignore::sparsa.SparseFallbackWarning")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32))
        self.act = nn.ReLU()
        self.head = nn.Linear(32, 4)
        self.norm = nn.LayerNorm(32)

    def forward(self, x):
        return self.head(self.act(self.norm(self.enc(x))))


def _net(seed=0):
    torch.manual_seed(seed)
    return Net()


def _x(seed=1, n=8):
    return torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))


LAYOUT_SPARSIFIERS = [
    ("masked", Magnitude(0.75)),
    ("csr", Magnitude(0.75)),
    ("coo", Magnitude(0.5)),
    ("nm", NM(2, 4)),
    ("bsr", BlockMagnitude(0.5, (4, 4))),
    ("grouped_nm", sparsa.sparsifiers.GroupedNM(2, 4, 4)),
]


@pytest.mark.parametrize("layout, sp", LAYOUT_SPARSIFIERS)
def test_weights_sparsified_and_outputs_match_dense_masked(layout, sp):
    model = _net()
    dense = copy.deepcopy(model)
    sparsa.sparsify(model, Rule(sparsifier=sp, layout=layout, module_types=nn.Linear))
    for name in ("enc.0", "enc.2", "head"):
        w = model.get_submodule(name).weight
        dw = dense.get_submodule(name).weight.detach()
        assert isinstance(w, sparsa.SparseTensor) and isinstance(w, nn.Parameter) and w.requires_grad
        assert w.layout_name == layout
        assert torch.equal(w.pattern(), sp.mask(dw))
        with torch.no_grad():
            dense.get_submodule(name).weight.mul_(sp.mask(dw))
    assert not isinstance(model.norm.weight, sparsa.SparseTensor)  # LayerNorm not matched
    x = _x()
    torch.testing.assert_close(model(x), dense(x))


def test_sparsifier_shorthand_targets_linear_weights():
    model = sparsa.sparsify(_net(), Magnitude(0.5))
    assert [n for n, _ in sparsa.nn.sparse_parameters(model)] == ["enc.0.weight", "enc.2.weight", "head.weight"]


@pytest.mark.parametrize(
    "names, expected",
    [
        ("enc.*", {"enc.0", "enc.2"}),
        ("re:enc\\.[0-9]", {"enc.0", "enc.2"}),
        (re.compile("head|enc\\.2"), {"enc.2", "head"}),
        (["head", "enc.0"], {"enc.0", "head"}),
    ],
)
def test_name_patterns(names, expected):
    model = sparsa.sparsify(_net(), Rule(sparsifier=Magnitude(0.5), names=names))
    got = {n.rsplit(".", 1)[0] for n, _ in sparsa.nn.sparse_parameters(model)}
    assert got == expected


def test_first_matching_rule_wins():
    model = sparsa.sparsify(
        _net(),
        [Rule(sparsifier=NM(1, 4), layout="nm", names="head"), Rule(sparsifier=Magnitude(0.5), module_types=nn.Linear)],
    )
    assert model.head.weight.layout_name == "nm" and abs(model.head.weight.density - 0.25) < 1e-9
    assert model.enc[0].weight.layout_name == "masked" and abs(model.enc[0].weight.density - 0.5) < 1e-9


def test_rule_matching_nothing_raises_with_module_names():
    model = _net()
    with pytest.raises(ValueError, match=r"matches no module.*enc\.0 \(Linear"):
        sparsa.sparsify(model, Rule(sparsifier=Magnitude(0.5), names="decoder.*"))
    with pytest.raises(ValueError, match="claimed by an earlier rule"):
        sparsa.sparsify(
            model, [Rule(sparsifier=Magnitude(0.5), module_types=nn.Linear), Rule(sparsifier=NM(2, 4), names="head")]
        )
    with pytest.raises(ValueError, match="parameter 'kernel'"):
        sparsa.sparsify(model, Rule(sparsifier=Magnitude(0.5), param="kernel"))
    assert not any(isinstance(p, sparsa.SparseTensor) for p in model.parameters())  # nothing half-applied


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(target="bias!"), "target"),
        (dict(sparsifier="magnitude"), "sparsifier"),
        (dict(layout="nope"), "unknown layout"),
        (dict(module_types=int), "module_types"),
        (dict(target="output", inline=True), "inline"),
        (dict(inline=True), "inline"),
    ],
)
def test_bad_rules(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Rule(**kwargs)


def test_bad_rules_argument():
    with pytest.raises(TypeError, match="rules"):
        sparsa.sparsify(_net(), "magnitude")


def test_not_inplace_leaves_original():
    model = _net()
    out = sparsa.sparsify(model, Magnitude(0.5), inplace=False)
    assert out is not model and not any(isinstance(p, sparsa.SparseTensor) for p in model.parameters())
    assert isinstance(out.head.weight, sparsa.SparseTensor)


def test_tied_weights_stay_tied():
    a, b = nn.Linear(8, 8), nn.Linear(8, 8)
    b.weight = a.weight
    model = nn.Sequential(a, b)
    sparsa.sparsify(model, Magnitude(0.5))
    assert model[0].weight is model[1].weight and isinstance(model[0].weight, sparsa.SparseTensor)
    assert len(list(model.parameters())) == 3


def _train(model, opt_cls, steps=5, **kw):
    opt = opt_cls(model.parameters(), lr=1e-2, **kw)
    x, y = _x(n=16), torch.randint(0, 4, (16,), generator=torch.Generator().manual_seed(3))
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("layout, sp", [("masked", Magnitude(0.75)), ("csr", Magnitude(0.75)), ("nm", NM(2, 4))])
def test_optimizers_keep_pattern(opt_cls, layout, sp):
    model = sparsa.sparsify(_net(), Rule(sparsifier=sp, layout=layout, module_types=nn.Linear))
    before = {
        n: (p.pattern().clone(), p.sparse_layout.to_dense().clone()) for n, p in sparsa.nn.sparse_parameters(model)
    }
    _train(model, opt_cls, **({"momentum": 0.9} if opt_cls is torch.optim.SGD else {}))
    for n, p in sparsa.nn.sparse_parameters(model):
        assert isinstance(p, sparsa.SparseTensor) and p.layout_name == layout
        assert torch.equal(p.pattern(), before[n][0]), n
        assert not torch.equal(p.sparse_layout.to_dense(), before[n][1]), f"{n} did not train"
        assert (p.sparse_layout.to_dense()[~p.pattern()] == 0).all()


def test_inline_sparsifier_reapplied_after_step():
    model = sparsa.sparsify(_net(), Rule(sparsifier=Magnitude(0.75), module_types=nn.Linear, inline=True))
    assert model.head.weight.inline_sparsifier == Magnitude(0.75)
    _train(model, torch.optim.Adam, steps=20)
    for _, p in sparsa.nn.sparse_parameters(model):
        assert p.nnz == p.numel() - round(0.75 * p.numel())
        assert torch.equal(p.pattern(), Magnitude(0.75).mask(p.sparse_layout.to_dense()))
    model = sparsa.sparsify(_net(), Rule(sparsifier=Magnitude(0.5), module_types=nn.Linear, inline=Threshold(0.05)))
    _train(model, torch.optim.SGD)
    w = model.head.weight
    assert torch.equal(w.pattern(), w.sparse_layout.to_dense().abs() > 0.05)


def test_output_target():
    model = _net()
    dense = copy.deepcopy(model)
    sparsa.sparsify(model, Rule(target="output", sparsifier=Magnitude(0.5), names="enc.1"))
    seen = {}
    model.enc[2].register_forward_pre_hook(lambda m, a: seen.setdefault("in", a[0]))
    x = _x()
    out = model(x)
    assert isinstance(seen["in"], sparsa.SparseTensor) and abs(seen["in"].sparsity - 0.5) < 1e-9
    # reference: dense model with the same mask applied to the ReLU output
    dense.enc[1].register_forward_hook(lambda m, i, o: Magnitude(0.5)(o))
    torch.testing.assert_close(out, dense(x))
    out.sum().backward()
    dense(x).sum().backward()
    torch.testing.assert_close(model.enc[0].weight.grad, dense.enc[0].weight.grad)
    rows = [r for r in sparsa.sparsity_report(model) if r["target"] == "output"]
    assert rows and rows[0]["name"] == "enc.1:output" and rows[0]["shape"] == (8, 32)


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
def test_grad_target(opt_cls):
    base = sparsa.sparsify(_net(), Rule(sparsifier=Magnitude(0.75), module_types=nn.Linear))
    ref = copy.deepcopy(base)
    sparsa.sparsify(base, Rule(target="grad", layout="csr", module_types=nn.Linear))
    x = _x()
    base(x).sum().backward()
    g = base.head.weight.grad
    assert isinstance(g, sparsa.SparseTensor) and g.layout_name == "csr"
    assert not (g.pattern() & ~base.head.weight.pattern()).any()
    base.zero_grad()
    _train(base, opt_cls)
    _train(ref, opt_cls)
    for (n, p), (_, q) in zip(sparsa.nn.sparse_parameters(base), sparsa.nn.sparse_parameters(ref)):
        assert torch.equal(p.pattern(), q.pattern())
        torch.testing.assert_close(p.sparse_layout.to_dense(), q.sparse_layout.to_dense(), rtol=1e-5, atol=1e-6)
    rows = {r["name"]: r for r in sparsa.sparsity_report(base)}
    assert rows["head.weight"]["grad_layout"] == "csr"


def test_weight_and_grad_rules_in_one_call():
    model = sparsa.sparsify(
        _net(),
        [Rule(sparsifier=NM(2, 4), layout="nm", names="head"), Rule(target="grad", layout="masked", names="head")],
    )
    model(_x()).sum().backward()
    assert isinstance(model.head.weight.grad, sparsa.SparseTensor)


def test_grad_layout_survives_deepcopy():
    model = sparsa.sparsify(
        _net(), [Rule(sparsifier=Magnitude(0.5), names="head"), Rule(target="grad", layout="csr", names="head")]
    )
    clone = copy.deepcopy(model)
    clone(_x()).sum().backward()
    assert isinstance(clone.head.weight.grad, sparsa.SparseTensor) and clone.head.weight.grad.layout_name == "csr"
    assert model.head.weight.grad is None


def test_grad_rule_on_dense_weight_raises():
    with pytest.raises(ValueError, match="dense"):
        sparsa.sparsify(_net(), Rule(target="grad", layout="csr", names="head"))


def test_keep_pattern_when_changing_layout():
    model = sparsa.sparsify(_net(), Magnitude(0.8))
    pat = model.head.weight.pattern().clone()
    sparsa.sparsify(model, Rule(layout="csr", module_types=nn.Linear))  # sparsifier=None: keep pattern
    assert model.head.weight.layout_name == "csr" and torch.equal(model.head.weight.pattern(), pat)
    sparsa.sparsify(model, Rule(sparsifier=KeepAll(), layout="masked", names="head"))
    assert model.head.weight.density == 1.0


def test_report_and_format():
    model = sparsa.sparsify(_net(), Rule(sparsifier=Magnitude(0.75), layout="csr", module_types=nn.Linear))
    rows = sparsa.sparsity_report(model)
    by = {r["name"]: r for r in rows}
    assert set(by) >= {"enc.0.weight", "enc.0.bias", "head.weight", "norm.weight"}
    r = by["enc.0.weight"]
    assert r["layout"] == "csr" and r["shape"] == (32, 16) and r["sparsity"] == 0.75
    assert r["dense_nbytes"] == 32 * 16 * 4 and 0 < r["nbytes"] < r["dense_nbytes"]
    assert by["enc.0.bias"]["layout"] == "dense" and by["enc.0.bias"]["nbytes"] == 32 * 4
    text = sparsa.format_report(rows)
    assert "enc.0.weight" in text and "csr" in text and "75.0%" in text and "total" in text


def test_densify_roundtrip():
    model = sparsa.sparsify(
        _net(),
        [
            Rule(sparsifier=NM(2, 4), layout="nm", module_types=nn.Linear),
            Rule(target="output", sparsifier=Magnitude(0.9), names="act"),
        ],
    )
    x = _x()
    out = model(x)
    dense = sparsa.densify(model, inplace=False)
    assert not any(isinstance(p, sparsa.SparseTensor) for p in dense.parameters())
    assert not dense.act._forward_hooks
    assert isinstance(model.head.weight, sparsa.SparseTensor)  # inplace=False
    nohook = copy.deepcopy(model)
    nohook.act._forward_hooks.clear()
    torch.testing.assert_close(dense(x), nohook(x))
    assert not torch.allclose(dense(x), out)  # the output rule is gone


def test_deepcopy_matches():
    model = sparsa.sparsify(
        _net(),
        [
            Rule(sparsifier=NM(2, 4), layout="nm", names="enc.*"),
            Rule(sparsifier=Magnitude(0.5), layout="csr", names="head"),
            Rule(target="output", sparsifier=Magnitude(0.5), names="act"),
        ],
    )
    clone = copy.deepcopy(model)
    x = _x()
    torch.testing.assert_close(clone(x), model(x))
    assert clone.head.weight is not model.head.weight and clone.head.weight.layout_name == "csr"


def test_compile_eager_backend_matches():
    model = sparsa.sparsify(
        _net(),
        [
            Rule(sparsifier=Magnitude(0.75), layout="masked", module_types=nn.Linear),
            Rule(target="output", sparsifier=Magnitude(0.5), names="act"),
        ],
    )
    x = _x()
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(model, backend="eager")(x), model(x))


@pytest.mark.slow
def test_compile_inductor_tiny():
    torch.manual_seed(0)
    model = sparsa.sparsify(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), Magnitude(0.5))
    x = torch.randn(3, 8)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(model)(x), model(x))
