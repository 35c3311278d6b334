"""`sparsa prune` / `sparsa generate` on a causal LM: a tiny random Llama with an offline tokenizer."""

import json
import os
import re
import shutil

import pytest
import torch

from sparsa import cli

PROMPT = "the value of the object is"


def _tokenizer(sentences):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tk.normalizer = normalizers.Lowercase()
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator(
        sentences, trainers.WordLevelTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<pad>"])
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_input_names=["input_ids", "attention_mask"],
    )


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparsa.data.text import stdlib_sentences

    d = tmp_path_factory.mktemp("tiny_llama")
    tok = _tokenizer(stdlib_sentences()[:400])
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    LlamaForCausalLM(cfg).save_pretrained(str(d))
    tok.save_pretrained(str(d))
    return d


@pytest.fixture(autouse=True)
def _keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _block_linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("model.layers.")}


def _main(args, capsys):
    """(exit status, stdout, stderr) of `sparsa ARGS` run in this process."""
    try:
        rc = cli.main(args)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module", params=["magnitude", "wanda"])
def pruned(request, llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"pruned_{request.param}") / "out"
    from sparsa.prune import prune_model_dir

    prune_model_dir(
        str(llama_dir), str(out), method=request.param, sparsity=0.5, layout="masked", calib=16, progress=False
    )
    return request.param, out


def test_prune_causal_lm_writes_sparse_blocks_and_keeps_head(llama_dir, pruned):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from sparsa.prune import CHECKPOINT, load_pruned

    _, out = pruned
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", CHECKPOINT):
        assert (out / f).is_file(), f
    m = load_pruned(str(out))
    assert isinstance(m, LlamaForCausalLM)
    ref = AutoModelForCausalLM.from_pretrained(str(llama_dir))
    linears = _block_linears(m)
    assert len(linears) == 2 * 7
    for n, lin in linears.items():
        assert lin.weight.layout_name == "masked" and abs(lin.weight.sparsity - 0.5) < 1e-6, n
    assert type(m.lm_head.weight) is torch.nn.Parameter and torch.equal(m.lm_head.weight, ref.lm_head.weight)
    assert torch.equal(m.model.embed_tokens.weight, ref.model.embed_tokens.weight)


def _generates_as_dense_twin(llama_dir, out, exact_tokens=True):
    """The pruned model generates what the same weights do run dense. ``exact_tokens=False`` is for
    weights that training moved to wherever it stopped: there two logits may tie to within rounding,
    so the check is the logits along the dense twin's greedy continuation instead of the tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sparsa import to_dense
    from sparsa.prune import load_pruned

    m = load_pruned(str(out))
    dense = AutoModelForCausalLM.from_pretrained(str(llama_dir)).eval()
    with torch.no_grad():  # every parameter: recovery also trains norms and the LM head
        pruned = dict(m.named_parameters())
        for n, p in dense.named_parameters():
            p.copy_(to_dense(pruned[n]))
    ids = AutoTokenizer.from_pretrained(str(out))(PROMPT, return_tensors="pt")["input_ids"]
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        want = dense.generate(ids, **kw)
        got = m.generate(ids, **kw)
        if exact_tokens:
            assert torch.equal(got, want)
        else:
            assert got.shape == want.shape and torch.equal(got[:, : ids.shape[1]], ids)
            torch.testing.assert_close(m(want).logits, dense(want).logits, rtol=1e-4, atol=1e-4)
    return m


def test_loaded_pruned_model_generates_as_its_dense_twin(llama_dir, pruned):
    _generates_as_dense_twin(llama_dir, pruned[1])


def test_prune_with_the_default_layout(llama_dir, tmp_path, capsys):
    """bitmask where it is registered, else masked: either way generate matches the dense twin
    (logits along its greedy continuation: the trained weights may put two logits within rounding)."""
    from sparsa.prune import default_layout

    out = tmp_path / "out"
    rc, _, err = _main(["prune", str(llama_dir), "-o", str(out)], capsys)
    assert rc == 0, err
    m = _generates_as_dense_twin(llama_dir, out)
    assert {lin.weight.layout_name for lin in _block_linears(m).values()} == {default_layout("unstructured", True)}


def test_prune_with_recovery_keeps_the_pattern_and_trains(llama_dir, tmp_path, capsys):
    """--recover on a causal LM: the KL loss to the dense model is what trains, the pattern and the
    default layout stay exact, the embeddings stay as they were, and generate matches the dense twin
    (logits along its greedy continuation: the trained weights may put two logits within rounding)."""
    from transformers import AutoModelForCausalLM

    from sparsa import to_dense
    from sparsa.prune import default_layout

    out = tmp_path / "out"
    rc, so, err = _main(["prune", str(llama_dir), "-o", str(out), "--pattern", "2:4", "--recover", "5"], capsys)
    assert rc == 0, err
    steps = re.search(r"^recovered: (\d+) steps in \d+ s, loss ([\d.]+) -> ([\d.]+)$", so, re.M)
    assert steps and int(steps.group(1)) >= 2, so
    m = _generates_as_dense_twin(llama_dir, out, exact_tokens=False)
    for lin in _block_linears(m).values():
        assert lin.weight.layout_name == default_layout("2:4", True) and abs(lin.weight.sparsity - 0.5) < 1e-6
    ref = AutoModelForCausalLM.from_pretrained(str(llama_dir))
    assert torch.equal(m.model.embed_tokens.weight, ref.model.embed_tokens.weight)
    moved = [  # the kept weights trained away from their dense values
        n
        for n, lin in _block_linears(m).items()
        if not torch.equal(
            to_dense(lin.weight)[lin.weight.sparse_layout.mask()],
            ref.get_submodule(n).weight[lin.weight.sparse_layout.mask()],
        )
    ]
    assert len(moved) == len(_block_linears(m))


TIMING = re.compile(
    r"^prefill [\d.]+ ms \(\d+ prompt tokens\), decode [\d.]+ tokens/s .*threads, (float32|bfloat16)(, compiled)?$"
)


@pytest.mark.parametrize("which, dtype", [("dense", "float32"), ("pruned", "float32"), ("pruned", "bfloat16")])
def test_generate_prints_text_and_speed(llama_dir, pruned, capsys, which, dtype):
    if pruned[0] != "magnitude" and which == "dense":
        pytest.skip("the dense model needs one run only")
    d = llama_dir if which == "dense" else pruned[1]
    rc, out, err = _main(
        ["generate", str(d), "--prompt", PROMPT, "--max-new-tokens", "4", "--threads", "1", "--dtype", dtype], capsys
    )
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert lines[0].startswith(PROMPT) and len(lines[0]) > len(PROMPT)
    assert TIMING.match(lines[-1]), lines[-1]


def test_generate_compiled_prints_the_eager_text(llama_dir, pruned, capsys):
    if pruned[0] != "magnitude":
        pytest.skip("one pruned model is enough")
    args = ["generate", str(pruned[1]), "--prompt", PROMPT, "--max-new-tokens", "5", "--threads", "1"]
    rc, eager, err = _main(args, capsys)
    assert rc == 0, err
    try:
        rc, compiled, err = _main(args + ["--compile"], capsys)
    finally:
        torch._dynamo.reset()
    assert rc == 0, err
    assert compiled.splitlines()[0] == eager.splitlines()[0]
    assert compiled.strip().splitlines()[-1].endswith("threads, float32, compiled")
    assert TIMING.match(compiled.strip().splitlines()[-1])


def test_default_layout_is_bitmask_for_causal_lms_when_registered():
    from sparsa.layouts.base import registered_layouts
    from sparsa.prune import default_layout

    fast = "bitmask" in registered_layouts()
    assert default_layout("unstructured", True) == ("bitmask" if fast else "masked")
    assert default_layout("2:4", True) == ("bitmask" if fast else "nm")
    assert default_layout("row_group16", True) == "row_group"
    assert default_layout("unstructured", False) == "sliced_ell"


@pytest.mark.parametrize("exc, status", [(KeyboardInterrupt, 130), (RuntimeError, 1)])
def test_interrupted_prune_leaves_no_output(llama_dir, tmp_path, monkeypatch, capsys, exc, status):
    import sparsa.prune as prune

    def broken_save(model, path):
        path.write_bytes(b"half a checkpoint")
        raise exc("stop")

    monkeypatch.setattr(prune, "_save", broken_save)
    out = tmp_path / "new_parent" / "out"
    rc, _, err = _main(["prune", str(llama_dir), "-o", str(out), "--layout", "masked"], capsys)
    assert rc == status, err
    assert not out.exists() and not out.parent.exists() and list(tmp_path.iterdir()) == []
    # an existing OUT is left as it was
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text("{}")
    rc, _, _ = _main(["prune", str(llama_dir), "-o", str(old), "--layout", "masked"], capsys)
    assert rc == status
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]
    assert [p.name for p in old.iterdir()] == ["config.json"] and (old / "config.json").read_text() == "{}"


def test_prune_into_existing_out_replaces_its_files_keeps_others(llama_dir, tmp_path, capsys):
    from sparsa.prune import CHECKPOINT

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / CHECKPOINT).write_bytes(b"stale")
    rc, stdout, err = _main(["prune", str(llama_dir), "-o", str(out), "--layout", "masked"], capsys)
    assert rc == 0, err
    assert (out / "notes.txt").read_text() == "mine" and (out / CHECKPOINT).stat().st_size > 1000
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert "lm_head" in stdout and "model.layers.1.mlp.down_proj.weight" in stdout


def test_prune_with_data_file(llama_dir, tmp_path, capsys):
    from sparsa.data.text import stdlib_sentences
    from sparsa.prune import load_pruned

    data = tmp_path / "calib.txt"
    data.write_text("\n".join(stdlib_sentences()[400:424]))
    out = tmp_path / "out"
    rc, _, err = _main(
        [
            "prune",
            str(llama_dir),
            "-o",
            str(out),
            "--method",
            "wanda",
            "--pattern",
            "2:4",
            "--layout",
            "nm",
            "--data",
            str(data),
            "--calib",
            "8",
        ],
        capsys,
    )
    assert rc == 0, err
    w = load_pruned(str(out)).model.layers[0].mlp.up_proj.weight
    assert w.layout_name == "nm" and abs(w.sparsity - 0.5) < 1e-6


@pytest.fixture(scope="session")
def gpt2_dir(llama_dir, tmp_path_factory):
    """A causal LM without nn.Linear blocks (Conv1D) and a 16-token context."""
    from transformers import GPT2Config, GPT2LMHeadModel

    d = tmp_path_factory.mktemp("tiny_gpt2")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=32, n_layer=1, n_head=2, n_positions=16)).save_pretrained(str(d))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(llama_dir / f, d / f)
    return d


@pytest.fixture(scope="session")
def bert_like_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("not_causal")
    (d / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    return d


@pytest.mark.parametrize(
    "case, needle, status",
    [
        ("generate_not_causal", "MODEL_DIR", 2),
        ("generate_missing", "does not exist", 2),
        ("generate_zero_tokens", "--max-new-tokens", 2),
        ("generate_no_prompt", "--prompt", 2),
        ("generate_empty_prompt", "--prompt", 2),
        ("generate_too_long", "index out of range", 1),
        ("generate_too_long_compiled", "index out of range", 1),
        ("prune_layout_cannot_hold", "--layout 'nm' cannot store --pattern 'unstructured'", 2),
        ("prune_bad_pattern", "--pattern", 2),
        ("prune_data_with_magnitude", "--data", 2),
        ("prune_no_linear", "MODEL_DIR", 1),
    ],
)
def test_bad_inputs_give_one_line(llama_dir, gpt2_dir, bert_like_dir, tmp_path, capsys, case, needle, status):
    out = str(tmp_path / "out")
    args = {
        "generate_not_causal": ["generate", str(bert_like_dir), "--prompt", PROMPT],
        "generate_missing": ["generate", str(tmp_path / "nope"), "--prompt", PROMPT],
        "generate_zero_tokens": ["generate", str(llama_dir), "--prompt", PROMPT, "--max-new-tokens", "0"],
        "generate_no_prompt": ["generate", str(llama_dir)],
        "generate_empty_prompt": ["generate", str(llama_dir), "--prompt", "  "],
        "generate_too_long": ["generate", str(gpt2_dir), "--prompt", " ".join([PROMPT] * 4)],
        "generate_too_long_compiled": ["generate", str(gpt2_dir), "--prompt", " ".join([PROMPT] * 4), "--compile"],
        "prune_layout_cannot_hold": ["prune", str(llama_dir), "-o", out, "--layout", "nm"],
        "prune_bad_pattern": ["prune", str(llama_dir), "-o", out, "--pattern", "diagonal"],
        "prune_data_with_magnitude": ["prune", str(llama_dir), "-o", out, "--data", str(llama_dir)],
        "prune_no_linear": ["prune", str(gpt2_dir), "-o", out, "--layout", "masked"],
    }[case]
    rc, _, err = _main(args, capsys)
    assert rc == status, err
    assert err.count("\n") == 1 and re.match(r"sparsa( generate| prune)?: error: ", err) and needle in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_causal_lm_recovery_starts_at_the_target(llama_dir, tmp_path, monkeypatch):
    """The gradual start was measured on encoders only: a causal LM's one-shot pruning goes straight
    to the target however long the recovery."""
    import sparsa.prune_recovery as pr
    from sparsa.prune import prune_model_dir

    monkeypatch.setattr(pr, "GRADUAL_MIN_SECONDS", 0.0)
    real, seen = pr.recover_pruned, []

    def spy(model, *args, **kw):
        seen.append(min(lin.weight.sparsity for lin in _block_linears(model).values()))
        return real(model, *args, **kw)

    monkeypatch.setattr(pr, "recover_pruned", spy)
    prune_model_dir(str(llama_dir), str(tmp_path / "o"), sparsity=0.75, recover_seconds=1.0, progress=False)
    assert seen == [pytest.approx(0.75, abs=1e-3)]


@pytest.mark.parametrize("extra, tokens", [([], 1), (["--timing-tokens", "8"], 8)])
def test_only_if_faster_times_a_causal_lm_at_decode_width(llama_dir, tmp_path, monkeypatch, capsys, extra, tokens):
    # generation runs one token per step: a prompt-width timing would judge the decode kernels wrongly
    import sparsa.nn.linears as linears

    calls = []
    monkeypatch.setattr(linears, "linear_costs", lambda w, b, t: calls.append(t) or 3.0)
    out = tmp_path / "out"
    args = ["prune", str(llama_dir), "-o", str(out), "--sparsity", "0.5", "--calib", "16", "--only-if-faster"]
    rc, _, err = _main(args + extra, capsys)
    assert rc == 0, err
    assert calls and set(calls) == {tokens}
