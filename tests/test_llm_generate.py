"""A decoder LLM with bitmask weights: ``model.generate()`` unchanged, same tokens as the pruned weights run dense."""

import copy

import pytest
import torch

import sparsa
from sparsa.models.causal_lm import kv_cache_kwargs, output_cache
from sparsa.sparsifiers import NM, Magnitude

transformers = pytest.importorskip("transformers")


def _tiny_llama(seed=0):
    cfg = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def _pruned_pair(sparsifier, dtype):
    """(model with bitmask weights, the same pruned weights as plain dense tensors)."""
    sparse = _tiny_llama()
    sparsa.sparsify(
        sparse,
        [sparsa.Rule(sparsifier=sparsifier, layout="bitmask", names="model.layers.*", module_types=torch.nn.Linear)],
    )
    dense = copy.deepcopy(sparse)
    sparsa.densify(dense)
    return sparse.to(dtype), dense.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sparsifier", [Magnitude(0.5, per="row"), NM(2, 4)], ids=["unstructured50", "2:4"])
def test_greedy_generate_matches_dense_with_kv_cache(dtype, sparsifier):
    sparse, dense = _pruned_pair(sparsifier, dtype)
    linears = [m for n, m in sparse.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("model.layers")]
    assert linears and all(m.weight.layout_name == "bitmask" and m.weight.dtype == dtype for m in linears)
    assert not isinstance(sparse.lm_head.weight, sparsa.SparseTensor)
    prompt = torch.randint(3, 320, (2, 9), generator=torch.Generator().manual_seed(1))
    sparsa.reset_fallback_counts()
    with torch.no_grad():
        got = sparse.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=True, pad_token_id=0)
        want = dense.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=True, pad_token_id=0)
    assert sparsa.fallback_counts() == {}
    assert got.shape == (2, 21)
    assert torch.equal(got, want)


def test_decode_logits_match_dense():
    sparse, dense = _pruned_pair(Magnitude(0.7, per="row"), torch.float32)
    ids = torch.randint(3, 320, (1, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out_s = sparse(ids[:, :16], use_cache=True)
        out_d = dense(ids[:, :16], use_cache=True)
        step_s = sparse(ids[:, 16:], **kv_cache_kwargs(sparse, output_cache(out_s))).logits
        step_d = dense(ids[:, 16:], **kv_cache_kwargs(dense, output_cache(out_d))).logits
    torch.testing.assert_close(out_s.logits, out_d.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step_s, step_d, rtol=1e-4, atol=1e-4)


def test_kv_cache_keyword_follows_the_forward_signature():
    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, **kwargs):
            return cache

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs):
            return past_key_values

    assert kv_cache_kwargs(New(), "kv") == {"cache": "kv"} and New()(0, **kv_cache_kwargs(New(), "kv")) == "kv"
    assert kv_cache_kwargs(Old(), "kv") == {"past_key_values": "kv"}

    class Out:
        cache = None
        past_key_values = "old"

    assert output_cache(Out()) == "old"
    Out.cache = "new"
    assert output_cache(Out()) == "new"
