"""Fast reads of environment variables on hot paths.

``os.environ.get`` encodes its key and decodes the value on every call (about half a microsecond);
a kernel call or a crossover read asks on every call, and tests change the variables between calls,
so the value cannot be cached. On POSIX this reads ``os.environ``'s backing dict directly.

Example::

    >>> import os
    >>> from sparsa.environ import raw
    >>> os.environ["SPARSA_EXAMPLE"] = "1"
    >>> raw(b"SPARSA_EXAMPLE")
    b'1'
    >>> raw(b"SPARSA_UNSET_EXAMPLE")
    b''
"""

from __future__ import annotations

import os

__all__ = ["raw"]

# os.environ's backing dict (bytes keys on POSIX)
_DATA = getattr(os.environ, "_data", None)
if not (isinstance(_DATA, dict) and os.name == "posix"):
    _DATA = None


def raw(name: bytes) -> bytes:
    """The environment variable ``name`` as bytes (b"" when unset)."""
    if _DATA is not None:
        return _DATA.get(name, b"")
    return os.environ.get(name.decode(), "").encode()
