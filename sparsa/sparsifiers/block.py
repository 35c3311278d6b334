"""BlockMagnitude: remove whole ``(br, bc)`` blocks with the smallest L2 norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..layouts.base import check_fraction
from .base import Sparsifier, check_no_nan, check_positive_int, n_removed, top_mask


class BlockMagnitude(Sparsifier):
    """Block sparsity over the last two dims: of the ``ceil(R/br) * ceil(C/bc)`` blocks (per leading
    slice, ranked together), exactly ``round(sparsity * n_blocks)`` with the smallest L2 norm are
    removed. Shapes that are not multiples of the block are zero-padded (edge blocks are smaller).
    Ties keep the lower block index. NaN weights raise ``ValueError``; tensors need >= 2 dims.

    >>> import torch
    >>> from sparsa.sparsifiers import BlockMagnitude
    >>> w = torch.tensor([[1.0, 1.0, 5.0, 5.0], [1.0, 1.0, 5.0, 5.0]])
    >>> BlockMagnitude(0.5, block=(2, 2)).mask(w).tolist()
    [[False, False, True, True], [False, False, True, True]]
    """

    name = "block"

    def __init__(self, sparsity: float, block: tuple = (4, 4)):
        self.sparsity = check_fraction(sparsity, "sparsity")
        if not isinstance(block, (tuple, list)) or len(block) != 2:
            raise ValueError(f"block must be a (rows, cols) pair of positive ints, got {block!r}")
        self.block = (check_positive_int(block[0], "block[0]"), check_positive_int(block[1], "block[1]"))

    def _mask(self, dense: Tensor) -> Tensor:
        check_no_nan(dense, "BlockMagnitude")
        if dense.dim() < 2:
            raise ValueError(
                f"BlockMagnitude needs a tensor with >= 2 dims, got shape {tuple(dense.shape)}; "
                "use Magnitude for vectors"
            )
        if dense.numel() == 0:
            return torch.zeros(dense.shape, dtype=torch.bool, device=dense.device)
        br, bc = self.block
        R, C = dense.shape[-2:]
        x = dense.reshape(-1, R, C).abs().square()
        pr, pc = (-R) % br, (-C) % bc
        if pr or pc:
            x = F.pad(x, (0, pc, 0, pr))
        B, nr, nc = x.shape[0], x.shape[1] // br, x.shape[2] // bc
        norms = x.reshape(B, nr, br, nc, bc).sum(dim=(2, 4)).sqrt()
        nblocks = norms.numel()
        keep = top_mask(norms.reshape(1, -1), nblocks - n_removed(self.sparsity, nblocks)).reshape(B, nr, nc)
        full = keep.repeat_interleave(br, dim=1).repeat_interleave(bc, dim=2)[:, :R, :C]
        return full.reshape(dense.shape)

    def layout_params(self):
        return {"blocksize": self.block}

    def _repr_args(self):
        return {"sparsity": self.sparsity, "block": self.block}
