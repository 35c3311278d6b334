"""Compiled decoding (static KV cache + torch.compile): same tokens as eager decoding, no graph break."""

import copy

import pytest
import torch

import sparsa
from sparsa.models.causal_lm import kv_cache_kwargs, tiny_llama
from sparsa.models.compiled_decode import (
    compile_config,
    compile_decode_step,
    compiled_generate_kwargs,
    static_cache,
)
from sparsa.sparsifiers import NM, Magnitude

transformers = pytest.importorskip("transformers")


def _tiny_llama():
    return tiny_llama(intermediate=176, vocab=320, max_position_embeddings=128, tie_word_embeddings=False)


def _bitmask(model, sparsifier):
    sparsa.sparsify(
        model,
        [sparsa.Rule(sparsifier=sparsifier, layout="bitmask", names="model.layers.*", module_types=torch.nn.Linear)],
    )
    sparsa.fuse_projections(model)
    return model


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sparsifier", [Magnitude(0.5, per="row"), NM(2, 4)], ids=["unstructured50", "2:4"])
def test_compiled_generate_gives_the_eager_tokens(dtype, sparsifier):
    model = _bitmask(_tiny_llama(), sparsifier).to(dtype)
    dense = copy.deepcopy(model)
    sparsa.densify(dense)
    prompt = torch.randint(3, 320, (2, 9), generator=torch.Generator().manual_seed(1))
    sparsa.reset_fallback_counts()
    with torch.inference_mode():
        want = dense.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
        got = model.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0, **compiled_generate_kwargs())
        again = model.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0, **compiled_generate_kwargs())
    assert sparsa.fallback_counts() == {}
    assert hasattr(model, "_compiled_call"), "generate() did not compile the decode step"
    assert torch.equal(got, want) and torch.equal(again, want)


def test_decode_step_on_a_static_cache_compiles_whole_and_matches_eager():
    model = _bitmask(_tiny_llama(), Magnitude(0.6, per="row"))
    ids = torch.randint(3, 320, (1, 11), generator=torch.Generator().manual_seed(2))
    explain = None

    def decode(step):
        cache = static_cache(model, 11 + 6)
        kv = kv_cache_kwargs(model, cache)
        with torch.no_grad():
            tok = model(ids, use_cache=True, **kv).logits[:, -1:].argmax(-1)
            logits = []
            for _ in range(6):
                out = step(tok, use_cache=True, **kv).logits[:, -1:]
                logits.append(out)
                tok = out.argmax(-1)
        return torch.cat(logits, 1)

    want = decode(model.forward)
    got = decode(compile_decode_step(model))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    cache = static_cache(model, 16)
    kv = kv_cache_kwargs(model, cache)
    with torch.no_grad():
        model(ids, use_cache=True, **kv)
        explain = torch._dynamo.explain(model.forward)(ids[:, :1], use_cache=True, **kv)
    assert explain.graph_break_count == 0, explain.break_reasons


def test_compile_config_compiles_on_the_cpu():
    cfg = compile_config()
    assert cfg._compile_all_devices is True
    assert cfg.mode == "default" and cfg.dynamic is False and cfg.fullgraph is True
    assert compiled_generate_kwargs(fullgraph=False)["compile_config"].fullgraph is False
    assert compiled_generate_kwargs()["cache_implementation"] == "static"


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "16"])
def test_static_cache_rejects_a_bad_length(bad):
    with pytest.raises(ValueError, match="max_cache_len must be a positive int"):
        static_cache(_tiny_llama(), bad)


def test_static_cache_and_compile_name_a_wrong_model():
    with pytest.raises(TypeError, match="transformers model"):
        static_cache(torch.nn.Linear(2, 2), 8)
    with pytest.raises(TypeError, match="must be an nn.Module"):
        compile_decode_step(lambda x: x)
