"""Recovery fine-tuning in the sparse layout with knowledge distillation from the dense teacher.

The student is the pruned model itself: its weights are ``SparseTensor`` parameters, so every
optimizer step updates only the stored values and keeps the pattern (sparsa refills it); the
teacher is the dense model before pruning. The loss matches the student's outputs to the
teacher's: ``1 - cosine`` plus a normalised MSE, summed over every output tensor ``forward``
returns (e.g. a sentence embedding and the token states).

>>> import copy, torch, torch.nn as nn, sparsa
>>> from sparsa.sparsifiers import Magnitude
>>> _ = torch.manual_seed(0)
>>> teacher = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
>>> student = sparsa.sparsify(copy.deepcopy(teacher), Magnitude(0.5))
>>> x = torch.randn(32, 8)
>>> losses = distill(student, teacher, [x] * 20, lr=1e-2)          # the same batch: loss must fall
>>> losses[-1] < losses[0], student[0].weight.density
(True, 0.5)
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["distill", "distillation_loss", "logit_distillation_loss"]

Outputs = Union[Tensor, Sequence[Tensor]]


def distillation_loss(student: Outputs, teacher: Outputs) -> Tensor:
    """Sum over output tensors of ``(1 - cos)`` along the last dim plus MSE scaled by the teacher's
    mean square (so it is scale-free)."""
    s_list = [student] if isinstance(student, Tensor) else list(student)
    t_list = [teacher] if isinstance(teacher, Tensor) else list(teacher)
    if len(s_list) != len(t_list):
        raise ValueError(f"student returned {len(s_list)} outputs but teacher {len(t_list)}")
    return sum(
        (1 - F.cosine_similarity(s, t, dim=-1)).mean() + F.mse_loss(s, t) / t.pow(2).mean().clamp_min(1e-12)
        for s, t in zip(s_list, t_list)
    )


def logit_distillation_loss(student: Outputs, teacher: Outputs, temperature: float = 1.0) -> Tensor:
    """``KL(teacher || student)`` of the next-token distributions, averaged over positions and summed
    over output tensors: the loss for language models, whose logits are compared as distributions
    rather than as vectors (a logit shift changes nothing). ``temperature`` softens both sides; the
    loss is scaled by its square so gradients keep their size (Hinton et al., 2015).

    >>> t = torch.randn(2, 5, 11)
    >>> float(logit_distillation_loss(t + 3.0, t)) < 1e-6      # a shift of every logit: same distribution
    True
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    s_list = [student] if isinstance(student, Tensor) else list(student)
    t_list = [teacher] if isinstance(teacher, Tensor) else list(teacher)
    if len(s_list) != len(t_list):
        raise ValueError(f"student returned {len(s_list)} outputs but teacher {len(t_list)}")
    total = 0.0
    for s, t in zip(s_list, t_list):
        if s.shape != t.shape:
            raise ValueError(f"student logits have shape {tuple(s.shape)}, teacher's {tuple(t.shape)}")
        # float32 softmax: bf16 log-probabilities of a large vocabulary lose the tail
        ls = F.log_softmax(s.float() / temperature, dim=-1).flatten(0, -2)
        lt = F.log_softmax(t.float() / temperature, dim=-1).flatten(0, -2)
        total = total + F.kl_div(ls, lt, log_target=True, reduction="batchmean") * temperature**2
    return total


def distill(
    student: nn.Module,
    teacher: nn.Module,
    batches: Iterable[Any],
    *,
    forward: Optional[Callable[[nn.Module, Any], Outputs]] = None,
    loss: Callable[[Outputs, Outputs], Tensor] = distillation_loss,
    optimizer: Optional[torch.optim.Optimizer] = None,
    lr: float = 1e-4,
    epochs: int = 1,
) -> List[float]:
    """Fine-tune ``student`` towards ``teacher`` on ``batches`` (each passed to ``forward(model, batch)``,
    default ``model(batch)``); returns the loss of every step. The teacher is frozen and run without
    gradients; ``optimizer`` defaults to AdamW over the student's trainable parameters."""
    forward = forward or (lambda m, b: m(b))
    opt = optimizer or torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    teacher.eval()
    was_training = student.training
    student.train()
    losses: List[float] = []
    for b in list(batches) * epochs:
        with torch.no_grad():
            target = forward(teacher, b)
        value = loss(forward(student, b), target)
        opt.zero_grad(set_to_none=True)
        value.backward()
        opt.step()
        losses.append(value.item())
    student.train(was_training)
    return losses
