"""Which ``nn.Linear`` layers of a model are its block Linears: those inside the model's repeated
blocks (BERT's ``encoder.layer``, Llama's ``model.layers``). What ``sparsa prune`` prunes, and what
:func:`sparsa.frontier.prune_copy` prunes by default (see :func:`prunable_linears`).
"""

from __future__ import annotations

from typing import List

from torch import nn

__all__ = ["prunable_linears"]


def prunable_linears(model: nn.Module) -> List[str]:
    """Names of the ``nn.Linear`` layers ``prune_model_dir`` prunes: those inside the model's
    repeated blocks (the outermost ``nn.ModuleList`` of same-class, non-Linear modules, e.g. BERT's
    ``encoder.layer`` or Llama's ``model.layers``); if there is none, every ``nn.Linear``. The output
    embeddings (LM head) are never included.

    >>> import torch.nn as nn
    >>> m = nn.Sequential(nn.ModuleList([nn.Sequential(nn.Linear(4, 4)) for _ in range(2)]), nn.Linear(4, 9))
    >>> prunable_linears(m)
    ['0.0.0', '0.1.0']
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    lists = [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.ModuleList)
        and len(m)
        and len({type(c) for c in m}) == 1
        and not isinstance(m[0], nn.Linear)
    ]
    outer = [n for n in lists if not any(o != n and (o == "" or n.startswith(o + ".")) for o in lists)]

    def inside(name: str) -> bool:
        return any(o == "" or name.startswith(o + ".") for o in outer)

    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head]
    in_blocks = [n for n, _ in linears if inside(n)]
    return in_blocks or [n for n, _ in linears]
