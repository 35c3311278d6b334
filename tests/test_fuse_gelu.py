"""fuse_gelu: Linear -> GELU pairs run as one row_group kernel with a GELU epilogue, same results."""

import copy

import pytest
import torch
import torch.nn as nn

import sparsa
from sparsa.kernels import row_group as rg
from sparsa.kernels import sliced_ell as se
from sparsa.methods import OneShot
from sparsa.nn.fuse import LinearGELU, fuse_gelu, is_exact_gelu


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 48), nn.GELU(approximate="tanh"), nn.Linear(48, 8))


LAYOUTS = [("row_group", dict(group=8)), ("sliced_ell", {}), ("bitmask", {})]


@pytest.mark.parametrize("layout, kw", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sequential_pairs_fuse_and_match(dtype, layout, kw):
    m = _mlp()
    sparsa.sparsify(m, OneShot(0.75, layout=layout, layout_params=kw))
    m = m.to(dtype)
    x = torch.randn(5, 48).to(dtype)
    with torch.no_grad():
        ref = m(x)
        assert fuse_gelu(m) == 1  # the tanh GELU is not the kernel's GELU: left alone
        assert isinstance(m[0], LinearGELU) and isinstance(m[1], nn.Identity)
        assert isinstance(m[3], nn.GELU) and type(m[2]) is nn.Linear
        out = m(x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "layout, kw, module, fn, at",
    [
        ("row_group", dict(group=8), rg, "row_group_linear_kernel", 6),
        ("sliced_ell", {}, se, "sliced_ell_linear_kernel", 6),
    ],
)
def test_fused_epilogue_runs_in_inference(monkeypatch, layout, kw, module, fn, at):
    m = _mlp()
    sparsa.sparsify(m, OneShot(0.75, layout=layout, layout_params=kw))
    fuse_gelu(m)
    seen = []
    real = getattr(module, fn)
    monkeypatch.setattr(module, fn, lambda *a: seen.append(a[at] if len(a) > at else "none") or real(*a))
    with torch.no_grad():
        m(torch.randn(3, 48))
    assert seen == ["gelu", "none", "none"]


@pytest.mark.parametrize("layout, kw", LAYOUTS)
def test_training_through_a_fused_model_matches(layout, kw):
    m = _mlp()
    sparsa.sparsify(m, OneShot(0.75, layout=layout, layout_params=kw))
    f = copy.deepcopy(m)
    fuse_gelu(f)
    x = torch.randn(4, 48)
    m(x).square().sum().backward()
    f(x).square().sum().backward()
    for (n, p), (_, q) in zip(m.named_parameters(), f.named_parameters()):
        torch.testing.assert_close(
            q.grad if not isinstance(q.grad, sparsa.SparseTensor) else q.grad.to_dense(),
            p.grad if not isinstance(p.grad, sparsa.SparseTensor) else p.grad.to_dense(),
            rtol=1e-5,
            atol=1e-6,
        )


def test_dense_linears_and_state_dict_untouched():
    m = _mlp()
    assert fuse_gelu(m) == 0  # nothing sparse: nothing to gain
    sparsa.sparsify(m, OneShot(0.75, layout="row_group", layout_params={"group": 8}))
    keys = list(m.state_dict())
    fuse_gelu(m)
    assert list(m.state_dict()) == keys


def test_bert_intermediate_is_fused():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=100
    )
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).eval()
    names = [n for n, mod in model.named_modules() if isinstance(mod, nn.Linear) and ".layer." in n]
    sparsa.sparsify(
        model,
        [
            sparsa.Rule(
                sparsifier=sparsa.methods.pattern.RowGroupSparsifier(0.5, group=16), layout="row_group", names=names
            )
        ],
    )
    ids = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        ref = model(ids).last_hidden_state
        assert fuse_gelu(model) == 2
        out = model(ids).last_hidden_state
    assert is_exact_gelu(transformers.activations.GELUActivation())
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def _compiled_code(m, x):
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm.code)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(m, backend=backend, fullgraph=True)(x)
    return out, "\n".join(graphs)


KERNEL_OPS = {"row_group": "row_group_linear_kernel", "sliced_ell": "sliced_ell_linear_kernel", "bitmask": "bitmask"}


@pytest.mark.parametrize("layout, kw", LAYOUTS)
def test_compiled_graph_runs_the_gelu_epilogue(layout, kw):
    # under torch.compile a traced weight's own attributes read as missing, so the fused module must still know
    # its layout (it did not: the compiled graph ran the linear and a separate GELU, silently)
    m = _mlp()
    sparsa.sparsify(m, OneShot(0.75, layout=layout, layout_params=kw))
    fuse_gelu(m)
    x = torch.randn(6, 48)
    with torch.no_grad():
        ref = m(x)
    out, code = _compiled_code(m, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()
    with torch.no_grad():  # through AOT autograd too
        torch.testing.assert_close(torch.compile(m, backend="aot_eager")(x), ref, rtol=1e-5, atol=1e-6)
    assert "'gelu'" in code and KERNEL_OPS[layout] in code, code
    assert code.count("torch._C._nn.gelu(") == 1 and "approximate = 'tanh'" in code, code  # only the tanh GELU


def test_a_new_weight_in_another_layout_is_followed_under_compile():
    m = _mlp()
    sparsa.sparsify(m, OneShot(0.75, layout="row_group", layout_params=dict(group=8)))
    fuse_gelu(m)
    assert m[0].epilogue_layout == "row_group"
    lay = sparsa.to_sparse(m[0].weight.to_dense().detach(), "sliced_ell")
    m[0].weight = nn.Parameter(lay)  # no eager call in between
    assert m[0].epilogue_layout == "sliced_ell"
    x = torch.randn(6, 48)
    with torch.no_grad():
        ref = m(x)
    out, code = _compiled_code(m, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert "sliced_ell_linear_kernel" in code and "row_group" not in code, code
    m[0].weight = nn.Parameter(m[0].weight.to_dense().detach())  # dense again: plain linear and GELU
    assert m[0].epilogue_layout is None
    with torch.no_grad():
        torch.testing.assert_close(_compiled_code(m, x)[0], m(x))


def test_layouts_without_an_epilogue_stay_unfused():
    m = _mlp()
    sparsa.sparsify(m, OneShot(0.5, layout="grouped_nm"))
    assert fuse_gelu(m) == 0 and type(m[0]) is nn.Linear and isinstance(m[1], nn.GELU)
