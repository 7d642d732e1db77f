"""Streamline against its rule written out by hand, and the released code's rules on which
blocks the baselines may take (the window rule angular shares)."""

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
def test_streamline_best_contiguous_window(
    stats: SimilarityStats, last_block: bool, end: int
) -> None:
    S = stats.matrix(include_output=True)
    for n in (2, 4, 10):
        best = max(range(1, end - n + 1), key=lambda s: (S[s, s + n], -s))
        sel = select_layers(stats, n, "streamline", last_block=last_block)
        assert sel.layers == tuple(range(best, best + n))
        assert sorted(sel.details["window_cos"]) == list(range(1, end - n + 1))


def test_reference_rules_keep_the_last_block() -> None:
    """The LoRP authors' released code (lib/layer_select.py) never lets ShortGPT take block
    0 or N-1, nor a Streamline window reach block N-1; angular follows the window rule."""
    N = 8
    M = chain(N + 1)
    set_sym(M, N - 1, N, 0.99)  # the last block barely changes its input: lowest BI
    set_sym(M, 0, 1, 0.98)  # so does the first
    set_sym(M, 5, N, 0.97)  # the best 3-block window is [5, 8): it contains block N-1
    sim = LayerSimilarity(M, N, last_token=M, last_token_angular=np.arccos(M) / math.pi)

    assert select_layers(sim, 1, "shortgpt").layers == (1,)  # 0.8 everywhere inside: lowest
    assert select_layers(sim, 1, "shortgpt", candidates="all").layers == (N - 1,)
    assert select_layers(sim, 2, "shortgpt", candidates="all").layers == (0, N - 1)
    assert N - 1 not in select_layers(sim, 3, "streamline").layers
    assert select_layers(sim, 3, "streamline", last_block=True).layers == (5, 6, 7)
    assert N - 1 not in select_layers(sim, 3, "angular").layers
    assert select_layers(sim, 3, "angular", last_block=True).layers == (5, 6, 7)
