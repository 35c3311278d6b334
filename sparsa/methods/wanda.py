"""Wanda (Sun et al., 2023): prune by ``|W_ij| * ||X_j||_2``, the weight times the L2 norm of its
input feature on calibration data; no weight update.

In sparsa Wanda is a sparsifier *wrapper*: :class:`Wanda` scales the weight by the input norms and
lets any pattern sparsifier choose on the scaled tensor. Per-row magnitude gives the paper's
unstructured rule (compare within an output row), ``NM(2, 4)`` its N:M variant, and the row-group
sparsifier the fast CPU layout, all from one line.

>>> import torch, torch.nn as nn
>>> from sparsa.sparsifiers import NM
>>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
>>> model = wanda(model, [torch.randn(32, 8)], NM(2, 4), layout="nm")
>>> model[0].weight.layout_name, model[2].weight.density
('nm', 0.5)
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

from torch import Tensor, nn

from ..nn import Rule, sparsify
from ..sparsifiers.base import Sparsifier
from .blockwise import blockwise_prune
from .calibration import collect_input_stats, layer_sparsifiers

__all__ = ["Wanda", "wanda"]


class Wanda(Sparsifier):
    """``base`` applied to ``|W| * input_norm`` (``input_norm``: one value per input feature)."""

    name = "wanda"

    def __init__(self, base: Sparsifier, input_norm: Tensor):
        if not isinstance(base, Sparsifier):
            raise TypeError(f"base must be a sparsa Sparsifier (e.g. Magnitude(0.5, per='row')), got {base!r}")
        self.base, self.input_norm = base, input_norm

    def _mask(self, dense: Tensor) -> Tensor:
        return self.base.mask(dense.abs() * self.input_norm.to(dense))

    def layout_params(self):
        return self.base.layout_params()

    def _repr_args(self):
        return {"base": self.base}


def wanda(model: nn.Module, batches: Iterable[Any], sparsifier: Sparsifier, layout: str = "masked",
          names: Optional[Sequence[str]] = None, forward: Optional[Callable[[nn.Module, Any], Any]] = None,
          blockwise: Optional[bool] = None, blocks: Union[None, str, nn.ModuleList] = None,
          progress: bool = False, sparsities: Optional[Mapping[str, float]] = None) -> nn.Module:
    """Prune the ``nn.Linear`` layers ``names`` (default: all the forward uses) in place with Wanda on
    top of ``sparsifier``, stored in ``layout``, calibrated on ``batches`` (each fed as
    ``forward(model, batch)``, default ``model(batch)``).

    Transformers are pruned block by block (:mod:`sparsa.methods.blockwise`), each block calibrated on
    the outputs of the already-pruned blocks before it (as the paper's LLM code does); the layers of
    one block share one pass. ``blockwise=None`` (default) does so when the model has transformer
    blocks (or ``blocks=`` names them) and ``names`` are all inside them (``names=None``: every
    Linear inside the blocks; embeddings and head stay dense); ``True`` raises ``ValueError`` where
    that is not possible. Otherwise all layers are calibrated in one pass on the dense model.

    ``sparsities``: per-layer sparsity ``{full module name: sparsity}`` (e.g. from
    :func:`~sparsa.methods.owl_sparsities`), applied with ``sparsifier.with_sparsity``; layers not
    in it keep ``sparsifier``'s own.
    """
    batches = list(batches)
    per_layer = layer_sparsifiers(model, sparsifier, sparsities)
    if blockwise is None or blockwise:
        def prune(blk: nn.Module, group, items, run) -> None:
            stats = collect_input_stats(blk, items, run, group)
            sparsify(blk, [Rule(sparsifier=Wanda(per_layer(blk.get_submodule(n)), s.norm), layout=layout, names=n)
                           for n, s in stats.items()])

        strict = bool(blockwise) or blocks is not None
        if blockwise_prune(model, batches, prune, names, forward, blocks, False, progress, "Wanda (calibrate + prune)",
                           strict) is not None:
            return model
    stats = collect_input_stats(model, batches, forward, names)
    rules = [Rule(sparsifier=Wanda(per_layer(model.get_submodule(n)), s.norm), layout=layout, names=n)
             for n, s in stats.items()]
    return sparsify(model, rules)
