"""One native call for a transformer MLP: ``output.dense(gelu(intermediate.dense(h)))``.

A Hugging Face BERT-family layer (BERT, RoBERTa, MiniLM, ELECTRA, ...) runs its MLP as two modules: the
``*Intermediate`` (``act(dense(h))``) and the ``*Output`` (``LayerNorm(dropout(dense(.)) + h)``). With both
Linears in the row_group layout, :func:`fuse_mlp` moves the intermediate's Linear into a :class:`FusedMLP`
that stands where the output's ``dense`` was and makes the intermediate pass its input through, so the output
module receives ``h`` and its ``dense`` computes the whole MLP: one :func:`sparsa::row_group_mlp_kernel` call,
whose AMX path keeps the hidden activation in the packed panels the second product reads (see
:mod:`sparsa.kernels.row_group_mlp`). Where that path does not run the op runs the two products: the results
are the same. A ``Linear, GELU, Linear`` run of an ``nn.Sequential`` is fused the same way (the FusedMLP
in the first Linear's place, ``nn.Identity`` in the other two).

::

    >>> import torch, sparsa
    >>> from transformers import BertConfig, BertModel
    >>> cfg = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    >>> m = sparsa.sparsify(BertModel(cfg).eval(), sparsa.methods.OneShot(0.75, pattern="row_group16"))
    >>> ids = torch.randint(0, 100, (1, 8))
    >>> with torch.no_grad():
    ...     before = m(ids).last_hidden_state
    ...     n = sparsa.fuse_mlp(m)
    ...     torch.allclose(m(ids).last_hidden_state, before, atol=1e-5), n
    (True, 1)

Fuse for inference: the ``state_dict`` then holds the two weights under ``output.dense.up`` and
``output.dense.down``, so save and load the model before fusing. Forward hooks on the intermediate's Linear
no longer fire (it is an ``nn.Identity``); hooks on ``up`` and ``down`` fire only where the composed
products run (training).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..tensor import SparseTensor
from .fuse import LinearGELU, is_exact_gelu

__all__ = ["FusedMLP", "fuse_mlp"]


class FusedMLP(nn.Module):
    """``down(gelu(up(x)))`` for two Linears; with both weights in the row_group layout and no autograd
    needed, one ``sparsa::row_group_mlp_kernel`` call, else the two Linears and a separate GELU."""

    #: the weights' layout names as last seen in eager mode: torch.compile guards on a module's attributes,
    #: and a traced weight's own attributes read as missing there (as in LinearGELU)
    layouts: Tuple[Optional[str], Optional[str]] = (None, None)

    def __init__(self, up: nn.Linear, down: nn.Linear, activation: str = "gelu"):
        super().__init__()
        if activation != "gelu":
            raise ValueError(f"FusedMLP: activation must be 'gelu', got {activation!r}")
        if down.in_features != up.out_features:
            raise ValueError(
                f"FusedMLP: down.in_features={down.in_features} must equal up.out_features={up.out_features}"
            )
        self.up, self.down, self.activation = up, down, activation
        self.in_features, self.out_features = up.in_features, down.out_features
        self.layouts = self._layouts()

    def _layouts(self) -> Tuple[Optional[str], Optional[str]]:
        return getattr(self.up.weight, "layout_name", None), getattr(self.down.weight, "layout_name", None)

    def forward(self, x: Tensor) -> Tensor:
        up, down = self.up, self.down
        if torch.compiler.is_compiling():
            layouts = self.layouts
        else:
            layouts = self.layouts = self._layouts()
        params = (up.weight, up.bias, down.weight, down.bias)
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or any(p.requires_grad for p in params if p is not None)
        )
        if needs_grad or layouts != ("row_group", "row_group"):
            return down(F.gelu(up(x)))
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"FusedMLP: input has shape {tuple(x.shape)} but up expects a last dimension of {self.in_features}"
            )
        from ..kernels.row_group_mlp import row_group_mlp_kernel

        w1, w2 = up.weight, down.weight
        return row_group_mlp_kernel(
            x,
            w1._c_columns,
            w1._c_values,
            None if up.bias is None else up.bias.detach(),
            up.out_features,
            w1._c_row_perm,
            w2._c_columns,
            w2._c_values,
            None if down.bias is None else down.bias.detach(),
            down.out_features,
            w2._c_row_perm,
            self.activation,
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, hidden={self.up.out_features}, out_features={self.out_features}"


def _plain_linear(m: nn.Module) -> nn.Linear:
    """``m`` as a plain ``nn.Linear`` with the same parameters (a LinearGELU loses its epilogue here: the
    FusedMLP applies the GELU)."""
    if type(m) is nn.Linear:
        return m
    lin = nn.Linear.__new__(nn.Linear)
    lin.__dict__.update(m.__dict__)
    lin.__dict__.pop("epilogue_layout", None)
    return lin


def _row_group(m: object) -> bool:
    return isinstance(m, nn.Linear) and isinstance(m.weight, SparseTensor) and m.weight.layout_name == "row_group"


def _gelu_linear(dense: object, act: object) -> bool:
    """Whether ``act(dense(x))`` is ``gelu(linear(x))``: a Linear and the exact GELU, or a LinearGELU (the
    GELU already in its epilogue) and an ``nn.Identity``."""
    if type(dense) is LinearGELU:
        return isinstance(act, nn.Identity)
    return type(dense) is nn.Linear and is_exact_gelu(act)


def _pair(dense: nn.Module, down: object) -> bool:
    """Whether ``dense`` and ``down`` hold row_group weights of one dtype that chain (down reads dense's rows)."""
    if type(down) is not nn.Linear or not (_row_group(dense) and _row_group(down)):
        return False
    return dense.weight.dtype == down.weight.dtype and down.in_features == dense.out_features


def _fuse_layer(layer: nn.Module) -> bool:
    inter, out = getattr(layer, "intermediate", None), getattr(layer, "output", None)
    if inter is None or out is None or not type(inter).__name__.endswith("Intermediate"):
        return False
    dense, act = getattr(inter, "dense", None), getattr(inter, "intermediate_act_fn", None)
    down = getattr(out, "dense", None)
    if not (_gelu_linear(dense, act) and _pair(dense, down)):
        return False
    up = _plain_linear(dense)
    # the intermediate must compute exactly gelu(dense(h)): a probe through it before anything is replaced
    with torch.no_grad():
        probe = torch.randn(2, up.in_features, generator=torch.Generator().manual_seed(0)).to(up.weight.dtype)
        got, want = inter(probe).float(), F.gelu(up(probe)).float()  # an epilogue GELU rounds its own way
        if got.shape != want.shape or not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())):
            return False
    out.dense = FusedMLP(up, down)
    inter.dense = nn.Identity()
    inter.intermediate_act_fn = nn.Identity()
    return True


def _fuse_sequential(seq: nn.Sequential) -> int:
    """Fuse each ``Linear, GELU, Linear`` run of consecutive children: the first becomes the FusedMLP, the
    other two ``nn.Identity``."""
    items, fused, i = list(seq._modules.items()), 0, 0
    while i + 2 < len(items):
        (na, a), (nb, b), (nc, c) = items[i : i + 3]
        if _gelu_linear(a, b) and _pair(a, c):
            seq._modules[na] = FusedMLP(_plain_linear(a), c)
            seq._modules[nb], seq._modules[nc] = nn.Identity(), nn.Identity()
            fused, i = fused + 1, i + 3
        else:
            i += 1
    return fused


def fuse_mlp(model: nn.Module) -> int:
    """Fuse, in place, every MLP of ``model`` whose two Linears hold row_group weights of one dtype, with the
    exact GELU between them (or already in a :func:`sparsa.fuse_gelu` epilogue): the intermediate and output
    Linears of BERT-family layers, and ``Linear, GELU, Linear`` runs in an ``nn.Sequential``; returns how many
    were fused. Call it after sparsifying and converting (e.g. ``.to(torch.bfloat16)``), for inference (see
    the module notes on ``state_dict`` and hooks)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fuse_mlp: model must be an nn.Module, got {type(model).__name__}")
    fused = 0
    for mod in list(model.modules()):
        fused += _fuse_layer(mod)
        if isinstance(mod, nn.Sequential):
            fused += _fuse_sequential(mod)
    return fused
