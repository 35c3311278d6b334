"""Imports the built-in pure-PyTorch operator implementations so they register with the dispatcher.

Importing this module is cheap (no kernels are built). The implementations live in
:mod:`.linear`, :mod:`.matmul` and :mod:`.pointwise`.
"""
from . import linear, matmul, pointwise  # noqa: F401
