"""Fixtures of the transformers backend's tests: torch on one thread for each module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", autouse=True)
def one_thread(torch_one_thread):
    """Tiny models: torch on one thread for the module (conftest's torch_one_thread; ~5x faster on 2 cores)."""
