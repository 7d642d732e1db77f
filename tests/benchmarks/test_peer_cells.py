"""benchmarks/peer_cells.py: on a small catalog of real `CatalogRow`s, lorp's best is
taken without the peers, the best peer among them, `best-<b>` among all, and the verdict
follows the paired tests."""

from __future__ import annotations

import math
import sys

import pytest

from tests.helpers.paths import REPO
from tests.helpers.peer_rows import catalog, zero_shot

sys.path.insert(0, str(REPO))

from benchmarks.peer_cells import (  # noqa: E402
    attach_zero_shot,
    cells,
    is_peer,
    ppl_tests,
    verdict,
    zero_shot_test,
)


def test_lorps_best_leaves_the_peers_out_and_best_b_takes_all() -> None:
    (cell,) = cells(catalog())
    assert cell.budget == 4 and cell.dense is not None
    assert cell.mine is not None and cell.mine["method_label"] == "window+linear"
    assert [p["method_label"] for p in cell.peers] == [
        "prune-comp+magnitude-comp",
        "replaceme+cosine-map",
    ]
    assert cell.best_peer is not None and cell.best_peer["method_label"] == "replaceme+cosine-map"
    assert cell.alias is not None and is_peer(cell.alias)  # 1.1x beats lorp's 1.2x


def test_the_perplexity_ratio_is_the_mean_loss_difference() -> None:
    """window+linear 3.2 + (0, .02, -.01, 0), replaceme 3.1 + (.01, 0, 0, -.02): the mean
    difference is 0.1 + 0.01/4 + 0.01/4, the ratio exp of it."""
    (cell,) = cells(catalog())
    assert cell.best_peer is not None
    tests = ppl_tests(cell.mine, cell.best_peer)
    assert sorted(tests) == ["lee", "ptb"]
    ratio, low, high = tests["ptb"]
    assert ratio == pytest.approx(math.exp(0.105))
    assert 1.0 < low <= ratio <= high  # lorp's best worse on every resampling
    assert verdict(cell) == "peer"


def test_a_contradicting_zero_shot_test_makes_a_tie() -> None:
    """McNemar on 10 items, lorp's best right alone on 7, the peer on none: p = 2/128,
    for lorp, against the perplexity's peer: tie. Without the zero-shot rows, the peer."""
    (cell,) = cells(catalog())
    zs = [zero_shot("window+linear", "1111111000"), zero_shot("replaceme+cosine-map", "0" * 10)]
    attach_zero_shot([cell], zs)
    test = zero_shot_test(cell)
    assert test is not None
    assert (test["n"], test["right"], test["discordant"]) == (10, (7, 0), (7, 0))
    assert test["p"] == pytest.approx(2 / 128) and test["side"] == "first"
    assert test["detectable"] == pytest.approx(70.0)  # 7 of 10 items at the least
    assert verdict(cell) == "tie"
