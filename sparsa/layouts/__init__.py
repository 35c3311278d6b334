"""Storage formats. One file per layout; :mod:`.base` holds the protocol, registry and conversion graph."""
from .base import (Layout, register_layout, get_layout, registered_layouts, register_conversion,  # noqa: F401
                   convert, conversion_path)
from .dense import Dense  # noqa: F401
from .masked import Masked  # noqa: F401
