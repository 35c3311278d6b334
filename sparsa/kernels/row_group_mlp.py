"""``sparsa::row_group_mlp_kernel``: a transformer MLP ``act(x W1^T + b1) W2^T + b2`` with both weights RowGroup.

Where the CPU runs the row_group AMX tiles (:func:`sparsa.kernels.row_group.has_amx`), bf16 operands with 16
tokens or more, groups of 16 and no row permutation, one native call runs both products panel by panel: the
first product's tiles go straight into the packed panel the second reads, so the hidden activation is never
transposed into a ``[T, R1]`` tensor nor packed back. Everywhere else (float32, other ISAs, other group sizes,
decode-sized calls, ``SPARSA_NO_NATIVE=1``) the op runs the two ``row_group_linear`` products, the first with
the activation in its epilogue: the same result, bit for bit, where both run the AMX tiles.

Forward-only (see :mod:`sparsa.kernels.opdef`): :class:`sparsa.nn.fused_mlp.FusedMLP` runs it for inference
and composes the two differentiable products when autograd needs them.

Example::

    >>> import torch
    >>> from sparsa.layouts import RowGroup
    >>> from sparsa.kernels.row_group_mlp import row_group_mlp_kernel
    >>> w1 = RowGroup.from_dense(torch.randn(64, 32), group=16, sparsity=0.5)
    >>> w2 = RowGroup.from_dense(torch.randn(32, 64), group=16, sparsity=0.5)
    >>> x = torch.randn(5, 32)
    >>> y = row_group_mlp_kernel(x, w1.columns, w1.values, None, 64, None, w2.columns, w2.values, None, 32, None)
    >>> ref = torch.nn.functional.gelu(x @ w1.to_dense().T) @ w2.to_dense().T
    >>> torch.allclose(y, ref, atol=1e-4)
    True
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..layouts.row_group import is_identity_perm
from . import row_group as rg
from .epilogue import activation_code
from .operands import float_bias, native_kind, token_rows, version_key
from .opdef import kernel_op

__all__ = ["row_group_mlp_kernel", "row_group_mlp_impl", "native_mlp"]

#: the group size the fused AMX path takes (both weights)
FUSED_GROUP = 16

#: attributes of a weight's component tensors that keep a fact derived from their values (keyed by data
#: pointer and version, so an in-place update recomputes it)
_MAXCOL_ATTR = "_sparsa_max_column"
_IDENTITY_ATTR = "_sparsa_identity_perm"


def _cached(t: Tensor, attr: str, compute):
    version = version_key(t)
    hit = getattr(t, attr, None) if version is not None else None
    if hit is not None and hit[0] == version:
        return hit[1]
    value = compute(t)
    if version is not None:
        setattr(t, attr, (version, value))
    return value


def _max_column(columns: Tensor) -> int:
    return _cached(columns, _MAXCOL_ATTR, lambda c: int(c.max()) if c.numel() else -1)


def _is_identity(row_perm: Optional[Tensor]) -> bool:
    """Whether a row permutation keeps every row in place (RowGroup stores one even when it does)."""
    if row_perm is None:
        return True
    return _cached(row_perm, _IDENTITY_ATTR, is_identity_perm)


def _check(x: Tensor, values1: Tensor, out1: int, columns2: Tensor, values2: Tensor, out2: int) -> None:
    for name, v in (("values1", values1), ("values2", values2)):
        if v.dim() != 3:
            raise ValueError(f"row_group_mlp: {name} must be (n_groups, k, group), got shape {tuple(v.shape)}")
    ng1, _, g1 = values1.shape
    ng2, _, g2 = values2.shape
    if not 0 <= out1 <= ng1 * g1:
        raise ValueError(f"row_group_mlp: out1={out1} must be within the first weight's {ng1 * g1} row slots")
    if not 0 <= out2 <= ng2 * g2:
        raise ValueError(f"row_group_mlp: out2={out2} must be within the second weight's {ng2 * g2} row slots")
    if _max_column(columns2) >= out1:
        raise ValueError(
            f"row_group_mlp: columns2 index hidden column {_max_column(columns2)} but the first product has only "
            f"out1={out1} outputs; the second weight's in_features must equal the first's out_features"
        )
    if x.dim() == 0:
        raise ValueError("row_group_mlp: x must have at least one dimension (its last is the input features)")


def native_mlp(
    x: Tensor,
    columns1: Tensor,
    values1: Tensor,
    bias1: Optional[Tensor],
    out1: int,
    row_perm1: Optional[Tensor],
    columns2: Tensor,
    values2: Tensor,
    bias2: Optional[Tensor],
    out2: int,
    row_perm2: Optional[Tensor],
    act: int,
    lib=None,
) -> Optional[Tensor]:
    """The fused native call's output, or None where it does not run here (see the module docs). ``lib``: the
    row_group library to call (default :func:`sparsa.kernels.row_group.native_library`; the tests pass the
    software-tile build)."""
    if not (_is_identity(row_perm1) and _is_identity(row_perm2)):
        return None
    if values1.shape[2] != FUSED_GROUP or values2.shape[2] != FUSED_GROUP:
        return None
    if native_kind(x, values1, bias1) != "bf16" or native_kind(x, values2, bias2) != "bf16":
        return None
    lib = rg.native_library() if lib is None else lib
    fn = None if lib is None else getattr(lib, "sparsa_row_group_mlp_bf16", None)
    K = x.shape[-1]
    if fn is None or K == 0 or x.numel() // K < rg.AMX_MIN_TOKENS:  # decode-sized calls: before any allocation
        return None
    x2, T, y = token_rows(x, out2)
    pack1, pack2 = rg.amx_pack(lib, values1.contiguous()), rg.amx_pack(lib, values2.contiguous())
    if pack1 is None or pack2 is None:
        return None
    ng1, k1, _ = values1.shape
    ng2, k2, _ = values2.shape
    b1 = None if bias1 is None else float_bias(bias1, ng1 * FUSED_GROUP, holder=values1)
    b2 = None if bias2 is None else float_bias(bias2, ng2 * FUSED_GROUP, holder=values2)
    c1, c2 = columns1.contiguous(), columns2.contiguous()
    rc = fn(
        x2.data_ptr(),
        T,
        x2.shape[-1],
        c1.data_ptr(),
        pack1[0].data_ptr() + pack1[1],
        ng1,
        k1,
        None if b1 is None else b1.data_ptr(),
        out1,
        c2.data_ptr(),
        pack2[0].data_ptr() + pack2[1],
        ng2,
        k2,
        None if b2 is None else b2.data_ptr(),
        y.data_ptr(),
        out2,
        torch.get_num_threads(),
        act,
    )
    return y if rc == 0 else None


def row_group_mlp_impl(
    x: Tensor,
    columns1: Tensor,
    values1: Tensor,
    bias1: Optional[Tensor],
    out1: int,
    row_perm1: Optional[Tensor],
    columns2: Tensor,
    values2: Tensor,
    bias2: Optional[Tensor],
    out2: int,
    row_perm2: Optional[Tensor],
    activation: str = "gelu",
) -> Tensor:
    """Eager implementation (what the op runs): the fused native call where it runs, else two products."""
    act = activation_code(activation, "row_group_mlp")
    _check(x, values1, out1, columns2, values2, out2)
    y = native_mlp(x, columns1, values1, bias1, out1, row_perm1, columns2, values2, bias2, out2, row_perm2, act)
    if y is not None:
        return y
    h = rg.row_group_linear_impl(x, columns1, values1, bias1, out1, row_perm1, activation)
    return rg.row_group_linear_impl(h, columns2, values2, bias2, out2, row_perm2, "none")


def _fake(x, columns1, values1, bias1, out1, row_perm1, columns2, values2, bias2, out2, row_perm2, activation="gelu"):
    return x.new_empty(*x.shape[:-1], out2)


row_group_mlp_kernel = kernel_op(
    "row_group_mlp_kernel(Tensor x, Tensor columns1, Tensor values1, Tensor? bias1, int out1, Tensor? row_perm1, "
    "Tensor columns2, Tensor values2, Tensor? bias2, int out2, Tensor? row_perm2, str activation='gelu') -> Tensor",
    row_group_mlp_impl,
    _fake,
)
