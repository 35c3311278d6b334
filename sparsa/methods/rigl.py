"""Dynamic sparse training at constant sparsity: SET (Mocanu et al., 2018) and RigL (Evci et al., 2020).

Every ``update_every`` steps each sparse parameter drops the ``k`` active weights of smallest
magnitude and regrows ``k`` inactive positions: at random (SET) or where the dense gradient is
largest (RigL). ``k`` is ``drop_fraction`` of the active weights, decayed with a cosine to zero at
``end_step``. Regrown weights start at zero and their optimizer state (Adam moments, momentum) is
reset, so they are not pushed by stale averages. The new pattern is written into the parameter's
layout (:func:`~sparsa.methods.pattern.set_pattern`), which stays the same parameter object.

RigL needs the *dense* gradient, also at inactive positions, but a sparse weight's ``.grad`` is
restricted to its pattern. So ``RigL(model, ...)`` hooks the model's ``nn.Linear`` / ``nn.Conv2d``
layers with sparse weights and, during the backward pass before each update step only, computes
the dense weight gradient from the layer's input and output gradient (one extra GEMM per layer
per update; nothing on other steps).

Distributed: the dense gradients are all-reduced (averaged) before ranking, so every rank computes
the same pattern; the pattern chosen on rank 0 is broadcast anyway (``sync=True``), which also
covers SET's random choice and floating-point ties.

>>> import torch, torch.nn as nn, sparsa
>>> from sparsa.sparsifiers import Magnitude
>>> model = sparsa.sparsify(nn.Linear(32, 16), Magnitude(0.9))
>>> opt = torch.optim.Adam(model.parameters(), lr=1e-3)
>>> rigl = RigL(model, opt, update_every=1, end_step=10)
>>> model(torch.randn(8, 32)).pow(2).mean().backward()
>>> rigl.step(1)   # after backward, before optimizer.step()
True
>>> round(model.weight.sparsity, 2)
0.9
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from ..layouts.base import check_fraction
from ..tensor import SparseTensor
from .pattern import _iter_sparse, reset_optimizer_state, set_pattern

__all__ = ["DynamicSparsity", "RigL", "SET", "erk_sparsities"]


def erk_sparsities(shapes: Sequence[Sequence[int]], sparsity: float) -> List[float]:
    """Per-layer sparsities with overall ``sparsity`` by Erdos-Renyi-Kernel (RigL's default): a layer's
    density is proportional to ``sum(shape) / prod(shape)`` (small layers stay denser), capped at dense.

    >>> [round(s, 3) for s in erk_sparsities([(16, 1, 3, 3), (256, 512)], 0.9)]
    [0.0, 0.901]
    """
    sizes = [math.prod(s) for s in shapes]
    raw = [sum(s) / n for s, n in zip(shapes, sizes)]
    dense: set = set()
    while len(dense) < len(sizes):
        budget = (1 - check_fraction(sparsity, "sparsity")) * sum(sizes) - sum(sizes[i] for i in dense)
        eps = budget / sum(raw[i] * sizes[i] for i in range(len(sizes)) if i not in dense)
        over = {i for i in range(len(sizes)) if i not in dense and eps * raw[i] >= 1}
        if not over:
            return [0.0 if i in dense else 1 - eps * raw[i] for i in range(len(sizes))]
        dense |= over
    return [0.0] * len(sizes)


class DynamicSparsity:
    """Shared drop-and-grow loop; subclasses define :meth:`grow_score`. Call :meth:`step` once per
    training step between ``backward()`` and ``optimizer.step()``."""

    def __init__(
        self,
        model_or_params: Union[nn.Module, Iterable[Tensor]],
        optimizer: Optional[torch.optim.Optimizer] = None,
        *,
        update_every: int = 100,
        drop_fraction: float = 0.3,
        end_step: Optional[int] = None,
        seed: int = 0,
        sync: bool = True,
    ):
        is_model = isinstance(model_or_params, nn.Module)
        self.modules = (
            [
                m
                for m in model_or_params.modules()
                if isinstance(m, (nn.Linear, nn.Conv2d)) and isinstance(m.weight, SparseTensor)
            ]
            if is_model
            else []
        )
        self.params = _iter_sparse([m.weight for m in self.modules] if is_model else model_or_params)
        if isinstance(update_every, bool) or not isinstance(update_every, int) or update_every <= 0:
            raise ValueError(f"update_every must be a positive int, got {update_every!r}")
        self.optimizer, self.update_every = optimizer, update_every
        self.drop_fraction = check_fraction(drop_fraction, "drop_fraction")
        self.end_step, self.seed, self.sync = end_step, seed, sync

    def fraction_at(self, step: int) -> float:
        """Cosine-decayed drop fraction (0 from ``end_step`` on)."""
        if self.end_step is None:
            return self.drop_fraction
        if step >= self.end_step:
            return 0.0
        return self.drop_fraction * 0.5 * (1.0 + math.cos(math.pi * step / self.end_step))

    def step(self, step: int) -> bool:
        """Update the patterns if ``step`` is an update step; returns whether it was."""
        frac = self.fraction_at(step)
        self.due_next = (step + 1) % self.update_every == 0
        if step <= 0 or step % self.update_every or frac <= 0.0:
            return False
        for i, p in enumerate(self.params):
            self._update(i, p, frac, step)
        return True

    #: whether the next backward precedes an update step (set by :meth:`step`)
    due_next: bool = False

    def grow_score(self, index: int, param: SparseTensor, step: int) -> Tensor:
        """Score of every position for regrowth (higher grows first)."""
        raise NotImplementedError

    def _update(self, i: int, p: SparseTensor, frac: float, step: int) -> None:
        mask = p.pattern()
        dense = p.sparse_layout.to_dense()
        k = int(frac * int(mask.sum()))
        if k == 0 or bool(mask.all()):  # a dense layer (e.g. from ERK) has nothing to swap with
            return
        flat = mask.flatten()
        drop_score = torch.where(flat, dense.abs().flatten(), torch.inf)
        kept = flat.clone()
        kept[drop_score.topk(k, largest=False).indices] = False
        grow = self.grow_score(i, p, step).flatten().float()
        grow = torch.where(kept, -torch.inf, grow)
        new = kept.clone()
        new[grow.topk(k).indices] = True
        new, kept = self._broadcast(new.view_as(mask)), self._broadcast(kept.view_as(mask))
        set_pattern(p, new, values=dense * kept)  # regrown weights (also just-dropped ones) start at zero
        reset_optimizer_state(self.optimizer, p, new & ~kept)

    def _broadcast(self, mask: Tensor) -> Tensor:
        dist = torch.distributed
        if not (self.sync and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return mask
        buf = mask.to(torch.uint8)
        dist.broadcast(buf, src=0)
        return buf.bool()


class RigL(DynamicSparsity):
    """Regrow where the dense gradient magnitude is largest. Pass the model (recommended): the dense
    gradient is then computed by hooks. Given bare parameters, ``param.grad`` is used and must be dense
    at every position (true for layers that run through the dense fallback, not for sparse ``linear``)."""

    def __init__(self, model_or_params, optimizer=None, **kwargs):
        super().__init__(model_or_params, optimizer, **kwargs)
        self.due_next = self.update_every == 1
        self.dense_grads: Dict[int, Tensor] = {}
        for m in self.modules:
            m.register_forward_hook(self._capture)

    def _capture(self, mod: nn.Module, args: tuple, out: Tensor) -> None:
        if self.due_next and torch.is_grad_enabled() and out.requires_grad:
            x = args[0].detach()
            out.register_hook(lambda g: self._add(mod, _dense_weight_grad(mod, x, g)))

    def _add(self, mod: nn.Module, g: Tensor) -> None:
        key = id(mod.weight)
        self.dense_grads[key] = self.dense_grads[key] + g if key in self.dense_grads else g

    def step(self, step: int) -> bool:
        done = super().step(step)
        self.dense_grads.clear()
        return done

    def grow_score(self, index: int, param: SparseTensor, step: int) -> Tensor:
        g = self.dense_grads.get(id(param))
        if g is None:
            g = param.grad
            if g is None or self.modules:
                raise ValueError(
                    "RigL.step needs the gradients of this step: call it after loss.backward(), "
                    "once every step (it arms the gradient hooks for the next update)"
                )
            g = g.sparse_layout.to_dense() if isinstance(g, SparseTensor) else g
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and self.modules:
            g = g.clone()
            dist.all_reduce(g)
            g /= dist.get_world_size()
        return g.abs()


def _dense_weight_grad(mod: nn.Module, x: Tensor, g: Tensor) -> Tensor:
    """dLoss/dW at every position of ``mod.weight`` from its input ``x`` and output gradient ``g``."""
    if isinstance(mod, nn.Linear):
        return g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1]).to(g.dtype)
    return torch.nn.grad.conv2d_weight(
        x.to(g.dtype), mod.weight.shape, g, mod.stride, mod.padding, mod.dilation, mod.groups
    )


class SET(DynamicSparsity):
    """Regrow at random positions (seeded by ``seed``, the step and the parameter index, so every
    process draws the same)."""

    def grow_score(self, index: int, param: SparseTensor, step: int) -> Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1_009 + index)
        return torch.rand(param.shape, generator=gen)
