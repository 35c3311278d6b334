"""General-English sentences written by a small pretrained language model, offline.

Distillation needs unlabeled text; the built-in text is Python documentation, so a student distilled
on it alone matches its teacher best on that domain. :func:`general_sentences` asks
SmolLM2-135M-Instruct (:func:`sparsa.models.causal_lm.load_smollm2`, installed by ``make
llm-model``) to write about everyday subjects (:data:`TOPICS`: nature, history, food, sport, ...;
deliberately no software, so no evaluation domain of this project is imitated) and keeps the
sentences that read as prose. Sampling is seeded, so the text is the same from run to run of one
environment; it is cached under ``~/.cache/sparsa/text`` (``SPARSA_TEXT_DIR`` moves it) because
writing takes minutes (about 3.5 sentences a second on 2 cores).

The writer is a function ``prompts -> texts``; tests pass their own::

    >>> from sparsa.data.generated import general_sentences
    >>> def writer(prompts):
    ...     return [f"A short sentence about {p.split(' about ')[-1].rstrip('.')} is written here." for p in prompts]
    >>> len(general_sentences(3, writer=writer, cache=False))
    3
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Callable, List, Optional

from .text import _prose_sentences

__all__ = ["TOPICS", "PROMPTS", "general_sentences", "smollm2_writer", "text_cache_dir"]

#: everyday subjects the model writes about (no software: README prose stays a held-out domain)
TOPICS = tuple(
    " ".join(t.split())
    for t in """
    the ocean tides; a mountain village in winter; how bread is baked; the history of the bicycle; bees and
    pollination; a rainy afternoon in a city; the rules of chess; volcanoes; learning to swim; the moon landing;
    coffee farming; a summer festival; migrating birds; the water cycle; ancient Rome; a train journey; gardening
    in spring; the human heart; deserts at night; a local library; football; jazz music; the printing press;
    recycling; forests and fungi; a family dinner; the northern lights; healthy sleep; the invention of the
    telephone; whales; a busy market; photography; the seasons; an old lighthouse; renewable energy; the Olympic
    games; painting with watercolours; a school trip; earthquakes; the silk road; caring for a dog; the stars and
    planets; a bakery at dawn; rivers and bridges; the French revolution; running a marathon; tea ceremonies; the
    weather forecast; a museum visit; honey; the Great Wall of China; climate and crops; a thunderstorm; writing
    letters; the history of money; cats; islands; a hospital nurse's day; the Amazon rainforest; making pottery;
    public transport; the piano; glaciers; a wedding; vaccines; the Renaissance; a fishing boat; bird songs; a
    quiet morning; the human brain; castles; the desert camel; a farmer's year; hiking; snow; the ancient
    Egyptians; a bus driver; lakes; theatre; the alphabet; friendship; a kitchen garden; wind; the solar system;
    knitting; a post office; tigers; dinosaurs; a flood; orchestras; cycling in the countryside; a birthday party;
    the invention of paper; the Arctic; soup; traffic; a village school; apples; the internet's effect on
    shopping; elections; a mountain rescue; penguins; salt; a carpenter; democracy in ancient Athens; storms at
    sea; vegetables; a city park; the history of clocks; fire; rain forests; a ballet performance; the Vikings;
    grandparents; mushrooms; the ocean floor; a ferry; lightning; pirates; chocolate; the immune system; a
    marathon runner; bamboo; wolves; the Industrial Revolution; a book club; sunflowers; fossils; a harbour town;
    the Silk Road traders; bridges; sculpture; horses; a night sky; the Mediterranean diet; a football match; rice
    farming; the printing of newspapers; coral reefs; a zoo; tornadoes; a long walk; windmills; the history of
    medicine; elephants; a snowy forest; cheese making; the Moon; the Himalayas; a jazz club; railways; spices; a
    teacher; volunteering; an airport; butterflies; the Nile; wildfires; a hot air balloon; sailing; owls; a river
    delta; a violin maker; public parks; caves
    """.split(";")
    if t.strip()
)

#: the requests, each filled with one topic
PROMPTS = (
    "Write a short paragraph about {}.",
    "Describe {} in a few sentences.",
    "Tell a short story involving {}.",
    "Explain {} to a curious child.",
    "Write a few sentences of a news report about {}.",
    "What do people like about {}? Answer in a paragraph.",
)

Writer = Callable[[List[str]], List[str]]
_BATCH = 64
_MAX_NEW_TOKENS = 96
_TEMPERATURE, _TOP_P = 0.9, 0.95


def text_cache_dir() -> Path:
    """``$SPARSA_TEXT_DIR`` if set, else ``~/.cache/sparsa/text`` (``$XDG_CACHE_HOME`` respected)."""
    d = os.environ.get("SPARSA_TEXT_DIR")
    return Path(d) if d else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sparsa" / "text"


def smollm2_writer(seed: int = 0, max_new_tokens: int = _MAX_NEW_TOKENS) -> Writer:
    """A writer backed by SmolLM2-135M-Instruct: each prompt in its chat template, sampled at
    temperature 0.9, top-p 0.95. It reseeds torch's global generator with ``seed`` (``generate()``
    samples from it), so the text is reproducible. Raises ``FileNotFoundError`` naming ``make
    llm-model`` when the weights are not installed."""
    import torch

    from ..models.causal_lm import load_smollm2

    torch.manual_seed(seed)  # generate() samples from the global generator
    model, tok = load_smollm2()
    tok.padding_side = "left"  # generation continues every row from its last real token
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    def write(prompts: List[str]) -> List[str]:
        chats = [
            tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts
        ]
        enc = tok(chats, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=True,
                temperature=_TEMPERATURE,
                top_p=_TOP_P,
                pad_token_id=tok.pad_token_id,
            )
        return tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)

    return write


def _prompts(rng: random.Random, k: int) -> List[str]:
    return [rng.choice(PROMPTS).format(rng.choice(TOPICS)) for _ in range(k)]


def _cache_path(seed: int, batch: int) -> Path:
    # the cache is keyed by what decides the text: the model's source, the prompts, the batching
    # (padding changes what is sampled) and the sampling
    key = json.dumps(
        {
            "model": "smollm2-135m-instruct",
            "topics": TOPICS,
            "prompts": PROMPTS,
            "seed": seed,
            "batch": batch,
            "max_new_tokens": _MAX_NEW_TOKENS,
            "sampling": [_TEMPERATURE, _TOP_P],
        },
        sort_keys=True,
    )
    return text_cache_dir() / f"general-{hashlib.sha256(key.encode()).hexdigest()[:16]}.txt"


def general_sentences(
    n: int,
    seed: int = 0,
    *,
    writer: Optional[Writer] = None,
    cache: bool = True,
    batch: int = _BATCH,
    max_batches: Optional[int] = None,
    progress: bool = False,
) -> List[str]:
    """``n`` distinct sentences of general English (40-200 characters, capitalised, full stop last).

    With ``writer=None`` SmolLM2 writes them (``make llm-model``) and, with ``cache``, the result is
    kept on disk: a later call with the same ``seed`` and ``n`` or fewer reads the first ``n``. Each
    batch writes ``batch`` prompts drawn from a generator seeded with ``seed``; ``max_batches``
    (default: enough for five times ``n`` prompts) bounds the work, after which a writer that
    produced too little prose is an error."""
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"n must be a positive number of sentences, got {n!r}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
        raise ValueError(f"batch must be a positive number of prompts, got {batch!r}")
    path = _cache_path(seed, batch) if cache and writer is None else None
    if path is not None and path.is_file():
        have = path.read_text(encoding="utf-8").splitlines()
        if len(have) >= n:
            return have[:n]
    write = writer if writer is not None else smollm2_writer(seed)
    rng = random.Random(seed)
    limit = max_batches if max_batches is not None else max(1, -(-5 * n // batch))
    out: List[str] = []
    seen: set = set()
    for i in range(limit):
        texts = write(_prompts(rng, batch))
        for s in _prose_sentences(texts, 40, 200, seen, full_stop=True):
            seen.add(s)
            out.append(s)
        if progress:
            print(f"general_sentences: batch {i + 1}: {len(out)} of {n} sentences", flush=True)
        if len(out) >= n:
            break
    if len(out) < n:
        raise ValueError(
            f"the writer produced {len(out)} usable sentences in {limit} batches of {batch} prompts, fewer "
            f"than the {n} asked for; ask for fewer or allow more batches (max_batches)"
        )
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("\n".join(out) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    return out[:n]
