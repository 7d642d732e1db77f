"""Random selection, the floor every method must beat: seeded, boundary blocks kept."""

from __future__ import annotations

from lorp import (
    SimilarityStats,
    select_layers,
)


def test_random_is_seeded_and_avoids_boundaries(stats: SimilarityStats) -> None:
    a = select_layers(stats, 5, "random", seed=7)
    assert a.layers == select_layers(stats, 5, "random", seed=7).layers
    assert {0, 11}.isdisjoint(a.layers) and len(set(a.layers)) == 5
    picks = {select_layers(stats, 5, "random", seed=s).layers for s in range(10)}
    assert len(picks) > 1
