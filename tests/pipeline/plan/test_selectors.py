"""How a point's removal is chosen (`pipeline.plan.selectors`): the sub-layer selector reads
the sub-layer S and gives units, the block selector the block S inside it."""

from __future__ import annotations

import numpy as np
import pytest

from lorp import select_layers
from lorp.locality.similarity_stats import SimilarityStats
from lorp.methods.sublayer_selection import select_units
from pipeline.plan.selectors import similarity_selector, unit_selector
from pipeline.spec.models import MethodSpec


def _sublayer_stats(n_blocks: int = 6, seed: int = 0) -> SimilarityStats:
    rng = np.random.default_rng(seed)
    states = np.cumsum(rng.normal(size=(2 * n_blocks + 1, 40, 16)), axis=0)
    stats = SimilarityStats(2 * n_blocks, extra={"sublayers": True})
    stats.update(states)
    return stats


def test_units_come_from_the_sub_layer_s_and_blocks_from_the_block_s_inside_it() -> None:
    units = _sublayer_stats()
    sel, seconds = unit_selector(units)(MethodSpec("shortgpt"), 2, "attention")
    assert sel.layers == select_units(units.similarity(), 2, "attention", "shortgpt").layers
    assert all(u % 2 == 0 for u in sel.layers) and seconds >= 0
    assert sel.details["granularity"] == "attention"
    block, _ = similarity_selector(units.block_stats())(MethodSpec("shortgpt"), 2)
    assert block.layers == select_layers(units.block_stats(), 2, "shortgpt").layers
    assert block.n_blocks == 6 and sel.n_blocks == 12


def test_a_sub_layer_point_without_the_sub_layer_s_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="granularity 'mlp': the sub-layer S was not captured"):
        unit_selector(None)(MethodSpec("shortgpt"), 2, "mlp")
