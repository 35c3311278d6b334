"""Small private helpers shared by the layouts: padding, mask checks, parameter checks."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor


def ceil_to(x: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``x``."""
    return -(-x // multiple) * multiple


def pad_dims(t: Tensor, sizes: Sequence[int], value: float = 0) -> Tensor:
    """Pad the trailing ``len(sizes)`` dims of ``t`` at their end up to ``sizes`` (no copy if equal)."""
    k = len(sizes)
    cur = t.shape[t.dim() - k :]
    if tuple(cur) == tuple(sizes):
        return t
    out = t.new_full(tuple(t.shape[: t.dim() - k]) + tuple(sizes), value)
    out[(...,) + tuple(slice(0, c) for c in cur)] = t
    return out


def check_mask(mask: Optional[Tensor], dense: Tensor, who: str) -> Optional[Tensor]:
    """Validate a user mask: same shape as ``dense``; returned as bool on dense's device."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(f"{who}: mask must be a bool tensor, got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(dense.shape):
        raise ValueError(
            f"{who}: mask has shape {tuple(mask.shape)} but dense has {tuple(dense.shape)}; "
            "pass a mask of the same shape"
        )
    return mask.to(device=dense.device, dtype=torch.bool)


def check_ndim(dense: Tensor, who: str, exact: Optional[int] = None, minimum: int = 1) -> None:
    if exact is not None and dense.dim() != exact:
        raise ValueError(
            f"{who} stores {exact}-D tensors, got shape {tuple(dense.shape)}; "
            f"reshape it to {exact}-D first or use the COO/Masked layout"
        )
    if dense.dim() < minimum:
        raise ValueError(f"{who} needs at least {minimum} dim(s), got shape {tuple(dense.shape)}")


def check_nm(n: object, m: object, who: str) -> Tuple[int, int]:
    """Validate an n:m pair (0 < n < m, integers)."""
    if isinstance(n, bool) or isinstance(m, bool) or not isinstance(n, int) or not isinstance(m, int):
        raise TypeError(f"{who}: n and m must be integers, got n={n!r}, m={m!r}")
    if n <= 0 or n >= m:
        raise ValueError(f"{who}: need 0 < n < m (keep n of every m values), got n={n}, m={m}; e.g. n=2, m=4")
    return n, m


def check_int_tensor(t: Tensor, name: str, who: str, dtypes: Tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, Tensor):
        raise ValueError(f"{who}: component {name!r} must be a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ValueError(f"{who}: component {name!r} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")


def check_values(t: Tensor, name: str, who: str, shape: Tuple[int, ...]) -> None:
    if not isinstance(t, Tensor):
        raise ValueError(f"{who}: component {name!r} must be a tensor, got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise ValueError(f"{who}: component {name!r} must be floating point, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{who}: component {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def check_shape(t: Tensor, name: str, who: str, shape: Tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{who}: component {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def check_crow(crow: Tensor, rows: int, nnz: int, who: str, name: str = "crow_indices") -> None:
    """Compressed row pointer checks: shape, starts at 0, ends at nnz, non-decreasing."""
    check_int_tensor(crow, name, who, (torch.int64,))
    check_shape(crow, name, who, (rows + 1,))
    if int(crow[0]) != 0:
        raise ValueError(f"{who}: component {name!r} must start at 0, got {int(crow[0])}")
    if int(crow[-1]) != nnz:
        raise ValueError(
            f"{who}: component {name!r} must end at the number of stored entries {nnz}, got {int(crow[-1])}"
        )
    if rows and bool((crow[1:] < crow[:-1]).any()):
        raise ValueError(f"{who}: component {name!r} must be non-decreasing")


def check_sorted_cols(col: Tensor, row_ids: Tensor, ncols: int, who: str, name: str = "col_indices") -> None:
    """Column indices in range and strictly increasing within each row (sorted, no duplicates)."""
    if col.numel() == 0:
        return
    if bool((col < 0).any()) or bool((col >= ncols).any()):
        raise ValueError(
            f"{who}: component {name!r} has out-of-range indices (need 0 <= i < {ncols}), "
            f"got min {int(col.min())}, max {int(col.max())}"
        )
    same_row = row_ids[1:] == row_ids[:-1]
    if bool(((col[1:] <= col[:-1]) & same_row).any()):
        raise ValueError(f"{who}: component {name!r} must be sorted (strictly increasing) within each row")


def row_ids_from_crow(crow: Tensor, nnz: int) -> Tensor:
    """The row of each of the ``nnz`` entries of compressed row offsets ``crow``. ``nnz`` (the column
    indices' length) fixes the output size, which torch.compile cannot read from ``crow``'s data."""
    rows = crow.numel() - 1
    return torch.repeat_interleave(torch.arange(rows, device=crow.device), crow.diff(), output_size=nnz)
