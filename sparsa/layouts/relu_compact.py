"""The ReluCompact layout: a ReLU activation compacted for the activation-sparse training kernels.

It stores ``relu(x)`` of an ``[N, C, H, W]`` activation (or of a ``[P, K]`` Linear input, seen as the
image ``[1, K, P, 1]``) as *sliced padded CSR over pixels*, the operand of
:mod:`sparsa.kernels.adaptive`: for every pixel ``q`` (one row of the implicit im2col matrix, or one
row of the Linear input) and every slice ``s`` of ``slice`` channels, the ascending channel indices
and the values of the positive entries. The ReLU is fused into :meth:`ReluCompact.from_dense`: only
positive values are kept, so the layout represents ``relu(x)``, never a negative value.

Components (``P`` pixels, ``C`` channels, ``S = ceil(C / slice)`` slices):
    ``cnt`` int32 ``(P * S,)`` -- nonzeros of pixel ``q``, slice ``s`` at ``cnt[q * S + s]``;
    ``idx`` int32 ``(P * C + 8,)`` -- their channels, at ``idx[q * C + s * slice : ... + cnt]``;
    ``val`` float ``(P * C + 8,)`` -- their values (positive), at the same positions.
Entries past a count (and the 8 entries of tail room the vector kernels read) are zero.

``F.conv2d`` / ``F.linear`` with a :class:`~sparsa.SparseTensor` of this layout as the input run the
activation-sparse kernels (:mod:`sparsa.ops.activation_impls`).

Example::

    >>> import torch
    >>> from sparsa.layouts import ReluCompact
    >>> x = torch.tensor([[[[1.0]], [[-2.0]], [[0.0]], [[3.0]]]])   # [N=1, C=4, H=1, W=1]
    >>> a = ReluCompact.from_dense(x)
    >>> a.nnz, a.density
    (2, 0.5)
    >>> torch.equal(a.to_dense(), x.relu())
    True
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple

import torch
from torch import Tensor

from ..kernels import adaptive as _k
from .base import Layout, check_float, register_conversion, register_layout
from .masked import Masked
from .row_group import _has_data

__all__ = ["ReluCompact", "DEFAULT_SLICE"]

#: channels per slice (the K-slice of the sparse GEMMs)
DEFAULT_SLICE = 128
_PAD = 8  # tail room of idx/val read by the vector kernels


def _image(shape: Tuple[int, ...]) -> Tuple[int, int, int, int]:
    """``(N, C, H, W)`` of the operand: an ``[N, C, H, W]`` activation, or ``[P, K]`` as ``[1, K, P, 1]``."""
    if len(shape) == 4:
        return tuple(int(s) for s in shape)  # type: ignore[return-value]
    if len(shape) == 2:
        return 1, int(shape[1]), int(shape[0]), 1
    raise ValueError(
        f"ReluCompact stores an [N, C, H, W] activation or a [P, K] matrix, got shape {tuple(shape)}; "
        "flatten the leading dimensions of a Linear input first"
    )


def _as_image(x: Tensor) -> Tensor:
    """``x`` viewed as the operand's logical ``[N, C, H, W]`` (a view, no copy)."""
    return x if x.dim() == 4 else x.t().unsqueeze(0).unsqueeze(-1)


def _from_image(out: Tensor, shape: Tuple[int, ...]) -> Tensor:
    """An operand-image result ``[N, C, H, W]`` back in the layout's logical shape (inverse of :func:`_as_image`)."""
    return out if len(shape) == 4 else out[0, :, :, 0].t()


def _check_slice(slice: Any) -> int:
    if isinstance(slice, bool) or not isinstance(slice, int) or slice < 1:
        raise ValueError(f"slice must be a positive number of channels, got {slice!r}; e.g. slice=64")
    return slice


def _valid(cnt: Tensor, P: int, C: int, slice: int) -> Tensor:
    """Bool ``[P, C]``: which of the ``P * C`` idx/val entries lie inside a count."""
    S = -(-C // slice)
    full, rem = C // slice, C % slice
    c2 = cnt.view(P, S)
    # broadcast compares per slice (a gather of each channel's count was 5x slower)
    parts = []
    if full:
        j = torch.arange(slice, device=cnt.device, dtype=cnt.dtype)
        parts.append((j.view(1, 1, slice) < c2[:, :full].unsqueeze(-1)).view(P, full * slice))
    if rem:
        j = torch.arange(rem, device=cnt.device, dtype=cnt.dtype)
        parts.append(j.view(1, rem) < c2[:, full:])
    if not parts:
        return torch.zeros(P, C, dtype=torch.bool, device=cnt.device)
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


@register_layout
class ReluCompact(Layout):
    """``relu(x)`` compacted per (pixel, channel slice) (see the module docstring).

    Build it with :meth:`from_dense` (``slice=`` channels per slice) or ``sparsa.to_sparse(x,
    "relu_compact")``; :func:`sparsa.adaptive.compact` is the same for ``[N, C, H, W]`` activations.
    """

    name = "relu_compact"

    def __init__(
        self,
        cnt: Tensor,
        idx: Tensor,
        val: Tensor,
        shape: Iterable[int],
        slice: int = DEFAULT_SLICE,
        validate: bool = True,
    ):
        self.cnt = cnt
        self.idx = idx
        self.val = val
        self.shape = torch.Size(shape)
        self.dtype = val.dtype
        self.slice = int(slice)
        if validate:
            self.validate()

    # ------------------------------------------------------------------ build / read
    @classmethod
    def from_dense(
        cls, dense: Tensor, mask: Optional[Tensor] = None, slice: int = DEFAULT_SLICE, **params: Any
    ) -> "ReluCompact":
        """``relu(dense)`` compacted; with ``mask``, ``relu(dense)`` at the kept positions only. A mask that
        keeps a negative value is a ValueError: this layout cannot store it."""
        if params:
            raise TypeError(f"ReluCompact takes mask= and slice=, got unexpected {sorted(params)}")
        check_float(dense, "dense")
        slice = _check_slice(slice)
        _image(dense.shape)
        if mask is not None:
            if not isinstance(mask, Tensor) or mask.shape != dense.shape:
                got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
                raise ValueError(f"mask must be a bool tensor of shape {tuple(dense.shape)}, got {got}")
            mask = mask.to(torch.bool)
            if _has_data(mask) and bool((mask & (dense < 0)).any()):
                raise ValueError(
                    "mask keeps negative values of dense, but ReluCompact stores relu(x) (positive "
                    "values only); pass mask=None to store relu(dense), drop the negative positions "
                    "from the mask, or use the 'masked' layout for signed values"
                )
            dense = torch.where(mask, dense, torch.zeros((), dtype=dense.dtype, device=dense.device))
        if dense.device.type != "cpu":
            # the compaction kernels and their fallbacks run on the CPU; the components move back
            return cls.from_dense(dense.detach().cpu(), slice=slice).to(dense.device)
        cnt, idx, val = _k.compact_zeroed(_as_image(dense.detach()), slice)
        return cls(cnt, idx, val, dense.shape, slice, validate=False)

    def to_dense(self) -> Tensor:
        """``relu(x)`` of the logical shape (an ``[N, C, H, W]`` result has channels-last strides)."""
        return _from_image(_k.to_dense(self.cnt, self.idx, self.val, list(_image(self.shape)), self.slice), self.shape)

    def mask(self) -> Tensor:
        return self.to_dense() != 0

    def restrict(self, dense: Tensor) -> Tensor:
        """``dense`` kept where ``relu(x) > 0`` (0 elsewhere, NaN and inf too): the ReLU derivative,
        applied by the native masking kernel over ``(cnt, idx)`` without rebuilding ``mask()``."""
        if tuple(dense.shape) != tuple(self.shape):
            raise ValueError(
                f"restrict: dense must have the layout's shape {tuple(self.shape)}, got {tuple(dense.shape)}"
            )
        return _from_image(_k.restrict(self.cnt, self.idx, _as_image(dense), self.slice), self.shape)

    @property
    def nnz(self) -> int:
        return int(self.cnt.sum(dtype=torch.int64))

    def refill(self, dense: Tensor) -> "ReluCompact":
        """Same pattern, values from ``dense``; a ValueError when one of them is negative."""
        return ReluCompact.from_dense(dense.to(self.dtype), mask=self.mask(), slice=self.slice)

    # ------------------------------------------------------------------ protocol
    def params(self) -> Dict[str, Any]:
        return {"slice": self.slice}

    def components(self) -> Dict[str, Tensor]:
        return {"cnt": self.cnt, "idx": self.idx, "val": self.val}

    @classmethod
    def from_components(
        cls, components: Dict[str, Tensor], shape: Iterable[int], slice: int = DEFAULT_SLICE, **params: Any
    ) -> "ReluCompact":
        if params:
            raise TypeError(f"ReluCompact has the parameter slice only, got {sorted(params)}")
        c = components
        return cls(c["cnt"], c["idx"], c["val"], shape, _check_slice(slice))

    def validate(self) -> None:
        N, C, H, W = _image(self.shape)
        _check_slice(self.slice)
        P, S = N * H * W, -(-C // self.slice)
        cnt, idx, val = self.cnt, self.idx, self.val
        if cnt.dtype != torch.int32 or tuple(cnt.shape) != (P * S,):
            raise ValueError(f"ReluCompact: cnt must be int32 of shape ({P * S},), got {cnt.dtype} {tuple(cnt.shape)}")
        n = P * C + _PAD
        if idx.dtype != torch.int32 or tuple(idx.shape) != (n,):
            raise ValueError(f"ReluCompact: idx must be int32 of shape ({n},), got {idx.dtype} {tuple(idx.shape)}")
        if not val.dtype.is_floating_point or tuple(val.shape) != (n,):
            raise ValueError(
                f"ReluCompact: val must be a float tensor of shape ({n},), got {val.dtype} {tuple(val.shape)}"
            )
        if not (_has_data(cnt) and _has_data(idx) and _has_data(val)):
            return
        if S:
            width = torch.clamp(C - torch.arange(S, device=cnt.device) * self.slice, max=self.slice)
            c2 = cnt.view(P, S)
            if bool((c2 < 0).any()) or bool((c2 > width.to(cnt.dtype)).any()):
                raise ValueError(f"ReluCompact: cnt must lie in [0, channels of the slice] (slice={self.slice}, C={C})")
        keep = _valid(cnt, P, C, self.slice) if P * C else torch.zeros(P, C, dtype=torch.bool)
        i2, v2 = idx[: P * C].view(P, C), val[: P * C].view(P, C)
        if bool(i2[~keep].any()) or bool(v2[~keep].any()) or bool(idx[P * C :].any()) or bool(val[P * C :].any()):
            raise ValueError("ReluCompact: idx/val entries past a count must be zero")
        if not bool((v2[keep] > 0).all()):
            raise ValueError("ReluCompact: stored values must be positive (the layout stores relu(x))")
        ch = torch.arange(C, device=idx.device)
        base = (ch - ch % self.slice).view(1, C).expand(P, C)
        lo = base[keep]
        got = i2[keep].to(torch.int64)
        if bool((got < lo).any()) or bool((got >= torch.clamp(lo + self.slice, max=C)).any()):
            raise ValueError("ReluCompact: idx must name a channel of its own slice")
        if C > 1:
            # ascending within each list: the next entry of the same list holds a larger channel
            inner = keep[:, 1:] & ((ch[1:] % self.slice) != 0).view(1, C - 1)
            if not bool((i2[:, 1:] > i2[:, :-1])[inner].all()):
                raise ValueError("ReluCompact: channel indices must be strictly increasing within each list")


def relu_compact_to_masked(x: ReluCompact) -> Masked:
    """ReluCompact -> Masked (the layout of the GPU activation-sparse kernels)."""
    d = x.to_dense()
    return Masked(d, d != 0, validate=False)


def masked_to_relu_compact(x: Masked) -> ReluCompact:
    """Masked -> ReluCompact; a ValueError when the Masked tensor keeps a negative value."""
    return ReluCompact.from_dense(x.values, mask=x.mask())


register_conversion(ReluCompact, Masked, relu_compact_to_masked, cost=1.0)
register_conversion(Masked, ReluCompact, masked_to_relu_compact, cost=1.0)
