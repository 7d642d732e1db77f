"""The expert sums as a shard holds them: merged by adding, refused across different
layers, kept beside S in its file, and read back as S_j and frequency."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lorp.experts.stats import ExpertStats
from lorp.locality.capture import capture_stats
from lorp.locality.similarity_stats import SimilarityStats
from tests.helpers.family_models import family_model


def windows(n: int = 8, T: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 120, (n, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def qwen3_moe() -> torch.nn.Module:
    return family_model("qwen3_moe")


def shard(routed: list[float], saliency: list[float], tokens: int) -> ExpertStats:
    s = ExpertStats([1], 3)
    s.routed[0] = routed
    s.gate[0] = [r / 2 for r in routed]
    s.saliency_sum[0] = saliency
    s.tokens[0] = tokens
    return s


def test_merged_shards_give_the_means_of_all_their_tokens(tmp_path: Path) -> None:
    a = shard([4, 0, 2], [8.0, 0.0, 1.0], 3)
    b = shard([2, 2, 2], [1.0, 6.0, 3.0], 3)
    both = a.merge(b)
    np.testing.assert_allclose(both.saliency()[0], [9 / 6, 6 / 2, 4 / 4])
    np.testing.assert_allclose(both.frequency()[0], [6 / 6, 2 / 6, 4 / 6])
    assert a.saliency()[0, 1] == 0.0  # no token reached it: 0, not a division by zero
    both.save(tmp_path / "e.npz")
    back = ExpertStats.load(tmp_path / "e.npz")
    np.testing.assert_array_equal(back.saliency(), both.saliency())
    with pytest.raises(ValueError):
        a.merge(ExpertStats([2], 3))


def test_expert_sums_travel_in_the_stats_file(qwen3_moe: torch.nn.Module, tmp_path: Path) -> None:
    stats = capture_stats(qwen3_moe, windows().split(4), progress=False, experts=True)
    stats.to_file(tmp_path / "s.npz")
    back = SimilarityStats.from_file(tmp_path / "s.npz").experts
    assert isinstance(back, ExpertStats) and back.layers == (1, 2, 3)
    np.testing.assert_array_equal(back.saliency_sum, stats.experts.saliency_sum)
    plain = capture_stats(qwen3_moe, windows().split(4), progress=False)
    assert plain.experts is None
    with pytest.raises(ValueError, match="with and without expert statistics"):
        plain.merge(stats)
