"""Block-by-block calibration for transformers: prune one block at a time on the inputs that the
already-pruned blocks before it produce.

Calibrating layer ``i`` of a decoder on the outputs of the pruned layers before it by re-running
the whole model from the start costs ``O(blocks^2)`` forwards. Here the inputs of the first block
(its hidden states and the keyword arguments the model passes it: attention mask, rotary position
embeddings, ...) are captured once by a pre-hook that ends the forward there; then, block by block,
the statistics its ``nn.Linear`` layers need are collected by running only that block on the stored
inputs, the layers are pruned, and the pruned block's outputs replace the stored inputs for the next
block. Only one block's inputs are kept (one hidden-state tensor per calibration batch), and the
key/value cache is switched off in the stored arguments.

Blocks are found by :func:`find_blocks`: the longest ``nn.ModuleList`` of modules of one class that
contain ``nn.Linear`` layers (``model.model.layers`` of Llama, Mistral, Qwen2; ``encoder.layer`` of
BERT), or passed as ``blocks=``. Block-by-block runs only when the model really chains them: on the
first batch every block must get the previous block's output and the very same keyword arguments as
the first one (models whose layers get different masks, such as alternating sliding-window
attention, do not qualify). :func:`~sparsa.methods.sparsegpt` and :func:`~sparsa.methods.wanda`
use this path by default when it applies.

>>> import torch, torch.nn as nn
>>> class Block(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
...     def forward(self, x):
...         return x + self.fc2(torch.relu(self.fc1(x)))
>>> class Net(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.layers = nn.ModuleList(Block() for _ in range(3))
...     def forward(self, x):
...         for b in self.layers:
...             x = b(x)
...         return x
>>> model = Net()
>>> find_blocks(model)[0]
'layers'
>>> from sparsa.sparsifiers import Magnitude
>>> def prune(block, names, items, run):   # magnitude pruning: no statistics needed
...     for n in names:
...         block.get_submodule(n).weight.data.mul_(Magnitude(0.5).mask(block.get_submodule(n).weight))
>>> report = blockwise_prune(model, [torch.randn(4, 8), torch.randn(2, 8)], prune)
>>> report.blocks, report.stored_tensors
(3, 2)
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .calibration import Forward, _linears, forward_groups

__all__ = ["find_blocks", "BlockwiseReport", "blockwise_prune"]

#: keyword arguments that carry a key/value cache; replaced by None so blocks can be re-run
_CACHE_KWARGS = ("cache", "past_key_value", "past_key_values", "layer_past")

#: ``prune(block, names, items, run)``: prune the layers ``names`` (relative to ``block``) in place;
#: ``run(block, item)`` runs the block on one stored input, for every ``item`` in ``items``
PruneGroup = Callable[[nn.Module, List[str], List[int], Forward], None]


class _Stop(Exception):
    """Ends the model's forward once the first block's inputs are captured."""


@dataclass
class BlockwiseReport:
    """What a :func:`blockwise_prune` run did.

    ``stored_tensors``: hidden-state tensors held at once (one per calibration batch);
    ``peak_stored_bytes``: the most bytes of stored hidden states at any time (one block's inputs plus
    one batch's output while it replaces its input); ``block_calls``: forwards of single blocks.
    """

    blocks: int
    block_calls: int
    stored_tensors: int
    peak_stored_bytes: int


def _is_block_list(mod: nn.Module) -> bool:
    return (
        isinstance(mod, nn.ModuleList)
        and len(mod) > 0
        and len({type(b) for b in mod}) == 1
        and not isinstance(mod[0], nn.Linear)
        and all(any(isinstance(m, nn.Linear) for m in b.modules()) for b in mod)
    )


def find_blocks(
    model: nn.Module, blocks: Union[None, str, nn.ModuleList] = None
) -> Optional[Tuple[str, nn.ModuleList]]:
    """``(name, module_list)`` of the model's transformer blocks, or None when it has none.

    Without ``blocks``: the longest ``nn.ModuleList`` whose members share one class and contain
    ``nn.Linear`` layers (the first one on a tie). ``blocks`` names it instead: a dotted submodule
    name or the ``nn.ModuleList`` itself.
    """
    if blocks is None:
        best = None
        for name, mod in model.named_modules():
            if _is_block_list(mod) and (best is None or len(mod) > len(best[1])):
                best = (name, mod)
        return best
    if isinstance(blocks, str):
        try:
            mod = model.get_submodule(blocks)
        except AttributeError:
            raise ValueError(
                f"blocks={blocks!r} is not a submodule of the model; pass the dotted name of its "
                "nn.ModuleList of transformer blocks, e.g. 'model.layers'"
            ) from None
        name = blocks
    else:
        name = next((n for n, m in model.named_modules() if m is blocks), None)
        if name is None:
            raise ValueError(
                f"blocks: the {type(blocks).__name__} passed is not part of the model; pass the model's "
                "own nn.ModuleList of transformer blocks (e.g. model.model.layers) or its name"
            )
        mod = blocks
    if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
        raise ValueError(
            f"blocks={name!r} must be a non-empty nn.ModuleList of transformer blocks, got {type(mod).__name__}"
        )
    return name, mod


def _split_names(
    model: nn.Module, prefix: str, blocks: nn.ModuleList, names: Optional[Sequence[str]]
) -> Tuple[List[Optional[List[str]]], List[str]]:
    """Per block, the wanted Linear names relative to it (None: all of them), and the names outside."""
    if names is None:
        return [None] * len(blocks), []
    _linears(model, names)  # every name must be an nn.Linear of the model
    per: List[Optional[List[str]]] = [[] for _ in blocks]
    outside = []
    head = f"{prefix}." if prefix else ""
    for n in names:
        idx, _, rel = n[len(head) :].partition(".") if n.startswith(head) else ("", "", "")
        if idx.isdigit() and int(idx) < len(blocks) and rel:
            per[int(idx)].append(rel)
        else:
            outside.append(n)
    return per, outside


def _hidden(args: tuple, kwargs: Dict[str, Any]) -> Optional[Tensor]:
    h = args[0] if args else kwargs.get("hidden_states")
    return h if isinstance(h, Tensor) else None


def _first(out: Any) -> Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # e.g. tuples of tensors that are not the same objects
        return False


class _Inputs:
    """The current block's inputs, one ``(args, kwargs)`` per batch; hidden states replaced in place."""

    def __init__(self) -> None:
        self.items: List[Tuple[tuple, Dict[str, Any]]] = []
        self.bytes = self.peak_bytes = self.calls = 0

    def add(self, args: tuple, kwargs: Dict[str, Any]) -> None:
        kwargs = dict(kwargs)
        for k in _CACHE_KWARGS:
            if k in kwargs:
                kwargs[k] = None
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
        self.items.append((tuple(args), kwargs))
        self._count(_hidden(args, kwargs), None)

    def _count(self, new: Tensor, old: Optional[Tensor]) -> None:
        self.bytes += new.numel() * new.element_size()
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        if old is not None:
            self.bytes -= old.numel() * old.element_size()

    def run(self, block: nn.Module, i: int) -> Any:
        args, kwargs = self.items[i]
        self.calls += 1
        return block(*args, **kwargs)

    def advance(self, block: nn.Module) -> None:
        """Replace every stored input by the block's output on it."""
        for i, (args, kwargs) in enumerate(self.items):
            out = _first(self.run(block, i)).detach()
            old = _hidden(args, kwargs)
            if args:
                args = (out,) + args[1:]
            else:
                kwargs = dict(kwargs, hidden_states=out)
            self.items[i] = (args, kwargs)
            self._count(out, old)


def _capture(
    model: nn.Module, blocks: nn.ModuleList, batches: Sequence[Any], forward: Optional[Forward]
) -> Tuple[_Inputs, Optional[str]]:
    """The first block's inputs for every batch, and why the model does not chain its blocks (None
    when it does; checked on the whole forward of the first batch)."""
    store = _Inputs()
    first0: Dict[str, Any] = {}
    state: Dict[str, Any] = {"next": 0, "prev": None, "problem": None, "check": True}

    def pre(i: int, mod: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> None:
        h = _hidden(args, kwargs)
        if i == 0:
            if h is None:
                state["problem"] = (
                    f"the first block ({type(mod).__name__}) gets no hidden-state tensor as first "
                    "argument or hidden_states="
                )
                raise _Stop
            store.add(args, kwargs)
            if not state["check"]:
                raise _Stop
            first0.update(args=args, kwargs=kwargs)
        elif (
            i != state["next"]
            or h is not state["prev"]
            or len(args) != len(first0["args"])
            or any(not _same(a, b) for a, b in zip(args[1:], first0["args"][1:]))
            or set(kwargs) != set(first0["kwargs"])
            or any(k != "hidden_states" and not _same(v, first0["kwargs"][k]) for k, v in kwargs.items())
        ):
            state["problem"] = state["problem"] or (
                f"block {i} does not get the previous block's output and the same other arguments as the first block"
            )
        state["next"] = i + 1

    def post(mod: nn.Module, args: tuple, out: Any) -> None:
        state["prev"] = _first(out)

    with contextlib.ExitStack() as hooks, torch.no_grad():
        for i, b in enumerate(blocks):
            hooks.enter_context(b.register_forward_pre_hook(lambda m, a, k, i=i: pre(i, m, a, k), with_kwargs=True))
            hooks.enter_context(b.register_forward_hook(post))
        for j, batch in enumerate(batches):
            state["check"] = j == 0
            with contextlib.suppress(_Stop):
                forward(model, batch) if forward else model(batch)
            if state["problem"] is None and j == 0 and state["next"] != len(blocks):
                state["problem"] = f"the forward called {state['next']} of the {len(blocks)} blocks in order"
            if state["problem"] is None and len(store.items) != j + 1:
                state["problem"] = f"the forward of calibration batch {j} did not call the first block"
            if state["problem"] is not None:
                break
    return store, state["problem"]


def blockwise_prune(
    model: nn.Module,
    batches: Sequence[Any],
    prune: PruneGroup,
    names: Optional[Sequence[str]] = None,
    forward: Optional[Forward] = None,
    blocks: Union[None, str, nn.ModuleList] = None,
    sequential: bool = True,
    progress: bool = False,
    desc: str = "blocks",
    strict: bool = True,
) -> Optional[BlockwiseReport]:
    """Prune the ``nn.Linear`` layers ``names`` (full names; default: every one inside the blocks that
    the forward uses) block by block; returns a :class:`BlockwiseReport`.

    For each block, ``prune(block, group, items, run)`` is called once per group of layers with the
    group's names relative to the block: with ``sequential`` the groups of :func:`forward_groups`
    (layers reading one input together, in forward order, so later layers are calibrated on the
    already-pruned earlier ones of the block), else one group of all. ``run(block, item)`` runs the
    block on one stored input (feed it to :func:`collect_input_stats` as ``forward``, with ``items``
    as the batches). ``strict=False`` returns None instead of raising when the model does not qualify
    (no blocks, names outside them, blocks not chained), before anything is pruned.
    """
    batches = list(batches)
    if not batches:
        raise ValueError("batches is empty: pass at least one calibration batch")
    found = find_blocks(model, blocks)
    if found is None:
        if not strict:
            return None
        raise ValueError(
            "blockwise=True but the model has no nn.ModuleList of transformer blocks containing "
            "nn.Linear layers; pass blocks= (e.g. blocks='model.layers') or blockwise=False"
        )
    prefix, mlist = found
    per_block, outside = _split_names(model, prefix, mlist, names)
    if outside:
        if not strict:
            return None
        raise ValueError(
            f"names: {outside[:5]} are not inside the blocks {prefix!r}; block-by-block pruning "
            "covers only their layers: leave those out of names= or pass blockwise=False"
        )
    last = max((i for i, p in enumerate(per_block) if p is None or p), default=-1)
    if last < 0:
        raise ValueError("names is empty: name at least one nn.Linear layer to prune")
    store, problem = _capture(model, mlist, batches, forward)
    if problem is not None:
        msg = f"blocks {prefix!r} cannot be calibrated one by one: {problem}"
        if strict:
            raise ValueError(f"{msg}; pass blockwise=False")
        warnings.warn(f"{msg}; calibrating by re-running the whole model instead (slower)", stacklevel=3)
        return None
    items = list(range(len(store.items)))
    groups_of: Dict[frozenset, List[List[str]]] = {}

    def groups(i: int) -> List[List[str]]:
        """Block ``i``'s wanted layers in call order (blocks of one class share it: found once)."""
        block = mlist[i]
        rel = sorted(n for n, m in block.named_modules() if isinstance(m, nn.Linear))
        key = frozenset(rel)
        if key not in groups_of:
            with torch.no_grad():
                groups_of[key] = forward_groups(block, 0, store.run, rel)
        wanted = per_block[i]
        out = [g for g in ([n for n in g if wanted is None or n in wanted] for g in groups_of[key]) if g]
        missed = sorted(set(wanted or ()) - {n for g in out for n in g})
        if missed:
            raise ValueError(
                f"the forward never called the layers {[f'{prefix}.{i}.{n}' for n in missed]}; leave them out of names="
            )
        return out if sequential or not out else [[n for g in out for n in g]]

    plan = [groups(i) for i in range(last + 1)]  # every name checked before anything is pruned
    todo = range(last + 1)
    if progress:
        from tqdm.auto import tqdm

        todo = tqdm(todo, desc=desc, unit="block")
    for i in todo:
        block = mlist[i]
        for g in plan[i]:
            prune(block, g, items, store.run)
        if i < last:
            with torch.no_grad():
                store.advance(block)
    return BlockwiseReport(
        blocks=last + 1, block_calls=store.calls, stored_tensors=len(store.items), peak_stored_bytes=store.peak_bytes
    )
