"""Low-overhead definition of sparsa's forward-only kernel ops (``torch.library``).

``torch.library.custom_op`` wraps every call in Python layers (an autograd wrapper, a
``torch._dynamo.disable`` frame, output alias checks) that cost several times a small kernel's own
time. A *kernel op* is defined on the ``sparsa`` namespace with a schema, one
``CompositeExplicitAutograd`` implementation and a fake implementation, and nothing else, so eager
calls and ``torch.compile`` take the same op at the cost of one dispatcher round trip.

Kernel ops are forward-only: their backward belongs to the caller (an ``autograd.Function``, or a
``custom_op`` with ``register_autograd`` built on them). Called with inputs that require grad under
grad mode, autograd's fallback marks the output so that a backward through it raises.

Example (``sparsa::adaptive_compact`` is one)::

    >>> import torch
    >>> from sparsa.kernels import adaptive
    >>> cnt, idx, val = torch.ops.sparsa.adaptive_compact(torch.ones(1, 2, 1, 1), 64)
    >>> cnt.tolist()
    [2]
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["kernel_op", "NAMESPACE"]

NAMESPACE = "sparsa"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")


def kernel_op(schema: str, impl: Callable, fake: Callable) -> torch._ops.OpOverload:
    """Define ``sparsa::<schema>`` (e.g. ``"name(Tensor x, int n) -> Tensor"``) with ``impl`` for every
    backend and ``fake`` for tracing; returns the op (``torch.ops.sparsa.<name>.default``). A name that
    is already defined is an error (the registry rule: no silent replacement)."""
    name = schema.split("(", 1)[0].strip()
    if not name.isidentifier():
        raise ValueError(f"kernel_op: schema must start with the op name, got {schema!r}")
    _LIB.define(schema)   # raises if sparsa::<name> exists
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIB)
    return getattr(getattr(torch.ops, NAMESPACE), name).default
