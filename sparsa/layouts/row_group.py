"""The RowGroup layout: groups of ``group`` consecutive rows share one list of kept input columns.

A 2-D weight ``W`` (out ``R``, in ``K``) is cut into ``ceil(R / group)`` row groups; every group
keeps the same number ``k`` of input columns (sorted, shared by all its rows). This is the structure
the native CPU kernel needs to be fast: one gathered ``X`` column feeds ``group`` outputs with a single
vector FMA. Smaller groups come closer to unstructured accuracy, larger ones run faster.

Components:
    ``columns`` int32 ``(n_groups, k)`` sorted kept columns per group;
    ``values``  float ``(n_groups, k, group)`` -- ``values[g, j, r] = W[g*group + r, columns[g, j]]``
    (rows past ``R`` are zero padding).

Example::

    >>> import torch
    >>> from sparsa.layouts import RowGroup
    >>> w = torch.randn(32, 64)
    >>> rg = RowGroup.from_dense(w, group=16, sparsity=0.75)
    >>> rg.columns.shape, rg.values.shape, rg.density
    (torch.Size([2, 16]), torch.Size([2, 16, 16]), 0.25)
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Optional

import torch
from torch import Tensor

from .base import Layout, check_float, check_fraction, register_layout

__all__ = ["RowGroup", "row_group_mask", "GROUP_SIZES"]

#: group sizes the native kernel supports
GROUP_SIZES = (4, 8, 16, 32)


def _check_group(group: Any) -> int:
    if isinstance(group, bool) or not isinstance(group, int):
        raise TypeError(f"group must be an int in {GROUP_SIZES}, got {group!r}")
    if group not in GROUP_SIZES:
        raise ValueError(f"group must be one of {GROUP_SIZES} (rows sharing a column list), got {group}")
    return group


def _kept_count(in_features: int, sparsity: float) -> int:
    return max(1, int(round(in_features * (1.0 - sparsity))))


def _pad_rows(t: Tensor, group: int) -> Tensor:
    pad = (-t.shape[0]) % group
    if pad == 0:
        return t
    return torch.cat([t, t.new_zeros((pad,) + tuple(t.shape[1:]))], 0)


def _check_2d(dense: Tensor, arg: str = "dense") -> None:
    check_float(dense, arg)
    if dense.dim() != 2:
        raise ValueError(f"RowGroup stores 2-D weights (out_features, in_features); {arg} has shape "
                         f"{tuple(dense.shape)}; reshape it to 2-D first")


def _top_columns(dense: Tensor, k: int, group: int) -> Tensor:
    """Per group, the ``k`` columns with the largest L2 norm of the group's column slice (sorted)."""
    R, K = dense.shape
    ng = -(-R // group)
    score = _pad_rows(dense.detach().float(), group).view(ng, group, K).pow(2).sum(1)  # (ng, K)
    cols = score.topk(k, dim=1, sorted=False).indices
    return cols.sort(dim=1).values.to(torch.int32)


def row_group_mask(dense: Tensor, sparsity: float, group: int = 16) -> Tensor:
    """Boolean mask keeping, for every group of ``group`` rows, the same ``round(K*(1-sparsity))``
    input columns: those with the largest L2 norm over the group's rows.

    >>> import torch
    >>> m = row_group_mask(torch.randn(8, 10), sparsity=0.5, group=4)
    >>> m.sum(1).tolist()
    [5, 5, 5, 5, 5, 5, 5, 5]
    """
    _check_2d(dense)
    group = _check_group(group)
    s = check_fraction(sparsity, "sparsity")
    R, K = dense.shape
    ng = -(-R // group)
    cols = _top_columns(dense, _kept_count(K, s), group).long()
    mask = torch.zeros(ng, K, dtype=torch.bool, device=dense.device)
    mask.scatter_(1, cols, True)
    return mask.repeat_interleave(group, 0)[:R]


@register_layout
class RowGroup(Layout):
    """Row groups sharing a sorted list of kept input columns (see the module docstring).

    Build with :meth:`from_dense` (``sparsity=`` picks columns by group L2 norm; or an explicit
    group-shared ``mask``), or :func:`sparsa.to_sparse` ``(w, "row_group", sparsity=0.75)``.
    """

    name = "row_group"

    def __init__(self, columns: Tensor, values: Tensor, shape: Iterable[int], validate: bool = True):
        self.columns = columns
        self.values = values
        self.shape = torch.Size(shape)
        self.dtype = values.dtype
        if validate:
            self.validate()

    # ------------------------------------------------------------------ properties
    @property
    def group(self) -> int:
        return int(self.values.shape[2])

    @property
    def n_groups(self) -> int:
        return int(self.columns.shape[0])

    @property
    def kept(self) -> int:
        """Kept columns per group (``k``)."""
        return int(self.columns.shape[1])

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dense(cls, dense: Tensor, mask: Optional[Tensor] = None, group: int = 16,
                   sparsity: Optional[float] = None, **params: Any) -> "RowGroup":
        if params:
            raise TypeError(f"RowGroup takes group= and sparsity=, got unexpected {sorted(params)}")
        _check_2d(dense)
        group = _check_group(group)
        R, K = dense.shape
        ng = -(-R // group)
        if mask is None:
            if sparsity is None:
                raise ValueError("RowGroup.from_dense needs sparsity= (fraction of columns removed per row "
                                 "group, e.g. sparsity=0.75) or a group-shared mask=")
            cols = _top_columns(dense, _kept_count(K, check_fraction(sparsity, "sparsity")), group)
        else:
            if sparsity is not None:
                raise ValueError("pass either mask= or sparsity= to RowGroup.from_dense, not both")
            cols = _columns_from_mask(mask, dense.shape, group)
        gathered = _pad_rows(dense, group).view(ng, group, K).gather(
            2, cols.long()[:, None, :].expand(ng, group, cols.shape[1]))
        values = gathered.transpose(1, 2).contiguous()
        if mask is not None:  # padded columns of groups that keep fewer hold zeros
            keep = _pad_rows(mask.to(torch.bool), group).view(ng, group, K).any(1).gather(1, cols.long())
            values = values * keep[:, :, None].to(values.dtype)
        return cls(cols.contiguous(), values, dense.shape, validate=False)

    def to_dense(self) -> Tensor:
        R, K = self.shape
        ng, k, G = self.values.shape
        out = self.values.new_zeros(ng, G, K)
        out.scatter_(2, self.columns.long()[:, None, :].expand(ng, G, k), self.values.transpose(1, 2))
        return out.view(ng * G, K)[:R]

    def mask(self) -> Tensor:
        R, K = self.shape
        ng, G = self.n_groups, self.group
        m = torch.zeros(ng, K, dtype=torch.bool, device=self.columns.device)
        m.scatter_(1, self.columns.long(), True)
        return m.repeat_interleave(G, 0)[:R]

    @property
    def nnz(self) -> int:
        return self.kept * int(self.shape[0])

    def refill(self, dense: Tensor) -> "RowGroup":
        ng, k, G = self.values.shape
        K = self.shape[1]
        gathered = _pad_rows(dense.to(self.dtype), G).view(ng, G, K).gather(
            2, self.columns.long()[:, None, :].expand(ng, G, k))
        return RowGroup(self.columns, gathered.transpose(1, 2).contiguous(), self.shape, validate=False)

    # ------------------------------------------------------------------ protocol
    def components(self) -> Dict[str, Tensor]:
        return {"columns": self.columns, "values": self.values}

    def params(self) -> Dict[str, Any]:
        return {"group": self.group}

    @classmethod
    def from_components(cls, components: Dict[str, Tensor], shape: Iterable[int], group: Optional[int] = None,
                        **params: Any) -> "RowGroup":
        out = cls(components["columns"], components["values"], shape)
        if group is not None and out.group != group:
            raise ValueError(f"RowGroup: values has group size {out.group} but params say group={group}")
        return out

    def validate(self) -> None:
        c, v = self.columns, self.values
        if len(self.shape) != 2:
            raise ValueError(f"RowGroup: shape must be 2-D, got {tuple(self.shape)}")
        R, K = self.shape
        if c.dtype != torch.int32 or c.dim() != 2:
            raise ValueError(f"RowGroup: columns must be a 2-D int32 tensor, got {c.dtype} of shape {tuple(c.shape)}")
        if not v.dtype.is_floating_point or v.dim() != 3:
            raise ValueError(f"RowGroup: values must be a 3-D float tensor (n_groups, k, group), got {v.dtype} "
                             f"of shape {tuple(v.shape)}")
        G = v.shape[2]
        if G not in GROUP_SIZES:
            raise ValueError(f"RowGroup: group size (values.shape[2]) must be one of {GROUP_SIZES}, got {G}")
        ng = -(-R // G)
        if tuple(c.shape) != (ng, v.shape[1]) or v.shape[0] != ng:
            raise ValueError(f"RowGroup: expected columns {(ng, v.shape[1])} and values {(ng, v.shape[1], G)} for "
                             f"shape {(R, K)} and group {G}; got {tuple(c.shape)} and {tuple(v.shape)}")
        if c.numel() and _has_data(c):
            if int(c.min()) < 0 or int(c.max()) >= K:
                raise ValueError(f"RowGroup: columns must lie in [0, {K}), got range [{int(c.min())}, {int(c.max())}]")
            if c.shape[1] > 1 and not bool((c[:, 1:] > c[:, :-1]).all()):
                raise ValueError("RowGroup: columns must be strictly increasing within each group")


def _has_data(t: Tensor) -> bool:
    """False for fake/meta tensors (``torch.compile`` tracing): value checks are skipped there."""
    from torch._subclasses.fake_tensor import is_fake
    return t.device.type != "meta" and not is_fake(t)


def _columns_from_mask(mask: Tensor, shape: torch.Size, group: int) -> Tensor:
    if not isinstance(mask, Tensor) or tuple(mask.shape) != tuple(shape):
        got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a bool tensor of shape {tuple(shape)}, got {got}")
    R, K = shape
    mask = mask.to(torch.bool)
    ng = -(-R // group)
    padded = torch.cat([mask, mask[-1:].expand((-R) % group, K)], 0) if R % group else mask
    g = padded.view(ng, group, K)
    if not bool((g == g[:, :1]).all()):
        bad = int((g != g[:, :1]).any(2).any(1).nonzero()[0])
        raise ValueError(f"mask is not group-shared: rows {bad * group}..{min(R, (bad + 1) * group) - 1} keep "
                         f"different columns; RowGroup(group={group}) needs every row of a group to keep the same "
                         "columns (build one with sparsa.layouts.row_group_mask)")
    keep = g[:, 0]  # (ng, K)
    k = int(keep.sum(1).max()) if ng else 0
    # kept columns first (in order), then the first unused columns as zero-valued padding
    order = torch.arange(K, device=mask.device).expand(ng, K)
    key = torch.where(keep, order, order + K)
    cols = key.topk(k, dim=1, largest=False, sorted=False).indices if k else key[:, :0]
    return cols.sort(dim=1).values.to(torch.int32)
