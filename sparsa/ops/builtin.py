"""Imports the built-in operator implementations so they register with the dispatcher.

Importing this module is cheap (no kernels are built, Triton is not imported). Order matters where
one registration replaces another: the pure-PyTorch implementations (:mod:`.linear`, :mod:`.matmul`,
:mod:`.pointwise`) first, then the native CPU kernels that replace some of them, then the GPU
implementations (:mod:`.gpu_impls`), which are chosen by device over whatever runs elsewhere.
"""

from . import linear, matmul, pointwise  # noqa: F401
from . import native_linear, bitmask_linear  # noqa: F401
from . import native_grouped_nm  # noqa: F401  (after linear: replaces its grouped_nm linear)
from . import nm_linear  # noqa: F401  (after linear: replaces its nm linear)
from . import gpu_impls  # noqa: F401
from . import activation_impls  # noqa: F401  (F.conv2d / F.linear with a relu_compact input)
