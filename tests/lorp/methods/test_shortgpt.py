"""ShortGPT against its rule written out by hand: the lowest Block Influence among the
candidates the option allows."""

from __future__ import annotations

import pytest

from lorp import (
    SimilarityStats,
    select_layers,
)


@pytest.mark.parametrize(("candidates", "pool"), [("inner", range(1, 11)), ("all", range(12))])
def test_shortgpt_lowest_block_influence(
    stats: SimilarityStats, candidates: str, pool: range
) -> None:
    S = stats.matrix(include_output=True)
    bi = {l: 1 - S[l, l + 1] for l in pool}
    expected = sorted(sorted(bi, key=lambda l: (bi[l], l))[:3])
    sel = select_layers(stats, 3, "shortgpt", candidates=candidates)
    assert list(sel.layers) == expected
    assert sel.details["block_influence"][5] == pytest.approx(bi[5])
    assert sel.options == {"candidates": candidates}
