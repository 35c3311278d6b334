"""SparseGPT (Frantar & Alistarh, 2023): one-shot pruning that updates the remaining weights to
compensate, using the layer-wise Hessian ``H = X^T X`` of calibration inputs (optimal brain surgeon
with lazy block updates).

Columns are processed left to right. Each time a new selection window starts, the *pattern*
sparsifier chooses on the OBS saliency ``|w| / [H^-1]_jj`` (so any sparsa pattern works:
unstructured, N:M -- chosen every ``m`` columns as in the paper --, row groups); each pruned weight's
error is then spread over the not-yet-processed columns of its row. Layers are pruned in forward
order, each calibrated on the outputs of the already-pruned layers before it (``sequential=True``,
as in the paper; layers reading the same input, such as query/key/value, share one pass, and each
pass stops right after the layers it calibrates). Transformers are calibrated block by block
(:mod:`sparsa.methods.blockwise`).

As a :func:`sparsa.sparsify` config: :class:`SparseGPT`, carrying its calibration batches.

>>> import torch, torch.nn as nn, sparsa
>>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
>>> model = sparsa.sparsify(model, SparseGPT(0.5, calibration=[torch.randn(64, 8)]))
>>> model[0].weight.layout_name, model[0].weight.density
('masked', 0.5)
"""

from __future__ import annotations

import warnings
from dataclasses import KW_ONLY, dataclass
from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ..nn import Rule
from ..sparsifiers.base import Sparsifier
from ..tensor import to_dense, to_sparse
from .blockwise import blockwise_prune
from .calibrated_config import CalibratedConfig
from .calibration import collect_input_stats, forward_groups, layer_sparsifiers

__all__ = ["SparseGPT", "sparsegpt_weight", "sparsegpt"]


def sparsegpt_weight(
    weight: Tensor, hessian: Tensor, sparsifier: Sparsifier, block: int = 128, damp: float = 0.01
) -> Tuple[Tensor, Tensor]:
    """Prune a 2-D ``weight`` (out, in) given ``hessian`` (in, in); returns ``(new_weight, mask)``.

    The pattern is chosen every ``sparsifier.m`` columns for N:M sparsifiers, else once per ``block``
    columns. ``damp`` is added to the diagonal as a fraction of its mean.
    """
    if weight.dim() != 2 or hessian.shape != (weight.shape[1], weight.shape[1]):
        raise ValueError(f"weight must be 2-D (out, in) and hessian (in, in); got {weight.shape} and {hessian.shape}")
    W = to_dense(weight).detach().float().clone()
    H = hessian.detach().double().clone()
    dead = H.diagonal() == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H.diagonal().add_(damp * H.diagonal().mean())
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).float()
    every = getattr(sparsifier, "m", None) or block
    keep = torch.ones_like(W, dtype=torch.bool)
    for b0 in range(0, W.shape[1], block):
        b1 = min(b0 + block, W.shape[1])
        W1, K1, Hinv1 = W[:, b0:b1], keep[:, b0:b1], Hinv[b0:b1, b0:b1]  # views: W1 and K1 are updated in place
        Err, d = torch.zeros_like(W1), Hinv1.diagonal()
        for i in range(b1 - b0):
            if i % every == 0:
                K1[:, i : i + every] = sparsifier.mask((W1[:, i : i + every].abs() / d[i : i + every]).float())
            q = W1[:, i] * K1[:, i]
            Err[:, i] = (W1[:, i] - q) / d[i]
            W1[:, i:].addr_(Err[:, i], Hinv1[i, i:], alpha=-1.0)
            W1[:, i] = q
        W[:, b1:].addmm_(Err, Hinv[b0:b1, b1:], alpha=-1.0)
    return (W * keep).to(weight.dtype), keep


def _prune_layers(
    model: nn.Module,
    stats,
    sparsifier: Sparsifier,
    layout: str,
    block: int,
    damp: float,
    per_layer: Callable[[nn.Module], Sparsifier],
) -> None:
    params = Rule(sparsifier=sparsifier, layout=layout).resolved_layout_params()  # e.g. no n/m for "masked"
    for n, s in stats.items():
        m = model.get_submodule(n)
        w, keep = sparsegpt_weight(m.weight, s.hessian / s.count, per_layer(m), block, damp)
        m.weight = nn.Parameter(to_sparse(w, layout, mask=keep, **params), requires_grad=m.weight.requires_grad)


@dataclass
class SparseGPT(CalibratedConfig):
    """SparseGPT as a :func:`sparsa.sparsify` config: prune the ``nn.Linear`` layers (those ``filter_fn``
    accepts; default: all the forward uses, or every Linear inside the transformer blocks) to
    ``pattern`` at ``sparsity`` (or by ``sparsifier``), updating the remaining weights, calibrated on
    ``calibration`` (each batch fed as ``forward(model, batch)``), stored in ``layout`` (default: the
    pattern's natural one). ``sequential``, ``block``, ``damp``, ``blockwise``, ``blocks``,
    ``sparsities`` and ``progress`` are those of :func:`_sparsegpt`.

    >>> import torch, torch.nn as nn, sparsa
    >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    >>> model = sparsa.sparsify(model, SparseGPT(pattern="2:4", calibration=[torch.randn(64, 8)]))
    >>> model[0].weight.layout_name
    'nm'
    """

    method: ClassVar[str] = "SparseGPT"

    _: KW_ONLY
    sequential: bool = True
    block: int = 128
    damp: float = 0.01

    def prune(self, model: nn.Module, sparsifier: Sparsifier, layout: str, names: Optional[Sequence[str]]) -> None:
        _sparsegpt(
            model,
            self.calibration,
            sparsifier,
            layout,
            names,
            self.forward,
            self.sequential,
            self.block,
            self.damp,
            self.progress,
            self.blockwise,
            self.blocks,
            self.sparsities,
        )


def sparsegpt(
    model: nn.Module,
    batches: Sequence[Any],
    sparsifier: Sparsifier,
    layout: str = "masked",
    names: Optional[Sequence[str]] = None,
    forward: Optional[Callable[[nn.Module, Any], Any]] = None,
    sequential: bool = True,
    block: int = 128,
    damp: float = 0.01,
    progress: bool = False,
    blockwise: Optional[bool] = None,
    blocks: Union[None, str, nn.ModuleList] = None,
    sparsities: Optional[Mapping[str, float]] = None,
) -> nn.Module:
    """Deprecated: use ``sparsa.sparsify(model, sparsa.methods.SparseGPT(sparsifier=..., layout=...,
    calibration=batches), filter_fn)``. Prunes in place with :func:`_sparsegpt`; returns the model.

    >>> import warnings, torch, torch.nn as nn
    >>> from sparsa.sparsifiers import Magnitude
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", DeprecationWarning)
    ...     m = sparsegpt(nn.Linear(8, 4), [torch.randn(16, 8)], Magnitude(0.5, per="row"))
    >>> m.weight.layout_name
    'masked'
    """
    warnings.warn(
        "sparsa.methods.sparsegpt is deprecated: use model = sparsa.sparsify(model, sparsa.methods."
        "SparseGPT(sparsity, pattern=... or sparsifier=..., layout=..., calibration=batches), filter_fn)",
        DeprecationWarning,
        stacklevel=2,
    )
    return _sparsegpt(
        model,
        batches,
        sparsifier,
        layout,
        names,
        forward,
        sequential,
        block,
        damp,
        progress,
        blockwise,
        blocks,
        sparsities,
    )


def _sparsegpt(
    model: nn.Module,
    batches: Sequence[Any],
    sparsifier: Sparsifier,
    layout: str = "masked",
    names: Optional[Sequence[str]] = None,
    forward: Optional[Callable[[nn.Module, Any], Any]] = None,
    sequential: bool = True,
    block: int = 128,
    damp: float = 0.01,
    progress: bool = False,
    blockwise: Optional[bool] = None,
    blocks: Union[None, str, nn.ModuleList] = None,
    sparsities: Optional[Mapping[str, float]] = None,
) -> nn.Module:
    """Prune the ``nn.Linear`` layers ``names`` (default: all the forward uses) in place with SparseGPT
    calibrated on ``batches`` (each fed as ``forward(model, batch)``); the weights become
    ``SparseTensor`` parameters in ``layout``. ``progress`` shows a progress bar.

    Transformers are calibrated block by block (:mod:`sparsa.methods.blockwise`): one pass per block
    instead of one whole forward per layer group, same result. ``blockwise=None`` (default) does so
    when the model has transformer blocks (or ``blocks=`` names them), ``sequential`` is on and
    ``names`` are all inside the blocks; ``names=None`` then means every Linear inside the blocks
    (embeddings and head stay dense, as in the paper). ``blockwise=True`` raises ``ValueError`` where
    that is not possible; ``False`` always re-runs the whole model.

    ``sparsities``: per-layer sparsity ``{full module name: sparsity}`` (e.g. from
    :func:`~sparsa.methods.owl_sparsities`), applied with ``sparsifier.with_sparsity``; layers not
    in it keep ``sparsifier``'s own.
    """
    batches = list(batches)
    per_layer = layer_sparsifiers(model, sparsifier, sparsities)
    if blockwise or (blockwise is None and (sequential or blocks is not None)):

        def prune(blk: nn.Module, group, items, run) -> None:
            stats = collect_input_stats(blk, items, run, group, hessian=True, stop_early=sequential)
            _prune_layers(blk, stats, sparsifier, layout, block, damp, per_layer)

        strict = bool(blockwise) or blocks is not None
        if (
            blockwise_prune(
                model,
                batches,
                prune,
                names,
                forward,
                blocks,
                sequential,
                progress,
                "SparseGPT (calibrate + prune)",
                strict,
            )
            is not None
        ):
            return model
    todo = forward_groups(model, batches[0], forward, names) if sequential else [names]
    if progress:
        from tqdm.auto import tqdm

        todo = tqdm(todo, desc="SparseGPT (calibrate + prune)", unit="group")
    for group in todo:
        stats = collect_input_stats(model, batches, forward, group, hessian=True, stop_early=sequential)
        _prune_layers(model, stats, sparsifier, layout, block, damp, per_layer)
    return model
