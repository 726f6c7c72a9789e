import pytest


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread(one_torch_thread):
    """Every evaluation test runs tiny models: one torch thread (tests/conftest.py)."""
