"""The repair-aware window: every allowed window scored in one call, by the score the
option names; the lowest kept."""

from __future__ import annotations

import pytest

from lorp import (
    SimilarityStats,
    select_layers,
)


def test_window_keeps_the_window_whose_repair_leaves_least(stats: SimilarityStats) -> None:
    """Every allowed window is scored in one call, by the score the option names; the
    lowest wins, ties to the shallower."""
    asked: list[tuple[list[tuple[int, int]], str]] = []

    def scores(runs: list[tuple[int, int]], score: str) -> list[float]:
        asked.append((runs, score))
        low = (4, 6) if score == "residual" else (2,)
        return [0.5 if s in low else 1.0 + s for s, _ in runs]

    sel = select_layers(stats, 3, "window", repair_scores=scores)
    windows = [(s, s + 2) for s in range(1, 9)]  # s >= 1, ends before block 11
    assert asked == [(windows, "residual")]
    assert sel.layers == (4, 5, 6) and sel.details["window_start"] == 4
    assert sel.details["window_residual"][6] == 0.5
    by_loss = select_layers(stats, 3, "window", repair_scores=scores, score="loss")
    assert asked[-1] == (windows, "loss") and by_loss.layers == (2, 3, 4)
    assert by_loss.details["window_loss"][2] == 0.5 and by_loss.options["score"] == "loss"
    with pytest.raises(ValueError, match="option 'score'"):
        select_layers(stats, 3, "window", repair_scores=scores, score="cosine")
    with pytest.raises(ValueError, match="ranks runs by their linear repair"):
        select_layers(stats, 3, "window")
