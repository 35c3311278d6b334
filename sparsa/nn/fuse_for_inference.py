"""Every inference fusion of a sparsified model in one call.

:func:`fuse_for_inference` runs, in this order, :func:`sparsa.fuse_gelu` (GELU in the kernel epilogue),
:func:`sparsa.fuse_projections` (q/k/v and gate/up as one product) and :func:`sparsa.fuse_mlp` (a BERT-family
MLP as one call) and says how many of each it made. Each leaves alone what it cannot fuse, so this is safe on
any model; like each of them, call it after sparsifying and converting the dtype, and save the model before.

::

    >>> import torch, sparsa
    >>> from transformers import BertConfig, BertModel
    >>> cfg = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    >>> m = sparsa.sparsify(BertModel(cfg).eval(), sparsa.methods.OneShot(0.75, pattern="row_group16"))
    >>> sparsa.fuse_for_inference(m)
    {'gelu': 2, 'projections': 2, 'mlp': 2}
"""

from __future__ import annotations

from typing import Dict

from torch import nn

from .fuse import fuse_gelu
from .fused_mlp import fuse_mlp
from .fused_projections import fuse_projections

__all__ = ["fuse_for_inference"]


def fuse_for_inference(model: nn.Module) -> Dict[str, int]:
    """Fuse ``model`` in place for inference; returns ``{"gelu": n, "projections": n, "mlp": n}``, how many
    Linear + GELU pairs, sibling-projection sets and MLPs were fused."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fuse_for_inference: model must be an nn.Module, got {type(model).__name__}")
    return {"gelu": fuse_gelu(model), "projections": fuse_projections(model), "mlp": fuse_mlp(model)}
