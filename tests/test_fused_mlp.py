"""fuse_mlp: a BERT-family layer's intermediate and output Linears as one row_group MLP call, same results."""

import copy

import pytest
import torch
import torch.nn as nn
from transformers import BertConfig, BertModel

import sparsa
from sparsa.kernels import row_group_mlp as rgm
from sparsa.methods import OneShot
from sparsa.nn.fuse import LinearGELU
from sparsa.nn.fused_mlp import FusedMLP, fuse_mlp


def _bert(pattern="row_group16", hidden_act="gelu", layers=2, dtype=torch.float32):
    torch.manual_seed(0)
    cfg = BertConfig(
        hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=128, hidden_act=hidden_act
    )
    m = BertModel(cfg).eval()
    if pattern is not None:
        m = sparsa.sparsify(m, OneShot(0.75, pattern=pattern))
    return m.to(dtype)


def _ids(batch=2, seq=40):
    return torch.randint(0, 1000, (batch, seq), generator=torch.Generator().manual_seed(batch))


def _out(m, ids):
    with torch.inference_mode():
        return m(ids).last_hidden_state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gelu_first", [False, True])
def test_fused_model_gives_the_unfused_results(dtype, gelu_first):
    m = _bert(dtype=dtype)
    ids = _ids()
    before = _out(m, ids)
    if gelu_first:
        assert sparsa.fuse_gelu(m) == 2
        assert isinstance(m.encoder.layer[0].intermediate.dense, LinearGELU)
    assert sparsa.fuse_mlp(m) == 2
    layer = m.encoder.layer[0]
    assert isinstance(layer.output.dense, FusedMLP) and type(layer.output.dense.up) is nn.Linear
    assert isinstance(layer.intermediate.dense, nn.Identity)
    after = _out(m, ids)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert float((after.float() - before.float()).abs().max()) <= tol * float(before.float().abs().max())
    assert sparsa.fuse_mlp(m) == 0  # fusing again finds nothing


def test_the_op_runs_once_per_layer(monkeypatch):
    m = _bert(dtype=torch.bfloat16)
    fuse_mlp(m)
    calls = []
    real = rgm.row_group_mlp_impl

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(rgm.row_group_mlp_kernel, "impl", spy)
    _out(m, _ids())
    assert len(calls) == 2


@pytest.mark.parametrize(
    ("pattern", "hidden_act"),
    [(None, "gelu"), ("sliced_ell", "gelu"), ("row_group16", "relu"), ("row_group16", "gelu_new")],
)
def test_left_alone(pattern, hidden_act):
    kw = {"pattern": pattern} if pattern != "sliced_ell" else {"pattern": None}
    m = _bert(hidden_act=hidden_act, **kw)
    if pattern == "sliced_ell":
        m = sparsa.sparsify(m, OneShot(0.75, pattern="unstructured", layout="sliced_ell"))
    assert fuse_mlp(m) == 0
    assert not any(isinstance(x, FusedMLP) for x in m.modules())


def test_mixed_dtypes_are_left_alone():
    m = _bert()
    m.encoder.layer[0].output.dense.to(torch.bfloat16)
    assert fuse_mlp(m) == 1  # layer 1 only


def test_an_intermediate_that_does_more_is_left_alone():
    m = _bert(layers=1)
    inter = m.encoder.layer[0].intermediate
    inter.forward = lambda h: inter.intermediate_act_fn(inter.dense(h)) * 2  # not gelu(dense(h))
    assert fuse_mlp(m) == 0


def test_training_composes_the_differentiable_products():
    m = _bert(layers=1)
    ref = copy.deepcopy(m)
    fuse_mlp(m)
    ids = _ids()
    m(ids).last_hidden_state.square().sum().backward()
    ref(ids).last_hidden_state.square().sum().backward()
    up = m.encoder.layer[0].output.dense.up
    want = ref.encoder.layer[0].intermediate.dense
    assert up.bias.grad is not None
    assert torch.allclose(up.bias.grad, want.bias.grad, rtol=1e-4, atol=1e-6)


def test_compiles_without_graph_breaks(monkeypatch):
    m = _bert(dtype=torch.bfloat16)
    ids = _ids(batch=1, seq=64)
    fuse_mlp(m)
    eager = _out(m, ids).float()
    compiled = torch.compile(m, fullgraph=True, dynamic=False)
    _out(compiled, ids)
    calls = []
    real = rgm.native_mlp
    monkeypatch.setattr(rgm, "native_mlp", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = _out(compiled, ids).float()  # Inductor rounds the glue around the op its own way: bf16 tolerance
    assert float((got - eager).abs().max()) <= 3e-2 * float(eager.abs().max())
    assert len(calls) == 2  # the graph calls the op once per layer


class TestFusedMLPErrors:
    def test_width_mismatch(self):
        with pytest.raises(ValueError, match="down.in_features=7 must equal up.out_features=8"):
            FusedMLP(nn.Linear(4, 8), nn.Linear(7, 4))

    def test_activation(self):
        with pytest.raises(ValueError, match="activation must be 'gelu'"):
            FusedMLP(nn.Linear(4, 8), nn.Linear(8, 4), activation="relu")

    def test_model_type(self):
        with pytest.raises(TypeError, match="model must be an nn.Module"):
            fuse_mlp("bert")

    def test_input_width(self):
        m = _bert(layers=1)
        fuse_mlp(m)
        with torch.inference_mode(), pytest.raises(ValueError, match="last dimension of 64"):
            m.encoder.layer[0].output.dense(torch.randn(3, 65))


def test_dense_weights_fall_back_inside_the_module():
    mlp = FusedMLP(nn.Linear(8, 16), nn.Linear(16, 4))
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.allclose(mlp(x), mlp.down(torch.nn.functional.gelu(mlp.up(x))))


def test_fuse_for_inference_runs_all_three():
    m = _bert(dtype=torch.bfloat16)
    ids = _ids()
    before = _out(m, ids).float()
    assert sparsa.fuse_for_inference(m) == {"gelu": 2, "projections": 2, "mlp": 2}
    assert sparsa.fuse_for_inference(m) == {"gelu": 0, "projections": 0, "mlp": 0}
    after = _out(m, ids).float()
    assert float((after - before).abs().max()) <= 2e-2 * float(before.abs().max())
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        sparsa.fuse_for_inference(None)


@pytest.mark.parametrize("gelu_first", [False, True])
def test_sequential_runs_are_fused(gelu_first):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 48), nn.ReLU(), nn.Linear(48, 32))
    m = sparsa.sparsify(m, OneShot(0.75, pattern="row_group16")).to(torch.bfloat16)
    x = torch.randn(64, 48).bfloat16()
    with torch.inference_mode():
        before = m(x).float()
        if gelu_first:
            assert sparsa.fuse_gelu(m) == 1
        assert fuse_mlp(m) == 1  # Linear, ReLU, Linear is no GELU MLP
        assert isinstance(m[0], FusedMLP) and isinstance(m[1], nn.Identity) and isinstance(m[2], nn.Identity)
        assert type(m[4]) is nn.Linear
        after = m(x).float()
    assert float((after - before).abs().max()) <= 2e-2 * float(before.abs().max())


def test_sequential_with_dense_or_tanh_gelu_is_left_alone():
    m = nn.Sequential(nn.Linear(48, 96), nn.GELU(approximate="tanh"), nn.Linear(96, 48))
    m = sparsa.sparsify(m, OneShot(0.75, pattern="row_group16"))
    assert fuse_mlp(m) == 0
    assert fuse_mlp(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))) == 0
