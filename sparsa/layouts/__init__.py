"""Storage formats. One file per layout; :mod:`.base` holds the protocol, registry and conversion graph."""

from .base import (  # noqa: F401
    Layout,
    register_layout,
    get_layout,
    registered_layouts,
    register_conversion,
    convert,
    conversion_path,
)
from .dense import Dense  # noqa: F401
from .masked import Masked  # noqa: F401
from .row_group import RowGroup, row_group_mask  # noqa: F401
from .sliced_ell import SlicedELL  # noqa: F401
from .bitmask import Bitmask  # noqa: F401
from .coo import COO  # noqa: F401
from .csr import CSR  # noqa: F401
from .bsr import BSR  # noqa: F401
from .nm import NM, nm_mask  # noqa: F401
from .grouped_nm import GroupedNM, grouped_nm_mask  # noqa: F401
from . import conversions  # noqa: F401
from .relu_compact import ReluCompact  # noqa: F401
