"""Shared test setup: every test starts with empty dense-fallback counters."""

import pytest

import sparsa


@pytest.fixture(autouse=True)
def _fresh_fallback_counts():
    sparsa.reset_fallback_counts()
    yield


@pytest.fixture(autouse=True, scope="session")
def _private_cost_table(tmp_path_factory):
    """Timings the tests make go to a table of their own, not the user's cache."""
    import os

    old = os.environ.get("SPARSA_COST_DIR")
    os.environ["SPARSA_COST_DIR"] = str(tmp_path_factory.mktemp("cost"))
    yield
    if old is None:
        os.environ.pop("SPARSA_COST_DIR", None)
    else:
        os.environ["SPARSA_COST_DIR"] = old
