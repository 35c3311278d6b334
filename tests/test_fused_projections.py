"""fuse_projections: sibling projections (q/k/v, gate/up) run as one sparse product, same results."""

import copy
import pickle
import threading

import pytest
import torch
import torch.nn as nn

import sparsa
from sparsa.methods import OneShot
from sparsa.nn.fused_projections import FusedProjections, ProjectionSlice, fuse_projections


class SelfAttention(nn.Module):
    """The call pattern of a BERT/Llama self-attention: three projections of one input."""

    def __init__(self, d=48, kv=48, bias=True):
        super().__init__()
        self.query = nn.Linear(d, d, bias=bias)
        self.key = nn.Linear(d, kv, bias=bias)
        self.value = nn.Linear(d, kv, bias=bias)

    def forward(self, h):
        return self.query(h).sum(-1, keepdim=True) * self.key(h)[..., :8] + self.value(h)[..., :8]


class CrossAttention(SelfAttention):
    def forward(self, h, enc):
        return self.query(h)[..., :8] + self.key(enc)[..., :8] * self.value(enc)[..., :8]


class GatedMLP(nn.Module):
    def __init__(self, d=48, f=96):
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


# layouts whose from_dense takes a mask and stacks rows exactly; each must fuse
FUSING = [
    ("row_group", {}, "row_group8"),
    ("bitmask", {}, "unstructured"),
    ("sliced_ell", {}, "unstructured"),
    ("csr", {}, "unstructured"),
    ("masked", {}, "unstructured"),
    ("nm", {}, "2:4"),
]


def _sparse(model, layout, kw, pattern, dtype=torch.float32):
    torch.manual_seed(0)
    sparsity = 0.5 if pattern == "2:4" else 0.75
    sparsa.sparsify(model, OneShot(sparsity, pattern=pattern, layout=layout, layout_params=kw))
    return model.to(dtype)


class TestEveryLayout:
    @pytest.mark.parametrize("layout, kw, pattern", FUSING)
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_attention_fuses_and_matches(self, layout, kw, pattern, dtype):
        torch.manual_seed(1)
        m = _sparse(SelfAttention(kv=32), layout, kw, pattern, dtype)
        x = torch.randn(2, 5, 48).to(dtype)
        with torch.no_grad():
            ref = m(x)
            assert fuse_projections(m) == 1
            out = m(x)
        assert isinstance(m.query_key_value, FusedProjections)
        assert all(isinstance(getattr(m, n), ProjectionSlice) for n in ("query", "key", "value"))
        assert m.query_key_value.linear.weight.layout_name == layout
        assert m.query_key_value.linear.weight.shape == (48 + 32 + 32, 48)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
        assert not m.query_key_value._pending  # every part taken: nothing kept after the forward

    @pytest.mark.parametrize("layout, kw, pattern", FUSING)
    def test_gated_mlp_fuses_and_matches(self, layout, kw, pattern):
        m = _sparse(GatedMLP(), layout, kw, pattern)
        x = torch.randn(3, 48)
        with torch.no_grad():
            ref = m(x)
            assert fuse_projections(m) == 1
            out = m(x)
        assert isinstance(m.gate_proj_up_proj, FusedProjections) and type(m.down_proj) is nn.Linear
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_fused_weight_holds_exactly_the_siblings_rows():
    m = _sparse(SelfAttention(kv=32), "row_group", {}, "row_group8")
    parts = [getattr(m, n).weight.to_dense() for n in ("query", "key", "value")]
    fuse_projections(m)
    assert torch.equal(m.query_key_value.linear.weight.to_dense(), torch.cat(parts))


def test_bias_missing_on_some_siblings_counts_as_zero():
    m = SelfAttention()
    m.key.bias = None
    m = _sparse(m, "bitmask", {}, "unstructured")
    x = torch.randn(4, 48)
    with torch.no_grad():
        ref = m(x)
        fuse_projections(m)
        torch.testing.assert_close(m(x), ref, rtol=1e-5, atol=1e-5)


def test_a_sibling_called_alone_or_on_another_input_is_still_right():
    m = _sparse(SelfAttention(), "row_group", {}, "row_group8")
    ref = copy.deepcopy(m)
    fuse_projections(m)
    a, b = torch.randn(3, 48), torch.randn(3, 48)
    with torch.no_grad():
        torch.testing.assert_close(m.key(a), ref.key(a))
        torch.testing.assert_close(m.value(b), ref.value(b))  # not a's kept parts
        torch.testing.assert_close(m.value(a), ref.value(a))
        torch.testing.assert_close(m.query(b), ref.query(b))


def test_input_changed_in_place_between_siblings_runs_the_product_again():
    m = _sparse(SelfAttention(), "row_group", {}, "row_group8")
    ref = copy.deepcopy(m)
    fuse_projections(m)
    x = torch.randn(3, 48)
    with torch.no_grad():
        m.query(x)
        x.mul_(2)  # a new version of the same tensor object
        torch.testing.assert_close(m.key(x), ref.key(x))


def test_threads_do_not_take_each_others_parts():
    m = _sparse(SelfAttention(), "row_group", {}, "row_group8")
    ref = copy.deepcopy(m)
    fuse_projections(m)
    inputs = [torch.randn(8, 48) for _ in range(4)]
    with torch.no_grad():
        want = [ref(x) for x in inputs]
    errors = []

    def work(i):
        with torch.no_grad():
            for _ in range(50):
                if not torch.allclose(m(inputs[i]), want[i], atol=1e-5):
                    errors.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_copies_and_pickles_keep_no_pending_parts():
    m = _sparse(SelfAttention(), "row_group", {}, "row_group8")
    fuse_projections(m)
    with torch.no_grad():
        m.query(torch.randn(2, 48))  # key and value parts now pending
    assert m.query_key_value._pending
    for c in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert not c.query_key_value._pending
        assert c.key.fused is c.query_key_value  # the slices follow the copied fused module


def test_to_dtype_after_fusing_converts_the_fused_weight():
    m = _sparse(SelfAttention(), "bitmask", {}, "unstructured")
    fuse_projections(m)
    m = m.to(torch.bfloat16)
    assert m.key.fused.linear.weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert m(torch.randn(2, 48, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_gradient_flows_to_the_input():
    m = _sparse(SelfAttention(), "masked", {}, "unstructured")
    ref = copy.deepcopy(m)
    fuse_projections(m)
    x = torch.randn(3, 48, requires_grad=True)
    m(x).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    ref(x2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)


def test_what_is_not_fused():
    dense = SelfAttention()
    assert fuse_projections(dense) == 0  # dense weights: nothing sparse to gain
    cross = _sparse(CrossAttention(), "row_group", {}, "row_group8")
    assert fuse_projections(cross) == 0 and type(cross.key) is nn.Linear
    mixed = _sparse(SelfAttention(), "row_group", {}, "row_group8")
    mixed.value.weight = nn.Parameter(sparsa.to_sparse(mixed.value.weight.to_dense(), "bitmask"))
    assert fuse_projections(mixed) == 0  # two layouts: no one weight holds them
    widths = _sparse(SelfAttention(), "bitmask", {}, "unstructured")
    widths.key = nn.Linear(40, 48)
    assert fuse_projections(widths) == 0
    m = _sparse(SelfAttention(), "bitmask", {}, "unstructured")
    assert fuse_projections(m) == 1 and fuse_projections(m) == 0  # already fused


def test_model_must_be_a_module():
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        fuse_projections("bert")


def test_compiled_fused_model_matches_without_graph_breaks():
    m = _sparse(SelfAttention(), "bitmask", {}, "unstructured")
    x = torch.randn(4, 48)
    with torch.no_grad():
        ref = m(x)
        fuse_projections(m)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(m)(x)
        assert explained.graph_break_count == 0
        out = torch.compile(m, dynamic=False)(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert not m.query_key_value._pending


def test_bert_and_llama_outputs_unchanged():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    bert = transformers.BertModel(
        transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    ).eval()
    sparsa.sparsify(bert, OneShot(0.75, pattern="row_group8"))
    ids = torch.randint(0, 1000, (2, 12))
    with torch.no_grad():
        ref = bert(input_ids=ids).last_hidden_state
        assert fuse_projections(bert) == 2
        torch.testing.assert_close(bert(input_ids=ids).last_hidden_state, ref, rtol=1e-5, atol=1e-5)

    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    llama = transformers.LlamaForCausalLM(cfg).eval()
    sparsa.sparsify(llama, OneShot(0.5, layout="bitmask"))
    prompt = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        want = llama.generate(prompt, max_new_tokens=8, do_sample=False)
        assert fuse_projections(llama) == 4  # q/k/v and gate/up of each block
        got = llama.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)


def test_hooks_on_the_fused_linear_see_one_call_per_input():
    m = _sparse(SelfAttention(), "bitmask", {}, "unstructured")
    fuse_projections(m)
    calls = []
    m.query_key_value.linear.register_forward_hook(lambda mod, args, out: calls.append(out.shape))
    with torch.no_grad():
        m(torch.randn(3, 48))
    assert calls == [torch.Size([3, 48 * 3])]


def test_a_model_fused_before_training_trains_the_fused_weight():
    m = _sparse(SelfAttention(), "masked", {}, "unstructured")
    ref = copy.deepcopy(m)
    fuse_projections(m)
    w = m.query_key_value.linear.weight
    assert w.requires_grad and m.query_key_value.linear.bias.requires_grad
    x = torch.randn(3, 48)
    m(x).sum().backward()
    ref(x).sum().backward()
    want = torch.cat([getattr(ref, n).weight.grad.to_dense() for n in ("query", "key", "value")])
    got = w.grad.to_dense() if isinstance(w.grad, sparsa.SparseTensor) else w.grad
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    frozen = _sparse(SelfAttention(), "masked", {}, "unstructured")
    frozen.key.weight.requires_grad_(False)
    fuse_projections(frozen)
    assert not frozen.query_key_value.linear.weight.requires_grad  # frozen where any sibling was


def test_each_thread_keeps_its_own_parts():
    # thread a takes its query, thread b runs a whole attention in between, then a takes key and value:
    # a's parts must still be kept for it (one product per input and thread), not replaced by b's
    m = _sparse(SelfAttention(), "row_group", {}, "row_group8")
    fuse_projections(m)
    products = []
    m.query_key_value.linear.register_forward_hook(lambda mod, args, out: products.append(threading.get_ident()))
    xa, xb = torch.randn(2, 48), torch.randn(2, 48)
    a_started, b_done = threading.Event(), threading.Event()

    def a():
        with torch.no_grad():
            m.query(xa)
            a_started.set()
            b_done.wait(10)
            m.key(xa), m.value(xa)

    def b():
        a_started.wait(10)
        with torch.no_grad():
            m.query(xb), m.key(xb), m.value(xb)
        b_done.set()

    ta, tb = threading.Thread(target=a), threading.Thread(target=b)
    ta.start(), tb.start()
    ta.join(), tb.join()
    assert sorted(products.count(t) for t in set(products)) == [1, 1]
    assert not m.query_key_value._pending
