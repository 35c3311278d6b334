"""The dispatchable ops: which torch calls and aten overloads reach the dispatcher, and how their
arguments split into tensor arguments (one layout each) and the rest.

An op is defined once, here, for both levels the dispatcher sees: the torch-function level
(``F.linear``, ``torch.add``, ``Tensor.__mul__``...; what ``SparseTensor.__torch_function__``
receives) and the aten level (``aten.add.Tensor``...; what ``__torch_dispatch__`` receives when the
torch-function level was bypassed). The built-in ops are defined below; any other torch function
becomes an op the first time an implementation is registered for it
(``sparsa.ops.implements(torch.sin, ...)``, see :func:`op_for`), with its arguments read from the
schema of its aten overload.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["OpCall", "define_op", "op_for", "undefine_op", "OPS", "TORCH_FNS", "ATEN_OPS"]


class OpCall:
    """How one callable of an op maps ``(args, kwargs)`` to ``(tensor args, rest)`` and back to its
    dense form. ``dense`` is None where the dense form is the intercepted callable itself."""

    __slots__ = ("name", "normalize", "dense", "same_dtype", "arg_names")

    def __init__(
        self,
        name: str,
        normalize: Callable,
        dense: Optional[Callable],
        same_dtype: bool = False,
        arg_names: Tuple[str, ...] = (),
    ):
        self.name, self.normalize, self.dense = name, normalize, dense
        self.same_dtype, self.arg_names = same_dtype, arg_names


#: op name -> number of tensor arguments it dispatches on
OPS: Dict[str, int] = {}
#: torch callable -> OpCall; the keys are what __torch_function__ receives
TORCH_FNS: Dict[Callable, OpCall] = {}
#: aten overload -> OpCall; the keys are what __torch_dispatch__ receives
ATEN_OPS: Dict[Any, OpCall] = {}
# op name -> the keys it added to TORCH_FNS and ATEN_OPS, and whether op_for derived it
_OWNED: Dict[str, Tuple[List[Callable], List[Any], bool]] = {}


def _tensor_typed(arg: Any) -> bool:
    return str(arg.type) in ("Tensor", "Tensor?")


def schema_call(name: str, overload: Any) -> OpCall:
    """An OpCall for an aten overload from its schema: tensor arguments in schema order, the others by
    schema name (``input=`` is read as ``self=``); dense form: the overload itself, called by name."""
    args = overload._schema.arguments
    pos = [a.name for a in args if not a.kwarg_only]
    tensors = tuple(a.name for a in args if _tensor_typed(a))

    def normalize(a: tuple, k: dict):
        vals = dict(zip(pos, a))
        for key, v in k.items():
            vals["self" if key == "input" else key] = v
        return [vals.pop(n, None) for n in tensors], vals

    def dense(t: list, r: dict) -> Any:
        return overload(**dict(zip(tensors, t)), **r)

    return OpCall(name, normalize, dense, arg_names=tensors)


def define_op(
    name: str, nargs: int, torch_fns: Dict[Callable, OpCall], aten_ops: Sequence[Any] = (), *, derived: bool = False
) -> None:
    """Make ``name`` dispatchable: ``torch_fns`` maps each torch callable to its OpCall; each aten
    overload in ``aten_ops`` is read from its schema. A name or callable defined twice is an error."""
    if name in OPS:
        raise ValueError(
            f"op {name!r} is already defined; register implementations for it with sparsa.ops.implements({name!r}, ...)"
        )
    taken = [f for f in torch_fns if f in TORCH_FNS] + [o for o in aten_ops if o in ATEN_OPS]
    if taken:
        raise ValueError(f"define_op({name!r}): {taken} already belong to another op")
    OPS[name] = nargs
    TORCH_FNS.update(torch_fns)
    ATEN_OPS.update({o: schema_call(name, o) for o in aten_ops})
    _OWNED[name] = (list(torch_fns), list(aten_ops), derived)


def undefine_op(name: str) -> None:
    """Remove an op defined by :func:`op_for` (the built-in ones stay)."""
    fns, atens, derived = _OWNED.get(name, ((), (), False))
    if not derived:
        raise ValueError(f"op {name!r} was not derived from a torch function and cannot be removed")
    for f in fns:
        TORCH_FNS.pop(f, None)
    for o in atens:
        ATEN_OPS.pop(o, None)
    del OPS[name], _OWNED[name]


def op_for(fn: Callable) -> Tuple[str, bool]:
    """The op name of a torch callable, defining the op from its aten schema if it is new; returns
    (name, whether it was defined now)."""
    call = TORCH_FNS.get(fn)
    if call is not None:
        return call.name, False
    name = getattr(fn, "__name__", None)
    packet = getattr(torch.ops.aten, name, None) if isinstance(name, str) else None
    overload = None
    for ov in ("default", "Tensor"):
        overload = overload or (getattr(packet, ov) if packet is not None and ov in packet.overloads() else None)
    if overload is None or overload._schema.is_mutable:
        raise ValueError(
            f"cannot dispatch {fn!r}: no functional aten op named {name!r}; pass a torch function "
            "with an aten counterpart (e.g. torch.sin), or one of the op names in sparsa.ops.OPS"
        )
    if name in OPS:
        raise ValueError(f"{fn!r} is not routed to the op {name!r}; register with the op name {name!r} instead")
    call = schema_call(name, overload)
    call.dense = None  # the fallback calls the intercepted callable: it chooses its own aten overload
    fns = {fn: call}
    for owner in (torch, Tensor, F):
        f = getattr(owner, name, None)
        if callable(f) and f not in TORCH_FNS:
            fns[f] = call
    define_op(name, len(call.arg_names), fns, (overload,), derived=True)
    return name, True


# ----------------------------------------------------------------------------- the built-in ops
def _n_linear(a, k):
    x = a[0] if len(a) > 0 else k.get("input")
    w = a[1] if len(a) > 1 else k.get("weight")
    b = a[2] if len(a) > 2 else k.get("bias")
    return [x, w, b], {}


def _n_two(names):
    def n(a, k):
        t = list(a[:2]) + [k.get(nm) for nm in names[len(a) : 2]]
        rest = {kk: v for kk, v in k.items() if kk not in names}
        return t, rest

    return n


def _n_addmm(a, k):
    t = list(a[:3]) + [k.get(nm) for nm in ("input", "mat1", "mat2")[len(a) : 3]]
    rest = {"beta": k.get("beta", 1), "alpha": k.get("alpha", 1)}
    return t, rest


def _n_add(a, k):
    t = [a[0] if a else k.get("input"), a[1] if len(a) > 1 else k.get("other")]
    rest = {"alpha": a[2] if len(a) > 2 else k.get("alpha", 1)}
    return t, rest


def _n_mul(a, k):
    return [a[0] if a else k.get("input"), a[1] if len(a) > 1 else k.get("other")], {}


def _n_relu(a, k):
    if len(a) > 1 and a[1]:
        return None  # in-place relu: not dispatched
    if k.get("inplace"):
        return None
    return [a[0] if a else k.get("input")], {}


def _n_conv2d(a, k):
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    vals = list(a) + [k.get(nm, d) for nm, d in zip(names[len(a) :], (None, None, None, 1, 0, 1, 1)[len(a) :])]
    return vals[:3], dict(zip(names[3:], vals[3:]))


def _swap(n):
    def s(a, k):
        r = n(a, k)
        if r is None:
            return None
        t, rest = r
        return [t[1], t[0]] + t[2:], rest

    return s


def _define_builtins() -> None:
    aten = torch.ops.aten
    two = ("input", "other")
    linear = OpCall("linear", _n_linear, lambda t, r: F.linear(t[0], t[1], t[2]), True, ("input", "weight", "bias"))
    define_op("linear", 3, {F.linear: linear})
    matmul = OpCall("matmul", _n_two(two), lambda t, r: torch.matmul(t[0], t[1]), True, two)
    rmatmul = OpCall("matmul", _swap(_n_two(two)), matmul.dense, True, two)
    define_op(
        "matmul",
        2,
        {torch.matmul: matmul, Tensor.matmul: matmul, Tensor.__matmul__: matmul, Tensor.__rmatmul__: rmatmul},
    )
    mm = OpCall("mm", _n_two(("input", "mat2")), lambda t, r: torch.mm(t[0], t[1]), True, two)
    define_op("mm", 2, {torch.mm: mm, Tensor.mm: mm})
    bmm = OpCall("bmm", _n_two(("input", "mat2")), lambda t, r: torch.bmm(t[0], t[1]), True, two)
    define_op("bmm", 2, {torch.bmm: bmm, Tensor.bmm: bmm})
    addmm = OpCall("addmm", _n_addmm, lambda t, r: torch.addmm(t[0], t[1], t[2], **r), True, ("input", "mat1", "mat2"))
    define_op("addmm", 3, {torch.addmm: addmm, Tensor.addmm: addmm})
    # add, mul and relu are also reached at the aten level: their implementations are pure PyTorch
    add = OpCall("add", _n_add, lambda t, r: torch.add(t[0], t[1], alpha=r.get("alpha", 1)))
    radd = OpCall("add", _swap(_n_mul), lambda t, r: torch.add(t[0], t[1]))
    define_op(
        "add", 2, {torch.add: add, Tensor.add: add, Tensor.__add__: add, Tensor.__radd__: radd}, (aten.add.Tensor,)
    )
    mul = OpCall("mul", _n_mul, lambda t, r: torch.mul(t[0], t[1]))
    rmul = OpCall("mul", _swap(_n_mul), mul.dense)
    define_op(
        "mul", 2, {torch.mul: mul, Tensor.mul: mul, Tensor.__mul__: mul, Tensor.__rmul__: rmul}, (aten.mul.Tensor,)
    )
    relu = OpCall("relu", _n_relu, lambda t, r: torch.relu(t[0]))
    define_op("relu", 1, {torch.relu: relu, F.relu: relu, Tensor.relu: relu}, (aten.relu.default,))
    conv2d = OpCall(
        "conv2d", _n_conv2d, lambda t, r: F.conv2d(t[0], t[1], t[2], **r), True, ("input", "weight", "bias")
    )
    define_op("conv2d", 3, {F.conv2d: conv2d})


_define_builtins()
