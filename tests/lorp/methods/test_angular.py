"""Angular distance follows its rule written out by hand: the window of least last-token angle,
refused without last-token statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lorp import (
    SimilarityStats,
    select_layers,
)
from lorp.locality.similarity import LayerSimilarity
from tests.helpers.similarity_matrices import chain, set_sym


@pytest.mark.parametrize(("last_block", "end"), [(False, 11), (True, 12)])
def test_angular_minimises_last_token_arccos(
    stats: SimilarityStats, last_block: bool, end: int
) -> None:
    D = stats.last_token_angular()
    for n in (2, 5):
        dist = {s: D[s, s + n] for s in range(0, end - n + 1)}
        best = min(dist, key=lambda s: (dist[s], s))
        sel = select_layers(stats, n, "angular", last_block=last_block)
        assert sel.layers == tuple(range(best, best + n))
        assert sel.details["window_start"] == best
        assert sorted(sel.details["angular_distance"]) == list(range(0, end - n + 1))


def test_angular_reads_the_last_token_not_the_token_mean() -> None:
    """Token-mean S favours the window at 1, the last-token angles the one at 4: streamline
    and angular disagree, each following its own statistic."""
    N = 8
    S = chain(N + 1)
    set_sym(S, 1, 3, 0.95)
    last = chain(N + 1)
    set_sym(last, 4, 6, 0.95)
    sim = LayerSimilarity(S, N, last_token=last, last_token_angular=np.arccos(last) / math.pi)
    assert select_layers(sim, 2, "streamline").layers == (1, 2)
    assert select_layers(sim, 2, "angular").layers == (4, 5)


def test_angular_refuses_stats_without_last_token(stats: SimilarityStats) -> None:
    with pytest.raises(ValueError, match="'angular' needs last-token statistics"):
        select_layers(stats.matrix(), 2, "angular")
    no_last = LayerSimilarity(stats.matrix(include_output=True), 12)
    with pytest.raises(ValueError, match="'angular' needs last-token statistics"):
        select_layers(no_last, 2, "angular")
