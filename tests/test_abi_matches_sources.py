"""Every function of ``sparsa.kernels.abi.SIGNATURES`` against its C definition in ``csrc/``: the same number of
arguments, each of the kind ctypes passes (a pointer, a 64-bit or a 32-bit integer), and the same return kind.
A mismatch would not fail loudly at run time: ctypes would pass the arguments as declared and the kernel would
read garbage (or crash the process)."""

import ctypes
import re

import pytest

from sparsa.kernels import abi
from sparsa.kernels.loader import CSRC

_SOURCES = "\n".join(p.read_text() for p in sorted(CSRC.glob("*.cpp")))
_SCALAR = {"int64_t": abi.I64, "int": abi.INT, "double": ctypes.c_double, "float": ctypes.c_float}
_RETURN = {"int": abi.INT, "int64_t": abi.I64, "void": None, "double": ctypes.c_double}
_NAMES = sorted({fn for table in abi.SIGNATURES.values() for fn in table})


def _definition(fn: str):
    """(return type, [parameter declarations]) of the one definition of ``fn`` in csrc/."""
    found = re.findall(r"\b(int64_t|int|void|double)\s+" + re.escape(fn) + r"\s*\(([^)]*)\)\s*\{", _SOURCES)
    assert len(found) == 1, f"{fn}: {len(found)} definitions in csrc/ (expected one)"
    ret, params = found[0]
    params = " ".join(params.split())
    return ret, [] if params in ("", "void") else [p.strip() for p in params.split(",")]


def _kind(decl: str):
    if "*" in decl:
        return abi.PTR
    ctype = " ".join(decl.replace("const ", "").split()[:-1])
    assert ctype in _SCALAR, f"unexpected parameter type in {decl!r}"
    return _SCALAR[ctype]


@pytest.mark.parametrize("fn", _NAMES)
def test_signature_matches_the_c_definition(fn):
    sigs = {table[fn] for table in abi.SIGNATURES.values() if fn in table}
    assert len(sigs) == 1, f"{fn}: declared differently by two libraries"
    (s,) = sigs
    ret, params = _definition(fn)
    assert s.restype is _RETURN[ret], f"{fn}: returns {ret} in C, declared {s.restype}"
    assert len(params) == len(s.args), f"{fn}: {len(params)} parameters in C, {len(s.args)} declared"
    for (name, declared), decl in zip(s.args, params):
        want = _kind(decl)
        pointer_like = declared is abi.PTR or isinstance(declared, type) and issubclass(declared, ctypes._Pointer)
        assert (want is abi.PTR and pointer_like) or declared is want, f"{fn}: argument {name!r} is {decl!r} in C"
