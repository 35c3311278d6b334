"""Grouping the output rows of a weight so that rows sharing one column list want the same columns.

The :class:`~sparsa.layouts.RowGroup` layout makes ``group`` rows share ``k`` kept input columns. With
rows taken in their natural order the shared list is a poor fit (neighbouring rows of a trained weight
have unrelated column importance). :func:`group_rows` instead chooses which rows form each group, to
maximise the importance kept under the shared-pattern constraint::

    kept(perm) = sum over groups g of  top-k sum over columns of  sum_{r in g} importance[r, :]

Algorithm (about a second for a BERT-size 3072 x 768 weight):

1. *Recursive bisection*: split the (L2-normalised) square-rooted importance rows along their leading
   principal direction into two halves whose sizes are multiples of ``group``; recurse. Rows with
   similar importance profiles end up in the same leaf group.
2. *Refinement* (a balanced k-means): given each group's current top-``k`` columns, the gain of row
   ``r`` in group ``g`` is the importance of ``r`` on ``g``'s columns; reassign rows to groups with
   exactly ``group`` rows each (greedy: rows propose their best open group, groups accept their
   best proposers), recompute the columns, repeat; the best permutation seen is returned.

Example::

    >>> import torch
    >>> from sparsa.layouts._row_grouping import group_rows, kept_importance
    >>> imp = torch.rand(64, 32)
    >>> perm = group_rows(imp, group=8, kept=8)
    >>> sorted(perm.tolist()) == list(range(64))
    True
    >>> kept_importance(imp, perm, 8, 8) >= kept_importance(imp, torch.arange(64), 8, 8)
    True
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["group_rows", "kept_importance"]


def _padded(importance: Tensor, group: int) -> Tensor:
    pad = (-importance.shape[0]) % group
    return importance if pad == 0 else torch.cat([importance, importance.new_zeros(pad, importance.shape[1])])


def kept_importance(importance: Tensor, perm: Tensor, group: int, kept: int) -> float:
    """Total importance kept when slot ``i`` holds row ``perm[i]`` (``perm`` values past the last row
    are zero padding) and every group keeps its ``kept`` best columns."""
    imp = _padded(importance.detach().double(), group)
    return float(_group_sums(imp, perm.long(), group).topk(kept, dim=1).values.sum())


def _group_sums(imp: Tensor, perm: Tensor, group: int) -> Tensor:
    return imp[perm].view(perm.numel() // group, group, imp.shape[1]).sum(1)  # explicit: K may be 0


def _bisect(x: Tensor, rows: Tensor, group: int, out: list, gen: torch.Generator) -> None:
    """Append ``rows`` to ``out`` ordered by recursive bisection into pieces of ``group`` rows (the
    last piece may be short)."""
    n = rows.numel()
    if n <= group:
        out.append(rows)
        return
    sub = x[rows]
    sub = sub - sub.mean(0)
    v = torch.randn(x.shape[1], generator=gen, dtype=x.dtype)
    for _ in range(6):  # power iteration: leading principal direction
        v = sub.t() @ (sub @ v)
        v = v / v.norm().clamp_min(1e-30)
    order = rows[(sub @ v).argsort()]
    left = (-(-n // group) // 2) * group
    _bisect(x, order[:left], group, out, gen)
    _bisect(x, order[left:], group, out, gen)


def _assign(gain: Tensor, capacity: Tensor) -> Tensor:
    """Balanced greedy assignment: every row to one group, ``capacity[g]`` rows in group ``g``.

    Rounds: each unassigned row proposes its best group with room left; each group accepts its
    best proposers up to its remaining capacity.
    """
    R, ng = gain.shape
    assign = torch.full((R,), -1, dtype=torch.long)
    cap = capacity.clone()
    free = torch.arange(R)
    while free.numel():
        open_g = (cap > 0).nonzero().squeeze(1)
        val, best = gain[free][:, open_g].max(1)
        best = open_g[best]
        # sort proposals by group, then by gain (descending) inside a group
        order = torch.argsort(val, descending=True, stable=True)
        order = order[torch.argsort(best[order], stable=True)]
        g_sorted = best[order]
        first = torch.searchsorted(g_sorted, g_sorted, right=False)
        rank = torch.arange(order.numel()) - first
        ok = rank < cap[g_sorted]
        rows, gs = free[order[ok]], g_sorted[ok]
        assign[rows] = gs
        cap -= torch.bincount(gs, minlength=ng)
        free = (assign < 0).nonzero().squeeze(1)
    return assign


def group_rows(importance: Tensor, group: int, kept: int, iters: int = 8, seed: int = 0) -> Tensor:
    """A row permutation (int64, length ``R`` rounded up to a multiple of ``group``; slot ``i`` holds
    row ``perm[i]``; the padding slots ``R, R+1, ...`` come last) grouping rows of similar ``importance``
    (non-negative, ``(R, K)``, e.g. ``W**2``) so that ``group`` consecutive slots sharing their
    ``kept`` best columns keep as much importance as possible (see the module docstring)."""
    if importance.dim() != 2:
        raise ValueError(f"importance must be 2-D (out_features, in_features), got shape {tuple(importance.shape)}")
    imp = importance.detach().double().clamp_min(0)
    R, K = imp.shape
    n = R + (-R) % group
    ng = n // group
    kept = max(1, min(int(kept), K))
    identity = torch.arange(n)
    if R <= group or kept == K:
        return identity
    padded = _padded(imp, group)
    capacity = torch.full((ng,), group, dtype=torch.long)
    capacity[-1] -= n - R  # padding rows fill the end of the last group
    x = imp.sqrt()
    x = x / x.norm(dim=1, keepdim=True).clamp_min(1e-30)
    pieces: list = []
    _bisect(x, identity[:R], group, pieces, torch.Generator().manual_seed(seed))
    perm = torch.cat(pieces + [identity[R:]])
    best_perm, best = identity, kept_importance(padded, identity, group, kept)
    stale = 0
    for it in range(iters + 1):
        score = kept_importance(padded, perm, group, kept)
        if score > best * (1 + 1e-9):
            best_perm, best, stale = perm, score, 0
        elif it > 0:
            stale += 1
            if stale >= 2:  # the greedy step is not monotone: allow one non-improving step
                break
        if it == iters:
            break
        cols = _group_sums(padded, perm, group).topk(kept, dim=1).indices
        chosen = torch.zeros(ng, K, dtype=imp.dtype).scatter_(1, cols, 1.0)
        rows = _assign(imp @ chosen.t(), capacity).argsort(stable=True)
        perm = torch.cat([rows, identity[R:]])
    return best_perm
