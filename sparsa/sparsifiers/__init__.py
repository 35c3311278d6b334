"""Sparsifiers: rules that decide which values survive. One file per family, plus schedules.

>>> import torch
>>> from sparsa.sparsifiers import Magnitude, NM
>>> w = torch.randn(8, 16)
>>> int(Magnitude(0.75).mask(w).sum()), int(NM(2, 4).mask(w).sum())
(32, 64)
"""

from .base import Sparsifier, is_sparsifier, check_sparsifier  # noqa: F401
from .keep_all import KeepAll  # noqa: F401
from .magnitude import Magnitude  # noqa: F401
from .threshold import Threshold  # noqa: F401
from .random import Random  # noqa: F401
from .nm import NM  # noqa: F401
from .grouped_nm import GroupedNM  # noqa: F401
from .block import BlockMagnitude  # noqa: F401
from .row_group import RowGroupSparsifier  # noqa: F401
from .schedules import Schedule, ConstantSparsity, CubicSchedule  # noqa: F401
from .pattern_names import parse_pattern, NamedPattern, PATTERN_SPELLINGS  # noqa: F401

__all__ = [
    "Sparsifier",
    "KeepAll",
    "Magnitude",
    "Threshold",
    "Random",
    "NM",
    "GroupedNM",
    "BlockMagnitude",
    "RowGroupSparsifier",
    "Schedule",
    "ConstantSparsity",
    "CubicSchedule",
    "parse_pattern",
    "NamedPattern",
    "PATTERN_SPELLINGS",
    "is_sparsifier",
    "check_sparsifier",
]
