"""Fixtures of the gate's tests (tests/gate/): the oracle's bases that the backend tests compare with."""

from __future__ import annotations

import numpy as np
import pytest

BASE_LEN = 40  # oracle_bases: length of each base, as the fixture sets use


@pytest.fixture(scope="session")
def oracle_bases(preset_models) -> dict[str, list]:
    """{preset: [(ids [BASE_LEN], full-forward logits [BASE_LEN, V]) for 3 seeded bases]}."""
    out = {}
    for preset, model in preset_models.items():
        rng = np.random.default_rng(1234)
        items = []
        for _ in range(3):
            ids = np.concatenate([[2], rng.integers(3, model.cfg.vocab_size, BASE_LEN - 1)]).astype(np.int64)
            items.append((ids, model.forward(ids, rows="all")))
        out[preset] = items
    return out
