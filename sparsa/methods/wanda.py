"""Wanda (Sun et al., 2023): prune by ``|W_ij| * ||X_j||_2``, the weight times the L2 norm of its
input feature on calibration data; no weight update.

:class:`Wanda` is the method as a :func:`sparsa.sparsify` config, carrying its calibration batches.
Inside, :class:`WandaSparsifier` scales the weight by the input norms and lets any pattern sparsifier
choose on the scaled tensor: per-row magnitude gives the paper's unstructured rule (compare within an
output row), ``"2:4"`` its N:M variant, and ``"row_group16"`` the fast CPU layout, all from one line.

>>> import torch, torch.nn as nn, sparsa
>>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
>>> model = sparsa.sparsify(model, Wanda(pattern="2:4", calibration=[torch.randn(32, 8)]))
>>> model[0].weight.layout_name, model[2].weight.density
('nm', 0.5)
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Mapping, Optional, Sequence, Union

from torch import Tensor, nn

from ..nn import Rule, sparsify
from ..sparsifiers.base import Sparsifier, check_sparsifier, is_sparsifier, layout_params_of
from .blockwise import blockwise_prune
from .calibrated_config import CalibratedConfig, check_calibration
from .calibration import collect_input_stats, layer_sparsifiers

__all__ = ["Wanda", "WandaSparsifier", "wanda", "check_calibration"]


class WandaSparsifier(Sparsifier):
    """``base`` applied to ``|W| * input_norm`` (``input_norm``: one value per input feature).

    >>> import torch
    >>> from sparsa.sparsifiers import Magnitude
    >>> WandaSparsifier(Magnitude(0.5), torch.tensor([1.0, 10.0])).mask(torch.tensor([[2.0, 1.0]])).tolist()
    [[False, True]]
    """

    name = "wanda"

    def __init__(self, base: Sparsifier, input_norm: Tensor):
        self.base, self.input_norm = check_sparsifier(base, "base", allow_none=False), input_norm

    def _mask(self, dense: Tensor) -> Tensor:
        return self.base.mask(dense.abs() * self.input_norm.to(dense))

    def layout_params(self):
        return layout_params_of(self.base)

    def _repr_args(self):
        return {"base": self.base}


@dataclass
class Wanda(CalibratedConfig):
    """Wanda as a :func:`sparsa.sparsify` config: prune the ``nn.Linear`` layers (those ``filter_fn``
    accepts; default: all the forward uses, or every Linear inside the transformer blocks) by
    ``|W| * ||X||`` calibrated on ``calibration`` (each batch fed as ``forward(model, batch)``,
    default ``model(batch)``), to ``pattern`` at ``sparsity`` (or by ``sparsifier``), stored in
    ``layout`` (default: the pattern's natural one). See :func:`_wanda` for ``blockwise``, ``blocks``,
    ``sparsities`` (per-layer targets, e.g. OWL) and ``progress``.

    ``Wanda(base, input_norm)`` (two positional arguments) is the deprecated spelling of
    :class:`WandaSparsifier`.

    >>> import torch, torch.nn as nn, sparsa
    >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    >>> model = sparsa.sparsify(model, Wanda(0.5, calibration=[torch.randn(32, 8)]))
    >>> model[0].weight.layout_name, model[0].weight.sparsity
    ('masked', 0.5)
    """

    method: ClassVar[str] = "Wanda"

    def __new__(cls, *args: Any, **kwargs: Any):
        # the old sparsifier spelling Wanda(base, input_norm): users have code that builds it
        if (args and is_sparsifier(args[0])) or "input_norm" in kwargs or "base" in kwargs:
            warnings.warn(
                "sparsa.methods.Wanda(base, input_norm) as a sparsifier is deprecated: use "
                "sparsa.methods.WandaSparsifier(base, input_norm); Wanda(sparsity, pattern=..., "
                "calibration=...) is now the method config for sparsa.sparsify",
                DeprecationWarning,
                stacklevel=2,
            )
            return WandaSparsifier(*args, **kwargs)
        return super().__new__(cls)

    def prune(self, model: nn.Module, sparsifier: Sparsifier, layout: str, names: Optional[Sequence[str]]) -> None:
        _wanda(
            model,
            self.calibration,
            sparsifier,
            layout,
            names,
            self.forward,
            self.blockwise,
            self.blocks,
            self.progress,
            self.sparsities,
        )


def wanda(
    model: nn.Module,
    batches: Iterable[Any],
    sparsifier: Sparsifier,
    layout: str = "masked",
    names: Optional[Sequence[str]] = None,
    forward: Optional[Callable[[nn.Module, Any], Any]] = None,
    blockwise: Optional[bool] = None,
    blocks: Union[None, str, nn.ModuleList] = None,
    progress: bool = False,
    sparsities: Optional[Mapping[str, float]] = None,
) -> nn.Module:
    """Deprecated: use ``sparsa.sparsify(model, sparsa.methods.Wanda(sparsifier=..., layout=...,
    calibration=batches), filter_fn)``. Prunes in place with :func:`_wanda`; returns the model.

    >>> import warnings, torch, torch.nn as nn
    >>> from sparsa.sparsifiers import NM
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", DeprecationWarning)
    ...     m = wanda(nn.Linear(8, 4), [torch.randn(16, 8)], NM(2, 4), layout="nm")
    >>> m.weight.layout_name
    'nm'
    """
    warnings.warn(
        "sparsa.methods.wanda is deprecated: use model = sparsa.sparsify(model, sparsa.methods.Wanda("
        "sparsity, pattern=... or sparsifier=..., layout=..., calibration=batches), filter_fn)",
        DeprecationWarning,
        stacklevel=2,
    )
    return _wanda(model, batches, sparsifier, layout, names, forward, blockwise, blocks, progress, sparsities)


def _wanda(
    model: nn.Module,
    batches: Iterable[Any],
    sparsifier: Sparsifier,
    layout: str = "masked",
    names: Optional[Sequence[str]] = None,
    forward: Optional[Callable[[nn.Module, Any], Any]] = None,
    blockwise: Optional[bool] = None,
    blocks: Union[None, str, nn.ModuleList] = None,
    progress: bool = False,
    sparsities: Optional[Mapping[str, float]] = None,
) -> nn.Module:
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
            sparsify(
                blk,
                [
                    Rule(sparsifier=WandaSparsifier(per_layer(blk.get_submodule(n)), s.norm), layout=layout, names=n)
                    for n, s in stats.items()
                ],
            )

        strict = bool(blockwise) or blocks is not None
        if (
            blockwise_prune(
                model, batches, prune, names, forward, blocks, False, progress, "Wanda (calibrate + prune)", strict
            )
            is not None
        ):
            return model
    stats = collect_input_stats(model, batches, forward, names)
    rules = [
        Rule(sparsifier=WandaSparsifier(per_layer(model.get_submodule(n)), s.norm), layout=layout, names=n)
        for n, s in stats.items()
    ]
    return sparsify(model, rules)
