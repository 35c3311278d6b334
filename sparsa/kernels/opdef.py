"""Low-overhead definition of sparsa's forward-only kernel ops (``torch.library``).

``torch.library.custom_op`` wraps every call in Python layers (an autograd wrapper, a
``torch._dynamo.disable`` frame, output alias checks) that cost several times a small kernel's own
time. A *kernel op* is defined on the ``sparsa`` namespace with a schema, one
``CompositeExplicitAutograd`` implementation and a fake implementation, and nothing else, so eager
calls and ``torch.compile`` take the same op at the cost of one dispatcher round trip.

Kernel ops are forward-only: their backward belongs to the caller (an ``autograd.Function``, or a
``custom_op`` with ``register_autograd`` built on them). Called with inputs that require grad under
grad mode, they take the op, whose autograd fallback warns on a backward through it.

:func:`kernel_op` returns a :class:`KernelOp`: calling it runs the op. On plain tensors outside any
tracing (no ``torch.compile``, ``torch.jit`` trace, dispatch mode or tensor subclass other than
``nn.Parameter``, no input that requires grad under grad mode) it calls the op's registered
implementation directly, the same function the dispatcher would run, without the dispatcher's round
trip into Python, which costs a small decode-sized kernel call about as much as the kernel itself.
Everything else takes the op.

Example (``sparsa::adaptive_compact`` is one)::

    >>> import torch
    >>> from sparsa.kernels import adaptive
    >>> cnt, idx, val = torch.ops.sparsa.adaptive_compact(torch.ones(1, 2, 1, 1), 64)
    >>> cnt.tolist()
    [2]
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

__all__ = ["kernel_op", "KernelOp", "NAMESPACE"]

NAMESPACE = "sparsa"
_Parameter = torch.nn.Parameter
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")


class KernelOp:
    """A kernel op: ``op`` (``torch.ops.sparsa.<name>.default``) and ``impl``, its implementation.

    Calling it runs ``impl`` directly when nothing could observe the difference (see the module docs),
    else ``op``. Other attributes (``_schema``, ``name``, ...) are the op's."""

    def __init__(self, op: torch._ops.OpOverload, impl: Callable):
        self.op, self.impl = op, impl

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling() and _direct(args, kwargs):
            return self.impl(*args, **kwargs)
        return self.op(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.op, name)

    def __repr__(self) -> str:
        return f"KernelOp({self.op})"


def _direct(args: tuple, kwargs: dict) -> bool:
    """Whether a call with these arguments may skip the dispatcher: plain tensors only, nothing that
    records autograd, and no tracer (jit trace, dispatch modes) that must see the op."""
    if torch._C._len_torch_dispatch_stack() or torch._C._get_tracing_state() is not None:
        return False
    grad = torch.is_grad_enabled()
    for v in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(v, Tensor):
            # a Parameter (a module's bias) is a plain tensor to the dispatcher: no torch_function override
            if (type(v) is not Tensor and type(v) is not _Parameter) or (grad and v.requires_grad):
                return False
        elif isinstance(v, (list, tuple)) and any(isinstance(t, Tensor) for t in v):
            return False
    return True


_set_eval_frame = torch._C._dynamo.eval_frame.set_eval_frame


def _outside_dynamo(impl: Callable) -> Callable:
    """``impl`` as the dispatcher runs it: with Dynamo's frame evaluation reset (as ``torch._dynamo.disable``
    resets it, with less around it). Called from a compiled graph, the implementation's Python frames ran
    several times slower without it (``docs/benchmarks.md``, design measurements), enough to cost a
    decode-sized call more than the Python it runs eagerly. Outside compiled code it sets back what it found."""

    def run(*args: Any, **kwargs: Any) -> Any:
        prior = _set_eval_frame(None)
        try:
            return impl(*args, **kwargs)
        finally:
            _set_eval_frame(prior)

    run.__name__ = getattr(impl, "__name__", "impl")
    run.__wrapped__ = impl
    return run


def kernel_op(schema: str, impl: Callable, fake: Callable) -> KernelOp:
    """Define ``sparsa::<schema>`` (e.g. ``"name(Tensor x, int n) -> Tensor"``) with ``impl`` for every
    backend and ``fake`` for tracing; returns the :class:`KernelOp` (its ``op`` is
    ``torch.ops.sparsa.<name>.default``). A name that is already defined is an error (the registry
    rule: no silent replacement)."""
    name = schema.split("(", 1)[0].strip()
    if not name.isidentifier():
        raise ValueError(f"kernel_op: schema must start with the op name, got {schema!r}")
    _LIB.define(schema)  # raises if sparsa::<name> exists
    _LIB.impl(name, _outside_dynamo(impl), "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIB)
    return KernelOp(getattr(getattr(torch.ops, NAMESPACE), name).default, impl)
