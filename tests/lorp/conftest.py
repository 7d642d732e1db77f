"""Fixtures shared across lorp's test folders: the profile tests' S, token windows, and a
saved checkpoint of every tiny family."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorp import SimilarityStats
from tests.helpers.states import make_states
from tests.helpers.tiny_models import FAMILIES, save_tiny
from tests.helpers.windows import token_windows


@pytest.fixture(scope="module")
def profile_stats() -> SimilarityStats:
    """14 blocks, two batches of fast-drifting states: enough depth structure for the K
    policy to choose several clusters for a profile to carry."""
    s = SimilarityStats(14)
    for seed in range(2):
        s.update(make_states(15, 40, 24, seed=seed, drift=0.6))
    return s


@pytest.fixture(scope="module")
def windows() -> torch.Tensor:
    """Three windows of 40 tokens for the tiny models."""
    # Longer than the tiny models' sliding window (16), so sliding layers matter.
    return token_windows(3, 40, vocab=512)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family -> a saved tiny checkpoint of it, once per test module."""
    root = tmp_path_factory.mktemp("families")
    return {f: save_tiny(f, root / f) for f in FAMILIES}
