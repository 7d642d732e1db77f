"""How a grid point's removal is chosen, as `pipeline.plan.grid.plan_points` calls it: from the
block S alone, by the repair-aware ranking of candidate runs, or from the sub-layer S.
The loss-guided methods' selector runs on Ray (`pipeline.stages.loss_evaluators`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from lorp import Selection, select_layers
from lorp.locality.similarity_stats import SimilarityStats
from lorp.methods import RepairScores
from pipeline.spec.models import MethodSpec

Selector = Callable[..., tuple[Selection, float]]
"""(method, budget[, granularity]) -> (selection, seconds): how a point's blocks are
chosen; a sub-layer granularity's selection (`unit_selector`) is called with it."""


def similarity_selector(stats: SimilarityStats, profile: Any = None) -> Selector:
    """Select from S alone (every method that needs no candidate evaluations)."""

    def select(m: MethodSpec, budget: int) -> tuple[Selection, float]:
        start = time.perf_counter()
        sel = select_layers(stats, budget, m.name, profile=profile, **m.options)
        return sel, time.perf_counter() - start

    return select


def unit_selector(
    units: SimilarityStats | None, profile: Any = None, scores: RepairScores | None = None
) -> Selector:
    """Select sub-layer units from the sub-layer S (`lorp.methods.sublayer_selection`);
    `block` granularity reads the block S (`similarity_selector`). `scores` ranks runs of
    units for `window` (`pipeline.driver.model_stages`, its unit repair scorer)."""
    from lorp.methods.sublayer_selection import select_units

    def select(m: MethodSpec, budget: int, granularity: str) -> tuple[Selection, float]:
        if units is None:
            raise ValueError(f"granularity {granularity!r}: the sub-layer S was not captured")
        start = time.perf_counter()
        sel = select_units(
            units.similarity(), budget, granularity, m.name, repair_scores=scores, **m.options
        )
        return sel, time.perf_counter() - start

    return select


def repair_selector(stats: SimilarityStats, profile: Any, scores: RepairScores) -> Selector:
    """Select with a repair-aware method (`needs_repair`): `scores` ranks candidate runs
    by how well their linear repair does (`pipeline.driver.model_stages`, its repair scorer)."""

    def select(m: MethodSpec, budget: int) -> tuple[Selection, float]:
        start = time.perf_counter()
        sel = select_layers(
            stats, budget, m.name, profile=profile, repair_scores=scores, **m.options
        )
        return sel, time.perf_counter() - start

    return select
