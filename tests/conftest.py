"""Shared test setup: every test starts with empty dense-fallback counters, and the conv cost models and
density crossovers in effect are their defaults on every CPU class (tests of kernel choices assert the
defaults' decisions; the figures measured per class are tested on their own, in
tests/test_adaptive_cost_fits.py and tests/test_crossovers.py)."""

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


@pytest.fixture(autouse=True)
def _default_cost_fits(monkeypatch):
    from sparsa.adaptive import cost_fits
    from sparsa import crossovers

    monkeypatch.setattr(cost_fits, "_this_class", lambda: "tests-default")
    monkeypatch.setattr(cost_fits, "_CACHE", {})
    monkeypatch.setattr(crossovers, "_this_class", lambda: "tests-default")
    yield
