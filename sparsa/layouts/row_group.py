"""The RowGroup layout: groups of ``group`` consecutive rows share one list of kept input columns.

A 2-D weight ``W`` (out ``R``, in ``K``) is cut into ``ceil(R / group)`` row groups; every group
keeps the same number ``k`` of input columns (sorted, shared by all its rows). This is the structure
the native CPU kernel needs to be fast: one gathered ``X`` column feeds ``group`` outputs with a single
vector FMA. Smaller groups come closer to unstructured accuracy, larger ones run faster.

Components:
    ``columns`` int32 ``(n_groups, k)`` sorted kept columns per group;
    ``values``  float ``(n_groups, k, group)`` -- ``values[g, j, r] = W[row_perm[g*group + r], columns[g, j]]``;
    ``row_perm`` int32 ``(n_groups * group,)`` -- the output row stored in each slot (values ``>= R``
    are zero padding rows). The identity keeps groups of consecutive rows; ``permute=True`` groups rows
    of similar column importance instead (see :mod:`sparsa.layouts._row_grouping`), which keeps more of
    the weight at the same speed (the kernel writes each output row to its permuted position).

Example::

    >>> import torch
    >>> from sparsa.layouts import RowGroup
    >>> w = torch.randn(32, 64)
    >>> rg = RowGroup.from_dense(w, group=16, sparsity=0.75)
    >>> rg.columns.shape, rg.values.shape, rg.density
    (torch.Size([2, 16]), torch.Size([2, 16, 16]), 0.25)
    >>> rp = RowGroup.from_dense(w, group=16, sparsity=0.75, permute=True)
    >>> bool(rp.to_dense().norm() >= rg.to_dense().norm())
    True
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional

import torch
from torch import Tensor

from ._row_grouping import group_rows
from .base import Layout, check_float, check_fraction, register_layout

__all__ = ["RowGroup", "row_group_mask", "is_identity_perm", "GROUP_SIZES"]

#: group sizes the native kernel supports
GROUP_SIZES = (4, 8, 16, 32)


def is_identity_perm(row_perm: Tensor) -> bool:
    """Whether a ``row_perm`` keeps every row in place (groups of consecutive rows)."""
    n = row_perm.numel()
    return torch.equal(row_perm, torch.arange(n, dtype=row_perm.dtype, device=row_perm.device))


def _check_group(group: Any) -> int:
    if isinstance(group, bool) or not isinstance(group, int):
        raise TypeError(f"group must be an int in {GROUP_SIZES}, got {group!r}")
    if group not in GROUP_SIZES:
        raise ValueError(f"group must be one of {GROUP_SIZES} (rows sharing a column list), got {group}")
    return group


def _kept_count(in_features: int, sparsity: float) -> int:
    return min(in_features, max(1, int(round(in_features * (1.0 - sparsity)))))  # 0 for an empty weight


def _pad_rows(t: Tensor, group: int) -> Tensor:
    pad = (-t.shape[0]) % group
    if pad == 0:
        return t
    return torch.cat([t, t.new_zeros((pad,) + tuple(t.shape[1:]))], 0)


def _check_2d(dense: Tensor, arg: str = "dense") -> None:
    check_float(dense, arg)
    if dense.dim() != 2:
        raise ValueError(
            f"RowGroup stores 2-D weights (out_features, in_features); {arg} has shape "
            f"{tuple(dense.shape)}; reshape it to 2-D first"
        )


def _importance(dense: Tensor, scores: Optional[Tensor]) -> Tensor:
    """Per-weight importance (squared score): ``W**2``, ``(|W| * scores)**2`` for per-input-feature
    ``scores`` of shape ``(K,)`` (Wanda's input norms), or ``scores**2`` for a full ``(R, K)`` score."""
    w = dense.detach().float()
    if scores is None:
        return w.pow(2)
    if not isinstance(scores, Tensor) or tuple(scores.shape) not in (tuple(dense.shape), (dense.shape[1],)):
        got = tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__
        raise ValueError(
            f"scores must be a tensor of shape {tuple(dense.shape)} (per weight) or ({dense.shape[1]},) "
            f"(per input feature, e.g. Wanda's input norms), got {got}"
        )
    s = scores.detach().float().to(w.device)
    return (w.abs() * s).pow(2) if s.dim() == 1 else s.pow(2)


def _top_columns(importance: Tensor, k: int, group: int) -> Tensor:
    """Per group of ``group`` consecutive rows, the ``k`` columns of largest summed ``importance`` (sorted)."""
    R, K = importance.shape
    ng = -(-R // group)
    score = _pad_rows(importance, group).view(ng, group, K).sum(1)  # (ng, K)
    cols = score.topk(k, dim=1, sorted=False).indices
    return cols.sort(dim=1).values.to(torch.int32)


def _plan(dense: Tensor, sparsity: float, group: int, permute: bool, scores: Optional[Tensor]):
    """``(row_perm int64 (R_pad,), columns int32 (n_groups, k))`` for magnitude (or ``scores``) selection."""
    R, K = dense.shape
    k = _kept_count(K, check_fraction(sparsity, "sparsity"))
    imp = _importance(dense, scores)
    if permute and K:  # no columns: nothing to group by
        perm = group_rows(imp, group, k).to(dense.device)
        return perm, _top_columns(imp[perm[:R]], k, group)  # padding slots are the last ones
    return torch.arange(R + (-R) % group, device=dense.device), _top_columns(imp, k, group)


def _check_permute(permute: Any) -> Optional[bool]:
    if permute is not None and not isinstance(permute, bool):
        raise TypeError(f"permute must be True, False or None, got {permute!r}")
    return permute


def row_group_mask(
    dense: Tensor, sparsity: float, group: int = 16, permute: bool = False, scores: Optional[Tensor] = None
) -> Tensor:
    """Boolean mask keeping, for every group of ``group`` rows, the same ``round(K*(1-sparsity))``
    input columns: those with the largest L2 norm over the group's rows (or the largest summed
    squared ``scores``, see :meth:`RowGroup.from_dense`). ``permute=True`` groups rows of similar
    importance instead of consecutive rows.

    >>> import torch
    >>> m = row_group_mask(torch.randn(8, 10), sparsity=0.5, group=4)
    >>> m.sum(1).tolist()
    [5, 5, 5, 5, 5, 5, 5, 5]
    """
    _check_2d(dense)
    group = _check_group(group)
    R, K = dense.shape
    perm, cols = _plan(dense, sparsity, group, bool(_check_permute(permute)), scores)
    ng = cols.shape[0]
    slots = torch.zeros(ng, K, dtype=torch.bool, device=dense.device)
    slots.scatter_(1, cols.long(), True)
    mask = torch.zeros(ng * group, K, dtype=torch.bool, device=dense.device)
    mask[perm] = slots.repeat_interleave(group, 0)
    return mask[:R]


@register_layout
class RowGroup(Layout):
    """Row groups sharing a sorted list of kept input columns (see the module docstring).

    Build with :meth:`from_dense` (``sparsity=`` picks columns by group L2 norm, ``permute=True``
    also chooses which rows share a group; or an explicit group-shared ``mask``), or
    :func:`sparsa.to_sparse` ``(w, "row_group", sparsity=0.75, permute=True)``.
    """

    name = "row_group"

    def __init__(
        self,
        columns: Tensor,
        values: Tensor,
        shape: Iterable[int],
        row_perm: Optional[Tensor] = None,
        validate: bool = True,
    ):
        self.columns = columns
        self.values = values
        self.shape = torch.Size(shape)
        self.dtype = values.dtype
        if row_perm is None:  # consecutive rows (also what checkpoints written before row_perm hold)
            row_perm = torch.arange(values.shape[0] * values.shape[2], dtype=torch.int32, device=columns.device)
        self.row_perm = row_perm
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

    @property
    def permuted(self) -> bool:
        """Whether groups hold other than consecutive rows (``row_perm`` is not the identity)."""
        return not is_identity_perm(self.row_perm)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dense(
        cls,
        dense: Tensor,
        mask: Optional[Tensor] = None,
        group: int = 16,
        sparsity: Optional[float] = None,
        permute: Optional[bool] = None,
        scores: Optional[Tensor] = None,
        **params: Any,
    ) -> "RowGroup":
        """Store ``dense`` (R, K) keeping ``sparsity`` of the columns of every row group, or ``mask``.

        ``permute``: with ``sparsity``, True groups rows of similar column importance (more of the
        weight kept; about a second for a 3072 x 768 weight), False/None consecutive rows. With a
        ``mask``, None (default) accepts masks shared by consecutive rows or, failing that, by some
        grouping of rows (recovered from the mask); False requires consecutive rows.
        ``scores``: importance used instead of ``|W|`` -- shape ``(R, K)``, or ``(K,)`` per input
        feature (multiplies ``|W|``, as Wanda's input norms).

        >>> import torch
        >>> w = torch.randn(64, 32)
        >>> RowGroup.from_dense(w, group=8, sparsity=0.5, permute=True).permuted
        True
        """
        if params:
            raise TypeError(f"RowGroup takes group=, sparsity=, permute= and scores=, got unexpected {sorted(params)}")
        _check_2d(dense)
        group = _check_group(group)
        permute = _check_permute(permute)
        R, K = dense.shape
        ng = -(-R // group)
        if mask is None:
            if sparsity is None:
                raise ValueError(
                    "RowGroup.from_dense needs sparsity= (fraction of columns removed per row "
                    "group, e.g. sparsity=0.75) or a group-shared mask="
                )
            perm, cols = _plan(dense, sparsity, group, bool(permute), scores)
            slot_mask = None
        else:
            if sparsity is not None:
                raise ValueError("pass either mask= or sparsity= to RowGroup.from_dense, not both")
            if scores is not None:
                raise ValueError("scores= only applies with sparsity=; the mask already fixes the kept columns")
            _check_mask_shape(mask, dense.shape)
            mask = mask.to(torch.bool)
            perm = _perm_from_mask(mask, group, permute)
            slot_mask = mask[perm[:R]]
            cols = _columns_from_mask(slot_mask, group)
        gathered = (
            _pad_rows(dense, group)[perm]
            .view(ng, group, K)
            .gather(2, cols.long()[:, None, :].expand(ng, group, cols.shape[1]))
        )
        values = gathered.transpose(1, 2).contiguous()
        if slot_mask is not None:  # padded columns of groups that keep fewer hold zeros
            keep = _pad_rows(slot_mask, group).view(ng, group, K).any(1).gather(1, cols.long())
            values = values * keep[:, :, None].to(values.dtype)
        return cls(cols.contiguous(), values, dense.shape, perm.to(torch.int32), validate=False)

    def _scatter_rows(self, slots: Tensor) -> Tensor:
        """Rows in slot order ``(n_groups * group, ...)`` -> logical row order ``(R, ...)``."""
        out = slots.new_zeros(slots.shape)
        out[self.row_perm.long()] = slots
        return out[: self.shape[0]]

    def to_dense(self) -> Tensor:
        R, K = self.shape
        ng, k, G = self.values.shape
        out = self.values.new_zeros(ng, G, K)
        out.scatter_(2, self.columns.long()[:, None, :].expand(ng, G, k), self.values.transpose(1, 2))
        return self._scatter_rows(out.view(ng * G, K))

    def mask(self) -> Tensor:
        K = self.shape[1]
        ng, G = self.n_groups, self.group
        m = torch.zeros(ng, K, dtype=torch.bool, device=self.columns.device)
        m.scatter_(1, self.columns.long(), True)
        return self._scatter_rows(m.repeat_interleave(G, 0))

    @property
    def nnz(self) -> int:
        return self.kept * int(self.shape[0])

    def refill(self, dense: Tensor) -> "RowGroup":
        ng, k, G = self.values.shape
        K = self.shape[1]
        gathered = (
            _pad_rows(dense.to(self.dtype), G)[self.row_perm.long()]
            .view(ng, G, K)
            .gather(2, self.columns.long()[:, None, :].expand(ng, G, k))
        )
        return RowGroup(self.columns, gathered.transpose(1, 2).contiguous(), self.shape, self.row_perm, validate=False)

    # ------------------------------------------------------------------ protocol
    def components(self) -> Dict[str, Tensor]:
        return {"columns": self.columns, "values": self.values, "row_perm": self.row_perm}

    def params(self) -> Dict[str, Any]:
        return {"group": self.group}

    @classmethod
    def from_components(
        cls, components: Dict[str, Tensor], shape: Iterable[int], group: Optional[int] = None, **params: Any
    ) -> "RowGroup":
        out = cls(components["columns"], components["values"], shape, components.get("row_perm"))
        if group is not None and out.group != group:
            raise ValueError(f"RowGroup: values has group size {out.group} but params say group={group}")
        return out

    def validate(self) -> None:
        c, v, p = self.columns, self.values, self.row_perm
        if len(self.shape) != 2:
            raise ValueError(f"RowGroup: shape must be 2-D, got {tuple(self.shape)}")
        R, K = self.shape
        if c.dtype != torch.int32 or c.dim() != 2:
            raise ValueError(f"RowGroup: columns must be a 2-D int32 tensor, got {c.dtype} of shape {tuple(c.shape)}")
        if not v.dtype.is_floating_point or v.dim() != 3:
            raise ValueError(
                f"RowGroup: values must be a 3-D float tensor (n_groups, k, group), got {v.dtype} "
                f"of shape {tuple(v.shape)}"
            )
        G = v.shape[2]
        if G not in GROUP_SIZES:
            raise ValueError(f"RowGroup: group size (values.shape[2]) must be one of {GROUP_SIZES}, got {G}")
        ng = -(-R // G)
        if tuple(c.shape) != (ng, v.shape[1]) or v.shape[0] != ng:
            raise ValueError(
                f"RowGroup: expected columns {(ng, v.shape[1])} and values {(ng, v.shape[1], G)} for "
                f"shape {(R, K)} and group {G}; got {tuple(c.shape)} and {tuple(v.shape)}"
            )
        if p.dtype != torch.int32 or tuple(p.shape) != (ng * G,):
            raise ValueError(
                f"RowGroup: row_perm must be an int32 tensor of shape ({ng * G},) (the row held by each "
                f"slot), got {p.dtype} of shape {tuple(p.shape)}"
            )
        if c.numel() and _has_data(c):
            if int(c.min()) < 0 or int(c.max()) >= K:
                raise ValueError(f"RowGroup: columns must lie in [0, {K}), got range [{int(c.min())}, {int(c.max())}]")
            if c.shape[1] > 1 and not bool((c[:, 1:] > c[:, :-1]).all()):
                raise ValueError("RowGroup: columns must be strictly increasing within each group")
        if p.numel() and _has_data(p):
            if not torch.equal(p.sort().values, torch.arange(p.numel(), dtype=p.dtype, device=p.device)):
                raise ValueError(
                    f"RowGroup: row_perm must be a permutation of 0..{p.numel() - 1} (values >= {R} mark padding slots)"
                )


def _has_data(t: Tensor) -> bool:
    """False for fake/meta tensors (``torch.compile`` tracing): value checks are skipped there."""
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type != "meta" and not is_fake(t)


def _check_mask_shape(mask: Any, shape: torch.Size) -> None:
    if not isinstance(mask, Tensor) or tuple(mask.shape) != tuple(shape):
        got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a bool tensor of shape {tuple(shape)}, got {got}")


def _slot_groups(mask: Tensor, group: int) -> Tensor:
    """``(n_groups, group, K)`` view of a (R, K) mask in slot order, padding rows copying the last row."""
    R, K = mask.shape
    padded = torch.cat([mask, mask[-1:].expand((-R) % group, K)], 0) if R % group else mask
    return padded.view(padded.shape[0] // group, group, K)  # explicit: K == 0 leaves -1 ambiguous


def _perm_from_mask(mask: Tensor, group: int, permute: Optional[bool]) -> Tensor:
    """The row permutation under which ``mask`` is shared by the rows of every group (identity when
    consecutive rows already share it; ``permute=False`` requires that)."""
    R, K = mask.shape
    n = R + (-R) % group
    identity = torch.arange(n, device=mask.device)
    g = _slot_groups(mask, group)
    same = g == g[:, :1]
    if bool(same.all()):
        return identity
    if permute is False:
        bad = int((~same).any(2).any(1).nonzero()[0])
        raise ValueError(
            f"mask is not group-shared: rows {bad * group}..{min(R, (bad + 1) * group) - 1} keep "
            f"different columns; RowGroup(group={group}, permute=False) needs every group of {group} "
            "consecutive rows to keep the same columns (build one with sparsa.layouts.row_group_mask, "
            "or pass permute=None to let rows with equal patterns form the groups)"
        )
    _, inv = torch.unique(mask, dim=0, return_inverse=True)
    counts = torch.bincount(inv)
    partial = (counts % group).nonzero().flatten()
    if partial.numel() > (1 if R % group else 0) or (partial.numel() and int(counts[partial[0]]) % group != R % group):
        raise ValueError(
            f"mask is not group-shared: its {R} rows have {counts.numel()} distinct patterns and "
            f"cannot be split into groups of {group} equal rows (at most one partial group of "
            f"{R % group} rows); RowGroup(group={group}) needs every row of a group to keep the same "
            "columns (build one with sparsa.layouts.row_group_mask, permute=True to group similar rows)"
        )
    order = inv.argsort(stable=True)
    if partial.numel():  # the leftover rows of the one partial pattern go last, next to the padding
        rows_p = order[inv[order] == partial[0]]
        tail = rows_p[int(counts[partial[0]]) - R % group :]
        rest = torch.ones(R, dtype=torch.bool, device=mask.device)
        rest[tail] = False
        order = torch.cat([order[rest[order]], tail])
    return torch.cat([order, identity[R:]])


def _columns_from_mask(slot_mask: Tensor, group: int) -> Tensor:
    """Sorted kept columns per group of a mask whose groups (in slot order) share their rows' pattern."""
    R, K = slot_mask.shape
    keep = _slot_groups(slot_mask, group)[:, 0]  # (ng, K)
    ng = keep.shape[0]
    k = int(keep.sum(1).max()) if ng else 0
    # kept columns first (in order), then the first unused columns as zero-valued padding
    order = torch.arange(K, device=slot_mask.device).expand(ng, K)
    key = torch.where(keep, order, order + K)
    cols = key.topk(k, dim=1, largest=False, sorted=False).indices if k else key[:, :0]
    return cols.sort(dim=1).values.to(torch.int32)
