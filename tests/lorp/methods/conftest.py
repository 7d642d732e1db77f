"""The S the method tests select from: 12 blocks with the output and last-token statistics,
so every built-in method runs on it."""

from __future__ import annotations

import pytest

from lorp import SimilarityStats
from tests.helpers.states import make_states


@pytest.fixture(scope="module")
def stats() -> SimilarityStats:
    s = SimilarityStats(12, model_fingerprint="tiny")
    for seed in range(3):
        s.update(make_states(13, 30, 24, seed=seed).reshape(13, 5, 6, 24))  # 5 sequences each
    return s
