"""The examples in sparsa's docstrings run (public API documented with a runnable example)."""

import doctest
import importlib
import pkgutil
import warnings

import pytest

import sparsa

MODULES = sorted(
    m.name for m in pkgutil.walk_packages(sparsa.__path__, "sparsa.") if not m.name.startswith("sparsa.gpu")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = importlib.import_module(name)
        res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert res.failed == 0, f"{res.failed} docstring example(s) of {name} failed (run python -m pytest -s for details)"
