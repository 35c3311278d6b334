"""Keeping sparse parameters identical across ``torch.distributed`` ranks.

``DistributedDataParallel`` all-reduces the gradients of sparse parameters like any other (their
``.grad`` is a plain tensor), so optimizer steps stay in sync. Its *initial* broadcast of the
module state from rank 0 does not reach a ``SparseTensor``, which has no flat storage to copy into:
call :func:`broadcast_sparse_parameters` once after building the model (before or after wrapping
it in DDP). :func:`patterns_in_sync` checks that every rank stores the same patterns.

Example (inside each process of a process group)::

    model = sparsa.sparsify(build_model(), Magnitude(0.9))
    broadcast_sparse_parameters(model)            # rank 0's values and patterns everywhere
    ddp = torch.nn.parallel.DistributedDataParallel(model)
"""

from __future__ import annotations

from typing import Iterable, List, Union

import torch
from torch import Tensor, nn

from ..tensor import SparseTensor
from .pattern import set_pattern

__all__ = ["broadcast_sparse_parameters", "patterns_in_sync"]


def _sparse(model_or_params: Union[nn.Module, Iterable[Tensor]]) -> List[SparseTensor]:
    params = model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params
    return [p for p in params if isinstance(p, SparseTensor)]


def broadcast_sparse_parameters(model_or_params: Union[nn.Module, Iterable[Tensor]], src: int = 0) -> int:
    """Copy the values and pattern of every sparse parameter from rank ``src`` to all ranks (in place,
    same parameter objects, same layouts). Returns how many parameters were broadcast."""
    dist = torch.distributed
    if not dist.is_initialized():
        raise ValueError(
            "broadcast_sparse_parameters needs an initialised process group; call "
            "torch.distributed.init_process_group(...) first"
        )
    params = _sparse(model_or_params)
    for p in params:
        values = p.sparse_layout.to_dense().detach().clone()
        mask = p.pattern().to(torch.uint8)
        dist.broadcast(values, src=src)
        dist.broadcast(mask, src=src)
        set_pattern(p, mask.bool(), values=values)
    return len(params)


def patterns_in_sync(model_or_params: Union[nn.Module, Iterable[Tensor]]) -> bool:
    """Whether every rank stores exactly the same pattern for every sparse parameter (a collective:
    call it on all ranks)."""
    dist = torch.distributed
    ok = torch.ones(1)
    for p in _sparse(model_or_params):
        m = p.pattern().to(torch.float32)
        lo, hi = m.clone(), m.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        ok *= float(torch.equal(lo, hi))
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item() == 1.0)
