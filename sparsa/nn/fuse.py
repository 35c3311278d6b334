"""Fold the GELU after a sparse ``nn.Linear`` into the kernel's epilogue.

The row_group, sliced_ell and bitmask kernels (bitmask: its panel and AMX strategies) apply GELU to each output
tile while it is still in registers, which saves
a full pass over the (tokens x 4*hidden) activation of a transformer's MLP. :func:`fuse_gelu` finds
``Linear -> GELU`` pairs (consecutive in an ``nn.Sequential``, or a module's ``dense`` Linear followed
by its ``intermediate_act_fn``, as in Hugging Face BERT-style MLPs), turns the Linear into a
:class:`LinearGELU` and the GELU into ``nn.Identity``. Parameters, ``state_dict`` keys and results
are unchanged::

    >>> import torch, torch.nn as nn, sparsa
    >>> from sparsa.nn.fuse import fuse_gelu
    >>> m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    >>> m = sparsa.sparsify(m, sparsa.methods.OneShot(0.75, pattern="row_group8"))
    >>> x = torch.randn(4, 32)
    >>> with torch.no_grad():
    ...     before = m(x)
    ...     n = fuse_gelu(m)
    ...     torch.allclose(m(x), before, atol=1e-5), n, type(m[1]).__name__
    (True, 1, 'Identity')
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor import SparseTensor

__all__ = ["LinearGELU", "fuse_gelu", "is_exact_gelu", "EPILOGUE_LAYOUTS"]

#: layouts whose native kernel applies GELU in its epilogue
EPILOGUE_LAYOUTS = ("row_group", "sliced_ell", "bitmask")


def is_exact_gelu(m: object) -> bool:
    """True for ``nn.GELU()`` (erf form) and Hugging Face's ``GELUActivation`` running ``F.gelu``."""
    if isinstance(m, nn.GELU):
        return m.approximate == "none"
    return type(m).__name__ == "GELUActivation" and getattr(m, "act", None) is F.gelu


class LinearGELU(nn.Linear):
    """``gelu(linear(x))``; with a row_group or sliced_ell weight the GELU runs in the kernel's epilogue
    (inference: no autograd graph needed), otherwise as a separate op."""

    #: the weight's layout name as last seen in eager mode: torch.compile reads this (it guards on a module's
    #: attributes), because a traced weight's own attributes (``layout_name``) read as missing there
    epilogue_layout = None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "LinearGELU":
        new = cls.__new__(cls)
        new.__dict__.update(linear.__dict__)  # the same parameters, hooks and state
        new.epilogue_layout = getattr(linear.weight, "layout_name", None)
        return new

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if name == "weight":  # a new weight (e.g. sparsified again into another layout)
            super().__setattr__("epilogue_layout", getattr(value, "layout_name", None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if torch.compiler.is_compiling():
            kind = self.epilogue_layout
        else:
            kind = self.epilogue_layout = getattr(w, "layout_name", None)
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or w.requires_grad or (self.bias is not None and self.bias.requires_grad)
        )
        if needs_grad or kind not in EPILOGUE_LAYOUTS:
            return F.gelu(F.linear(x, w, self.bias))
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"LinearGELU: input has shape {tuple(x.shape)} but the weight expects a last "
                f"dimension of {self.in_features}"
            )
        bias = None if self.bias is None else self.bias.detach()
        # the forward-only kernel ops: the same call in eager and under torch.compile (no grad is needed here);
        # the layout's components by the names SparseTensor.__tensor_flatten__ gives them
        if kind == "row_group":
            from ..kernels import row_group as rg

            return rg.row_group_linear_kernel(
                x, w._c_columns, w._c_values, bias, self.out_features, w._c_row_perm, "gelu"
            )
        if kind == "bitmask":
            from ..kernels import bitmask as bm

            return bm.bitmask_linear_kernel(x, w._c_bits, w._c_row_ptr, w._c_values, bias, self.out_features, "gelu")
        from ..kernels import sliced_ell as se

        return se.sliced_ell_linear_kernel(
            x, w._c_slice_ptr, w._c_columns, w._c_values, bias, self.out_features, "gelu"
        )


def fuse_gelu(model: nn.Module) -> int:
    """Fuse every ``Linear -> exact GELU`` pair of ``model`` in place; returns how many were fused.

    Only pairs whose Linear has a sparse weight in one of :data:`EPILOGUE_LAYOUTS` are touched (other
    Linears gain nothing). Call it
    after sparsifying, for inference; a fused model still trains correctly (the GELU then runs
    separately).
    """
    fused = 0
    for mod in list(model.modules()):
        if isinstance(mod, nn.Sequential):
            items = list(mod._modules.items())
            for (na, a), (nb, b) in zip(items, items[1:]):
                if _fusable(a) and is_exact_gelu(b):
                    mod._modules[na] = LinearGELU.from_linear(a)
                    mod._modules[nb] = nn.Identity()
                    fused += 1
        dense, act = getattr(mod, "dense", None), getattr(mod, "intermediate_act_fn", None)
        if _fusable(dense) and is_exact_gelu(act):
            mod.dense = LinearGELU.from_linear(dense)
            mod.intermediate_act_fn = nn.Identity()
            fused += 1
    return fused


def _fusable(m: object) -> bool:
    return type(m) is nn.Linear and isinstance(m.weight, SparseTensor) and m.weight.layout_name in EPILOGUE_LAYOUTS
