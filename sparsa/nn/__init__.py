"""Model-level API: :class:`Rule`, :func:`sparsify`, :func:`densify`, :func:`sparsity_report`."""

from .rule import Rule  # noqa: F401
from .sparsify import sparsify, densify, sparse_parameters  # noqa: F401
from .report import sparsity_report, format_report  # noqa: F401
from .hooks import OutputSparsifier, GradLayout  # noqa: F401
from .linears import default_sparsifier, dense_where_slower  # noqa: F401
from .one_shot import sparsify_linears  # noqa: F401
from .fuse import fuse_gelu  # noqa: F401
from .fused_projections import fuse_projections  # noqa: F401
from .fused_mlp import fuse_mlp  # noqa: F401
from .fuse_for_inference import fuse_for_inference  # noqa: F401
from .config import SparsifyConfig  # noqa: F401

__all__ = [
    "Rule",
    "sparsify",
    "densify",
    "sparse_parameters",
    "sparsity_report",
    "format_report",
    "OutputSparsifier",
    "GradLayout",
    "sparsify_linears",
    "default_sparsifier",
    "dense_where_slower",
    "fuse_gelu",
    "fuse_projections",
    "fuse_mlp",
    "fuse_for_inference",
    "SparsifyConfig",
]
