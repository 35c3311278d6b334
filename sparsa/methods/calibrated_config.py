"""The shared base of the post-training configs calibrated on data (:class:`~sparsa.methods.Wanda`,
:class:`~sparsa.methods.SparseGPT`): their common fields, checks and ``apply`` shape.

A subclass adds its own fields and implements :meth:`CalibratedConfig.prune`, which receives the
resolved sparsifier and layout and the selected layer names.

>>> import torch, torch.nn as nn, sparsa
>>> from sparsa.methods import Wanda
>>> isinstance(Wanda(calibration=[torch.randn(4, 8)]), CalibratedConfig)
True
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence, Union

from torch import nn

from ..layouts.base import check_fraction
from ..nn.config import FilterFn, SparsifyConfig, selected_linears
from ..sparsifiers.base import Sparsifier
from ..sparsifiers.resolve import resolve_pattern

__all__ = ["CalibratedConfig", "check_calibration"]


def check_calibration(calibration: Any, method: str) -> list:
    """``calibration`` as a list of model inputs; ``ValueError`` naming the argument when it is empty."""
    if calibration is None or isinstance(calibration, (str, bytes)):
        raise TypeError(
            f"{method}: calibration must be an iterable of model inputs (e.g. [tokenized batch, ...]), "
            f"got {type(calibration).__name__}"
        )
    batches = list(calibration)
    if not batches:
        raise ValueError(
            f"{method}: calibration is empty; pass calibration=[batch, ...] (model inputs, e.g. "
            "a few tokenized batches of representative text)"
        )
    return batches


@dataclass
class CalibratedConfig(SparsifyConfig):
    """Prune the ``nn.Linear`` layers (those ``filter_fn`` accepts; default: the method's own choice) to
    ``pattern`` at ``sparsity`` (or by ``sparsifier``), stored in ``layout`` (default: the pattern's natural
    one), calibrated on ``calibration`` (each batch fed as ``forward(model, batch)``, default
    ``model(batch)``). ``blockwise``, ``blocks``, ``sparsities`` (per-layer targets, e.g. OWL) and
    ``progress`` are passed on to the method."""

    #: the method's name in error messages
    method: ClassVar[str] = "CalibratedConfig"

    sparsity: float = 0.5
    _: KW_ONLY
    pattern: Optional[str] = None
    calibration: Any = field(default=None, repr=False)  # batches: too large to print
    layout: Optional[str] = None
    sparsifier: Optional[Sparsifier] = None
    forward: Optional[Callable[[nn.Module, Any], Any]] = None
    blockwise: Optional[bool] = None
    blocks: Union[None, str, nn.ModuleList] = None
    sparsities: Optional[Mapping[str, float]] = None
    progress: bool = False

    def __post_init__(self) -> None:
        check_fraction(self.sparsity, "sparsity")
        self.calibration = check_calibration(self.calibration, self.method)

    def apply(self, model: nn.Module, filter_fn: Optional[FilterFn] = None) -> None:
        sp, layout = resolve_pattern(self.sparsity, self.pattern, self.layout, self.sparsifier)
        self.prune(model, sp, layout, selected_linears(model, filter_fn))

    def prune(self, model: nn.Module, sparsifier: Sparsifier, layout: str, names: Optional[Sequence[str]]) -> None:
        """Run the method on ``model`` in place: the layers ``names`` (None: the method's default) with
        ``sparsifier``, stored in ``layout``."""
        raise NotImplementedError(f"{type(self).__name__} must implement prune(model, sparsifier, layout, names)")
