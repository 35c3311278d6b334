"""sparsa.recover: gradual pruning + distillation ends in exactly the pattern at the target, for every
pattern and layout; it beats one-shot pruning on a toy; bad arguments are named."""

import copy

import pytest
import torch
import torch.nn as nn

import sparsa
from sparsa.methods import distillation_loss
from sparsa.methods.recover import pattern_sparsifier
from sparsa.sparsifiers import Magnitude


def _mlp(seed=0, d=64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))


def _batches(n=4, d=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, d, generator=g) for _ in range(n)]


LINEARS = ["0", "2", "4"]

CASES = [  # pattern, layout, target, expected layout name
    ("unstructured", None, 0.875, "masked"),
    ("unstructured", "sliced_ell", 0.75, "sliced_ell"),
    ("2:4", None, 0.5, "nm"),
    ("4:8", None, 0.5, "nm"),
    ("2:4", "grouped_nm", 0.5, "grouped_nm"),
    ("grouped_2:4", None, 0.5, "grouped_nm"),
    ("row_group4", None, 0.75, "row_group"),
    ("row_group8", None, 0.75, "row_group"),
    ("row_group16", None, 0.75, "row_group"),
]


def _check_pattern(w, pattern, target):
    dense, mask = sparsa.to_dense(w), w.sparse_layout.mask()
    rows, cols = mask.shape
    assert w.nnz == int(mask.sum())
    assert bool((dense[~mask] == 0).all())
    if pattern == "unstructured":
        assert mask.sum(1).tolist() == [cols - round(target * cols)] * rows
    elif pattern in ("2:4", "4:8") and w.layout_name == "nm":
        n, m = (int(v) for v in pattern.split(":"))
        assert mask.reshape(rows, cols // m, m).sum(-1).eq(n).all()
    elif "2:4" in pattern:  # grouped 2:4: in every block of 4 rows each column keeps 2
        assert mask.reshape(rows // 4, 4, cols).sum(1).eq(2).all()
    else:  # row groups: consecutive rows share their columns
        g = int(pattern[len("row_group") :])
        grouped = mask.reshape(rows // g, g, cols)
        assert grouped.eq(grouped[:, :1]).all()
        assert mask.sum(1).tolist() == [cols - round(target * cols)] * rows
    if w.layout_name != "grouped_nm":  # the pattern's own sparsifier picks exactly the stored pattern
        sp, _ = pattern_sparsifier(pattern, target)
        assert torch.equal(sp.mask(dense), mask)


@pytest.mark.parametrize("pattern,layout,target,layout_name", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_every_pattern_ends_exact(pattern, layout, target, layout_name):
    teacher = _mlp()
    model = copy.deepcopy(teacher)
    rep = sparsa.recover(
        model, teacher, _batches(), target_sparsity=target, pattern=pattern, layout=layout, steps=10, progress=False
    )
    assert rep.steps == 10 and rep.final_step == 7 and len(rep.losses) == 10
    assert rep.layout == layout_name and sorted(rep.sparsity) == LINEARS
    for n in LINEARS:
        w = model.get_submodule(n).weight
        assert isinstance(w, sparsa.SparseTensor) and w.layout_name == layout_name
        assert w.sparsity == pytest.approx(target) and rep.sparsity[n] == pytest.approx(target)
        _check_pattern(w, pattern, target)
    assert rep.overall_sparsity == pytest.approx(target)
    assert model(_batches(1)[0]).shape == (16, 32)
    # the teacher is untouched
    for (a, pa), (b, pb) in zip(teacher.named_parameters(), _mlp().named_parameters()):
        assert torch.equal(pa, pb), a


@pytest.mark.parametrize("init", ["magnitude", "wanda", "sparsegpt"])
@pytest.mark.parametrize("pattern,target", [("unstructured", 0.75), ("2:4", 0.5), ("row_group8", 0.75)])
def test_one_shot_start(init, pattern, target):
    teacher = _mlp()
    model = copy.deepcopy(teacher)
    rep = sparsa.recover(
        model, teacher, _batches(), target_sparsity=target, pattern=pattern, init=init, steps=6, progress=False
    )
    assert rep.init == init
    for n in LINEARS:
        _check_pattern(model.get_submodule(n).weight, pattern, target)


def _held_out_loss(model, teacher, xs):
    with torch.no_grad():
        return sum(distillation_loss(model(x), teacher(x)).item() for x in xs) / len(xs)


def test_recovery_beats_one_shot_and_fine_tuning_lowers_the_loss():
    teacher = _mlp(seed=3)
    train, held_out = _batches(8, seed=4), _batches(4, seed=5)
    one_shot = sparsa.sparsify(
        copy.deepcopy(teacher), sparsa.Rule(sparsifier=Magnitude(0.9, per="row"), module_types=nn.Linear)
    )
    model = copy.deepcopy(teacher)
    rep = sparsa.recover(model, teacher, train, target_sparsity=0.9, steps=200, lr=3e-3, progress=False)
    assert rep.overall_sparsity == pytest.approx(0.9, abs=0.01)
    recovered, pruned = _held_out_loss(model, teacher, held_out), _held_out_loss(one_shot, teacher, held_out)
    assert recovered < 0.5 * pruned, (recovered, pruned)
    # at the final pattern the loss falls while it fine-tunes
    after_prune = sum(rep.losses[rep.final_step : rep.final_step + 8]) / 8
    assert sum(rep.losses[-8:]) / 8 < after_prune


@pytest.mark.parametrize("pattern,layout", [("unstructured", None), ("unstructured", "sliced_ell"), ("2:4", None)])
def test_recovery_under_bf16_autocast(pattern, layout):
    # mixed precision: the student runs under autocast, its weights and optimizer stay fp32
    teacher = _mlp(seed=3)
    train, held_out = _batches(8, seed=4), _batches(4, seed=5)
    one_shot = sparsa.sparsify(
        copy.deepcopy(teacher), sparsa.Rule(sparsifier=pattern_sparsifier(pattern, 0.5)[0], module_types=nn.Linear)
    )
    model = copy.deepcopy(teacher)
    seen = []
    model[2].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    rep = sparsa.recover(
        model,
        teacher,
        train,
        target_sparsity=0.5,
        pattern=pattern,
        layout=layout,
        steps=60,
        lr=3e-3,
        progress=False,
        autocast=torch.bfloat16,
    )
    assert seen and set(seen) == {torch.bfloat16}
    for n in LINEARS:
        w = model.get_submodule(n).weight
        assert w.dtype == torch.float32
        _check_pattern(w, pattern, 0.5)
    assert _held_out_loss(model, teacher, held_out) < _held_out_loss(one_shot, teacher, held_out)
    assert rep.steps == 60


def test_time_budget_progress_and_checkpoint(tmp_path, capsys):
    teacher = _mlp()
    model = copy.deepcopy(teacher)
    path = tmp_path / "m.safetensors"
    rep = sparsa.recover(
        model, teacher, _batches(), target_sparsity=0.75, time_budget=0.3, checkpoint=path, progress=True
    )
    assert rep.steps >= 1 and rep.checkpoint == str(path) and path.exists()
    for n in LINEARS:
        _check_pattern(model.get_submodule(n).weight, "unstructured", 0.75)
    fresh = sparsa.load(_mlp(seed=9), str(path))
    x = _batches(1)[0]
    with torch.no_grad():
        assert torch.allclose(fresh(x), model(x), atol=1e-6)
    assert fresh[0].weight.layout_name == "masked"


def test_the_time_budget_is_not_overrun_by_the_last_step():
    """Steps of ~0.25 s in a 1 s budget: a fourth step would end past it, so three run."""
    import time

    teacher = _mlp()
    model = copy.deepcopy(teacher)

    def slow_forward(m, b):
        if m is model:
            time.sleep(0.25)
        return m(b)

    t0 = time.perf_counter()
    rep = sparsa.recover(
        model,
        teacher,
        _batches(),
        target_sparsity=0.5,
        init="magnitude",
        time_budget=1.0,
        forward=slow_forward,
        progress=False,
    )
    assert time.perf_counter() - t0 < 1.0 and 1 <= rep.steps <= 3


def test_continues_from_a_pruned_model_and_per_layer_allocation():
    teacher = _mlp()
    model = sparsa.sparsify(
        copy.deepcopy(teacher),
        sparsa.Rule(sparsifier=Magnitude(0.5, per="row"), layout="masked", module_types=nn.Linear),
    )
    alloc = {"0": 0.5, "2": 0.875, "4": 0.75}
    rep = sparsa.recover(
        model, teacher, _batches(), target_sparsity=0.75, allocation=alloc, names=LINEARS, steps=8, progress=False
    )
    assert rep.targets == alloc
    for n, s in alloc.items():
        assert rep.sparsity[n] == pytest.approx(s)
        _check_pattern(model.get_submodule(n).weight, "unstructured", s)


def test_owl_allocation_keeps_the_overall_target():
    teacher = _mlp()
    with torch.no_grad():
        teacher[2].weight[:, :3] *= 30.0  # outliers in layer "2": OWL keeps more of it
    model = copy.deepcopy(teacher)
    rep = sparsa.recover(model, teacher, _batches(), target_sparsity=0.7, allocation="owl", steps=6, progress=False)
    sizes = {n: model.get_submodule(n).weight.numel() for n in LINEARS}
    mean_target = sum(sizes[n] * rep.targets[n] for n in LINEARS) / sum(sizes.values())
    assert mean_target == pytest.approx(0.7, abs=1e-9)
    assert rep.overall_sparsity == pytest.approx(0.7, abs=0.01)  # per-row rounding only
    assert rep.targets["2"] < 0.7 - 0.05 and rep.targets["0"] > 0.7 and rep.targets["4"] > 0.7


def test_tiny_bert_with_dict_batches():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    teacher = transformers.BertModel(cfg).eval()
    model = copy.deepcopy(teacher)
    g = torch.Generator().manual_seed(0)
    batches = [
        {
            "input_ids": torch.randint(0, 100, (4, 12), generator=g),
            "attention_mask": torch.ones(4, 12, dtype=torch.long),
        }
        for _ in range(3)
    ]
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layer." in n]
    rep = sparsa.recover(
        model,
        teacher,
        batches,
        target_sparsity=0.5,
        pattern="2:4",
        names=names,
        steps=4,
        init="sparsegpt",
        progress=False,
    )
    assert sorted(rep.sparsity) == sorted(names)
    for n in names:
        _check_pattern(model.get_submodule(n).weight, "2:4", 0.5)
    assert not isinstance(model.pooler.dense.weight, sparsa.SparseTensor)
    with torch.no_grad():
        assert model(**batches[0]).last_hidden_state.shape == (4, 12, 32)


def test_the_teachers_outputs_are_cached_when_batches_cycle():
    """4 batches over 12 steps: the teacher runs 4 times with the cache and 12 without, and the
    losses are the same (the teacher is fixed); a cache smaller than one output keeps nothing."""
    teacher = _mlp()
    runs = []

    def run(cache_bytes):
        calls = [0]

        def counting_forward(m, b):
            if m is teacher:
                calls[0] += 1
            return m(b)

        torch.manual_seed(0)
        rep = sparsa.recover(
            copy.deepcopy(teacher),
            teacher,
            _batches(4),
            target_sparsity=0.5,
            steps=12,
            forward=counting_forward,
            progress=False,
            teacher_cache_bytes=cache_bytes,
        )
        runs.append(rep.losses)
        return calls[0]

    assert run(1 << 20) == 4
    assert run(0) == 12
    assert run(16 * 32 * 4 - 1) == 12  # one batch's output is 16 x 32 floats
    assert runs[0] == runs[1] == runs[2]


def test_the_students_dropout_is_off_while_it_distils_and_restored_after():
    teacher = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5), nn.Linear(64, 32))
    seen = []

    def forward(m, b):
        seen.append((m is teacher, m[1].p, m.training))
        return m(b)

    for dropout, p in ((0.0, 0.0), (None, 0.5), (0.25, 0.25)):
        seen.clear()
        model = copy.deepcopy(teacher)
        sparsa.recover(
            model, teacher, _batches(2), target_sparsity=0.5, steps=3, forward=forward, dropout=dropout, progress=False
        )
        assert {(p_, tr) for is_t, p_, tr in seen if not is_t} == {(p, True)}
        assert model[1].p == 0.5 and teacher[1].p == 0.5


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(target_sparsity=1.0), "target_sparsity"),
        (dict(target_sparsity=-0.1), "target_sparsity"),
        (dict(target_sparsity=0.5, pattern="diagonal"), "pattern"),
        (dict(target_sparsity=0.5, time_budget=0), "time_budget"),
        (dict(target_sparsity=0.5, time_budget=-3.0), "time_budget"),
        (dict(target_sparsity=0.7, pattern="2:4"), "target_sparsity"),
        (dict(target_sparsity=0.5, init="obs"), "init"),
        (dict(target_sparsity=0.5, names=["1"]), "names"),
        (dict(target_sparsity=0.5, allocation="erk"), "allocation"),
        (dict(target_sparsity=0.5, allocation={"0": 0.5}), "allocation"),
        (dict(target_sparsity=0.5, pattern="2:4", allocation="owl"), "allocation"),
        (dict(target_sparsity=0.5, layout="nm"), "layout"),
        (dict(target_sparsity=0.5, lr=0.0), "lr"),
        (dict(target_sparsity=0.5, steps=0), "steps"),
        (dict(target_sparsity=0.5, teacher_cache_bytes=-1), "teacher_cache_bytes"),
        (dict(target_sparsity=0.5, dropout=1.0), "dropout"),
        (dict(target_sparsity=0.5, prune_by="movement"), "prune_by"),
        (dict(target_sparsity=0.5, autocast=torch.float32), "autocast"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    teacher = _mlp()
    with pytest.raises(ValueError, match=match):
        sparsa.recover(copy.deepcopy(teacher), teacher, _batches(1), progress=False, **kwargs)


@pytest.mark.parametrize("prune_by,col0_kept", [("magnitude", False), ("wanda", True)])
def test_prune_by_wanda_ranks_by_weight_times_input_norm(prune_by, col0_kept):
    # column 0 has the smallest weights but an input 100x larger than the others
    teacher = nn.Linear(4, 3, bias=False)
    with torch.no_grad():
        teacher.weight.copy_(torch.tensor([[0.1, 1.0, 1.1, 1.2]] * 3))
    g = torch.Generator().manual_seed(0)
    # random signs, fixed sizes: the input norms are exactly [100, 1, 1, 1]
    signs = [torch.randint(0, 2, (8, 4), generator=g) * 2.0 - 1.0 for _ in range(4)]
    batches = [s * torch.tensor([100.0, 1.0, 1.0, 1.0]) for s in signs]
    model = copy.deepcopy(teacher)
    sparsa.recover(
        model,
        teacher,
        batches,
        target_sparsity=0.25,
        steps=20,
        prune_by=prune_by,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.0),  # the weights stay put: only ranking
        progress=False,
    )
    mask = model.weight.sparse_layout.mask()
    assert mask.sum(1).tolist() == [3, 3, 3]
    assert mask[:, 0].all() == col0_kept
    if col0_kept:
        assert not mask[:, 1].any()  # the smallest |W| * ||X|| left
    assert not model._forward_pre_hooks  # the norm collectors are gone


def test_teacher_and_data_errors():
    model = _mlp()
    with pytest.raises(ValueError, match="teacher is the same object"):
        sparsa.recover(model, model, _batches(1), target_sparsity=0.5)
    shallow = nn.Sequential(*model)  # shares the parameters
    with pytest.raises(ValueError, match="teacher shares"):
        sparsa.recover(model, shallow, _batches(1), target_sparsity=0.5)
    with pytest.raises(ValueError, match="batches is empty"):
        sparsa.recover(model, copy.deepcopy(model), [], target_sparsity=0.5)
    assert not isinstance(model[0].weight, sparsa.SparseTensor)  # nothing was changed by a failed call


def test_progress_without_tqdm_prints_lines(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # as if tqdm were not installed
    teacher = _mlp()
    sparsa.recover(copy.deepcopy(teacher), teacher, _batches(), target_sparsity=0.5, steps=10, progress=True)
    err = capsys.readouterr().err
    assert "recover: 10/10 step" in err and "sparsity 0.500" in err
    sparsa.recover(copy.deepcopy(teacher), teacher, _batches(), target_sparsity=0.5, steps=4, progress=False)
    assert capsys.readouterr().err == ""


def test_a_pruned_causal_lm_recovers_towards_the_dense_one_with_the_logit_loss():
    from sparsa.methods import logit_distillation_loss
    from sparsa.models.causal_lm import tiny_llama

    # at the default init a random model predicts near-uniform tokens, and pruning changes almost nothing
    teacher = tiny_llama(layers=2, hidden=64, vocab=128, seed=0, initializer_range=0.2)
    names = [n for n, m in teacher.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]
    model = sparsa.sparsify(
        copy.deepcopy(teacher),
        [sparsa.Rule(sparsifier=Magnitude(0.5, per="row"), layout="masked", names=names)],
    )
    masks = {n: model.get_submodule(n).weight.sparse_layout.mask().clone() for n in names}
    g = torch.Generator().manual_seed(3)
    train = [torch.randint(0, 128, (4, 32), generator=g) for _ in range(8)]
    held_out = torch.randint(0, 128, (8, 32), generator=g)

    def logits(m, b):
        return m(input_ids=b, use_cache=False).logits

    def kl(m):
        with torch.no_grad():
            return float(logit_distillation_loss(logits(m, held_out), logits(teacher, held_out)))

    before = kl(model)
    rep = sparsa.recover(
        model,
        teacher,
        train,
        target_sparsity=0.5,
        names=names,
        forward=logits,
        loss=logit_distillation_loss,
        lr=3e-3,
        steps=60,
        progress=False,
    )
    assert rep.losses[-1] < rep.losses[0]
    assert kl(model) < 0.85 * before  # held-out tokens: the student moved towards the teacher
    for n in names:  # already at the target: the pruned positions stay pruned
        assert torch.equal(model.get_submodule(n).weight.sparse_layout.mask(), masks[n])
