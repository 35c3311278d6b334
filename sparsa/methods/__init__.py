"""Pruning and sparse-training methods, each built on sparsa's layouts and sparsifiers.

The one way to prune a model is ``sparsa.sparsify(model, config, filter_fn)`` with a method config:
:class:`OneShot` (magnitude, any pattern or layout), :class:`Gradual`, :class:`Wanda`, :class:`SparseGPT`.

>>> import torch, torch.nn as nn, sparsa
>>> from sparsa.methods import OneShot, Wanda
>>> model = sparsa.sparsify(nn.Linear(16, 8), OneShot(pattern="2:4"))
>>> model = sparsa.sparsify(nn.Linear(16, 8), Wanda(0.5, calibration=[torch.randn(4, 16)]))

* schedules: :class:`GradualPruning` with :class:`~sparsa.sparsifiers.CubicSchedule`
  (Zhu & Gupta) or :class:`IterativeSchedule` (prune and fine-tune);
* dynamic sparse training: :class:`RigL`, :class:`SET`;
* :class:`MovementPruning`;
* post-training with calibration data: :class:`Wanda` (:class:`WandaSparsifier`), :class:`SparseGPT`,
  block by block for transformers (:func:`blockwise_prune`); the functions :func:`wanda`,
  :func:`sparsegpt` and :func:`one_shot` are deprecated shims;
* quality of causal LMs: :func:`perplexity`;
* recovery fine-tuning: :func:`distill`; gradual pruning + distillation on a time budget: :func:`recover`
  (:func:`logit_distillation_loss` for language models);
* per-layer sparsity: :func:`owl_sparsities` (OWL), :func:`uniform_sparsities`.

See ``docs/methods.md`` for each method's size against a public reference implementation.
"""

from .pattern import set_pattern, reset_optimizer_state, RowGroupSparsifier, named_pattern, resolve_pattern  # noqa: F401
from .gradual import GradualPruning, IterativeSchedule, Gradual, one_shot  # noqa: F401
from ..nn.one_shot import OneShot  # noqa: F401
from .rigl import DynamicSparsity, RigL, SET, erk_sparsities  # noqa: F401
from .movement import MovementPruning  # noqa: F401
from .calibration import InputStats, collect_input_stats, forward_groups  # noqa: F401
from .blockwise import BlockwiseReport, blockwise_prune, find_blocks  # noqa: F401
from .perplexity import perplexity, text_windows, window_perplexity  # noqa: F401
from .wanda import Wanda, WandaSparsifier, wanda  # noqa: F401
from .sparsegpt import SparseGPT, sparsegpt, sparsegpt_weight  # noqa: F401
from .distill import distill, distillation_loss, logit_distillation_loss  # noqa: F401
from .distributed import broadcast_sparse_parameters, patterns_in_sync  # noqa: F401
from .allocation import owl_sparsities, outlier_ratios, uniform_sparsities, weighted_mean_sparsity  # noqa: F401
from .recover import RecoverReport, recover  # noqa: F401
from .activation import ActivationSparsity  # noqa: F401

__all__ = [
    "OneShot",
    "Gradual",
    "Wanda",
    "SparseGPT",
    "WandaSparsifier",
    "resolve_pattern",
    "set_pattern",
    "reset_optimizer_state",
    "RowGroupSparsifier",
    "named_pattern",
    "GradualPruning",
    "IterativeSchedule",
    "one_shot",
    "DynamicSparsity",
    "RigL",
    "SET",
    "erk_sparsities",
    "MovementPruning",
    "InputStats",
    "collect_input_stats",
    "forward_groups",
    "BlockwiseReport",
    "blockwise_prune",
    "find_blocks",
    "perplexity",
    "text_windows",
    "window_perplexity",
    "wanda",
    "sparsegpt",
    "sparsegpt_weight",
    "distill",
    "distillation_loss",
    "logit_distillation_loss",
    "broadcast_sparse_parameters",
    "patterns_in_sync",
    "owl_sparsities",
    "outlier_ratios",
    "uniform_sparsities",
    "weighted_mean_sparsity",
    "RecoverReport",
    "recover",
    "ActivationSparsity",
]
