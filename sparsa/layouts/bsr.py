"""The BSR layout: compressed rows of dense ``(bh, bw)`` blocks for 2-D tensors."""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple

import torch
from torch import Tensor

from ._padding import (
    ceil_to,
    check_crow,
    check_int_tensor,
    check_mask,
    check_ndim,
    check_shape,
    check_sorted_cols,
    check_values,
    pad_dims,
    row_ids_from_crow,
)
from .base import Layout, check_float, register_layout


def _check_blocksize(blocksize: Any) -> Tuple[int, int]:
    try:
        bh, bw = (int(b) for b in blocksize)
        ok = all(isinstance(b, int) and not isinstance(b, bool) for b in blocksize)
    except (TypeError, ValueError):
        raise TypeError(f"BSR: blocksize must be a pair of ints (bh, bw), got {blocksize!r}") from None
    if not ok or bh <= 0 or bw <= 0:
        raise ValueError(f"BSR: blocksize must be two positive ints, got {blocksize!r}; e.g. blocksize=(4, 4)")
    return bh, bw


def _to_blocks(t: Tensor, bh: int, bw: int) -> Tensor:
    """(R, K) padded to block multiples -> (BR, BC, bh, bw)."""
    rp, kp = ceil_to(t.shape[0], bh), ceil_to(t.shape[1], bw)
    t = pad_dims(t, (rp, kp))
    return t.reshape(rp // bh, bh, kp // bw, bw).permute(0, 2, 1, 3)


@register_layout
class BSR(Layout):
    """Block compressed rows. A block is kept when any of its positions is kept.

    Components: ``crow_indices`` (int64, block rows + 1), ``col_indices`` (int64, kept blocks; sorted per
    block row), ``values`` (kept blocks, bh, bw) and ``block_mask`` (bool, same shape: the kept positions
    inside each block, so :meth:`mask` is exact; values outside it are zero). Shapes that are not block
    multiples are padded internally.

    >>> import torch
    >>> from sparsa.layouts import BSR
    >>> b = BSR.from_dense(torch.eye(5), blocksize=(2, 2))
    >>> b.values.shape, b.nnz
    (torch.Size([3, 2, 2]), 5)
    """

    name = "bsr"

    def __init__(
        self,
        crow_indices: Tensor,
        col_indices: Tensor,
        values: Tensor,
        block_mask: Tensor,
        shape: Iterable[int],
        blocksize: Tuple[int, int] = (4, 4),
        validate: bool = True,
    ):
        self.crow_indices = crow_indices
        self.col_indices = col_indices
        self.values = values
        self.block_mask = block_mask
        self.shape = torch.Size(shape)
        self.dtype = values.dtype
        self.blocksize = _check_blocksize(blocksize)
        self._cache: Dict[str, Any] = {}
        if validate:
            self.validate()

    @property
    def grid(self) -> Tuple[int, int]:
        """(block rows, block cols) of the padded tensor."""
        bh, bw = self.blocksize
        return ceil_to(self.shape[0], bh) // bh, ceil_to(self.shape[1], bw) // bw

    @classmethod
    def from_dense(
        cls, dense: Tensor, mask: Optional[Tensor] = None, blocksize: Tuple[int, int] = (4, 4), **params: Any
    ) -> "BSR":
        if params:
            raise TypeError(f"BSR takes only blocksize, got {sorted(params)}")
        bh, bw = _check_blocksize(blocksize)
        check_float(dense, "dense")
        check_ndim(dense, "BSR", exact=2)
        mask = check_mask(mask, dense, "BSR")
        if mask is None:
            mask = dense != 0
        mb = _to_blocks(mask, bh, bw)
        kept = mb.any(3).any(2)  # (BR, BC)
        crow = torch.zeros(kept.shape[0] + 1, dtype=torch.int64, device=dense.device)
        torch.cumsum(kept.sum(1), 0, out=crow[1:])
        col = kept.nonzero()[:, 1].contiguous()
        bmask = mb[kept].contiguous()
        vals = torch.where(
            bmask, _to_blocks(dense, bh, bw)[kept], torch.zeros((), dtype=dense.dtype, device=dense.device)
        )
        return cls(crow, col, vals, bmask, dense.shape, (bh, bw), validate=False)

    def block_row_indices(self) -> Tensor:
        r = self._cache.get("rows")
        if r is None:
            r = self._cache["rows"] = row_ids_from_crow(self.crow_indices, self.col_indices.numel())
        return r

    def derived_components(self) -> Dict[str, Tensor]:
        # torch.compile takes the row ids as a graph input instead of expanding crow_indices on every call
        return {"row_indices": self.block_row_indices()}

    def adopt_derived(self, derived: Dict[str, Tensor]) -> None:
        if set(derived) != {"row_indices"}:
            raise TypeError(f"BSR derives row_indices, got {sorted(derived)}")
        self._cache["rows"] = derived["row_indices"]

    def _scatter(self, blocks: Tensor) -> Tensor:
        bh, bw = self.blocksize
        br, bc = self.grid
        out = torch.zeros((br, bc, bh, bw), dtype=blocks.dtype, device=blocks.device)
        out[self.block_row_indices(), self.col_indices] = blocks
        out = out.permute(0, 2, 1, 3).reshape(br * bh, bc * bw)
        return out[: self.shape[0], : self.shape[1]].contiguous()

    def to_dense(self) -> Tensor:
        return self._scatter(self.values)

    def mask(self) -> Tensor:
        return self._scatter(self.block_mask)

    @property
    def nnz(self) -> int:
        return int(self.block_mask.sum())

    def params(self) -> Dict[str, Any]:
        return {"blocksize": list(self.blocksize)}

    def components(self) -> Dict[str, Tensor]:
        return {
            "crow_indices": self.crow_indices,
            "col_indices": self.col_indices,
            "values": self.values,
            "block_mask": self.block_mask,
        }

    @classmethod
    def from_components(
        cls, components: Dict[str, Tensor], shape: Iterable[int], blocksize=(4, 4), **params: Any
    ) -> "BSR":
        if params:
            raise TypeError(f"BSR takes only blocksize, got {sorted(params)}")
        return cls(
            components["crow_indices"],
            components["col_indices"],
            components["values"],
            components["block_mask"],
            shape,
            tuple(blocksize),
        )

    def refill(self, dense: Tensor) -> "BSR":
        bh, bw = self.blocksize
        blocks = _to_blocks(dense.to(self.dtype), bh, bw)[self.block_row_indices(), self.col_indices]
        vals = torch.where(self.block_mask, blocks, torch.zeros((), dtype=self.dtype, device=blocks.device))
        out = BSR(
            self.crow_indices, self.col_indices, vals, self.block_mask, self.shape, self.blocksize, validate=False
        )
        out._cache["rows"] = self.block_row_indices()
        return out

    def validate(self) -> None:
        if len(self.shape) != 2:
            raise ValueError(f"BSR: shape must be 2-D, got {tuple(self.shape)}")
        bh, bw = self.blocksize
        br, bc = self.grid
        check_int_tensor(self.col_indices, "col_indices", "BSR", (torch.int64,))
        if self.col_indices.dim() != 1:
            raise ValueError(f"BSR: component 'col_indices' must be 1-D, got shape {tuple(self.col_indices.shape)}")
        nb = self.col_indices.numel()
        check_values(self.values, "values", "BSR", (nb, bh, bw))
        if not isinstance(self.block_mask, Tensor) or self.block_mask.dtype != torch.bool:
            raise ValueError(
                f"BSR: component 'block_mask' must be a bool tensor, got "
                f"{getattr(self.block_mask, 'dtype', type(self.block_mask).__name__)}"
            )
        check_shape(self.block_mask, "block_mask", "BSR", (nb, bh, bw))
        check_crow(self.crow_indices, br, nb, "BSR")
        check_sorted_cols(self.col_indices, self.block_row_indices(), bc, "BSR")
        if bool((self.values != 0).logical_and_(~self.block_mask).any()):
            raise ValueError("BSR: component 'values' is nonzero outside 'block_mask'; zero those entries")
        # nothing may be kept in the padding beyond the logical shape
        rp, kp = br * bh, bc * bw
        if nb and (rp > self.shape[0] or kp > self.shape[1]):
            dev = self.col_indices.device
            rows = self.block_row_indices()[:, None] * bh + torch.arange(bh, device=dev)[None]
            cols = self.col_indices[:, None] * bw + torch.arange(bw, device=dev)[None]
            outside = (rows >= self.shape[0])[:, :, None] | (cols >= self.shape[1])[:, None, :]
            if bool((self.block_mask & outside).any()):
                raise ValueError(
                    f"BSR: component 'block_mask' marks positions outside the shape "
                    f"{tuple(self.shape)} (in the block padding)"
                )

    # ------------------------------------------------------------------ torch interop
    def torch_bsr(self) -> Tensor:
        """A cached ``torch.sparse_bsr_tensor`` of the padded matrix (block rows/cols as stored)."""
        t = self._cache.get("torch_bsr")
        if t is None:
            import warnings

            br, bc = self.grid
            bh, bw = self.blocksize
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t = torch.sparse_bsr_tensor(self.crow_indices, self.col_indices, self.values, (br * bh, bc * bw))
            self._cache["torch_bsr"] = t
        return t
