"""Fixtures of the gate's faces (the conformance CLI, the pytest plugin, CI): the bundled set they run on."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.sets import bundled_sets


@pytest.fixture(scope="session")
def e2b_mini() -> Path:
    sets = {p.name: p for p in map(Path, bundled_sets())}
    if "e2b-mini" not in sets:
        pytest.skip("bundled set e2b-mini not installed")
    return sets["e2b-mini"]
