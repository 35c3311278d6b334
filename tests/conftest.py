"""Shared test setup: every test starts with empty dense-fallback counters."""
import pytest

import sparsa


@pytest.fixture(autouse=True)
def _fresh_fallback_counts():
    sparsa.reset_fallback_counts()
    yield
