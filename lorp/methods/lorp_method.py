"""LoRP: Locality-Aware Redundancy Pruning (the paper, Sec. 4) and its Stage-2-only ablation.

Rule: RLS of S (Eq. 5-6) picks K (Sec. 5.1) unless K is given; spectral clustering on
A = (S + 1) / 2 (Eq. 7) partitions the N blocks; the two-stage allocation (Eq. 8-11)
spends the budget. `explain` returns every intermediate quantity for the catalog and the
dashboards.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lorp.allocation import STAGE1, Variant, allocate_detailed
from lorp.clustering import cluster_layers
from lorp.locality import DEFAULT_KS, DEFAULT_THRESHOLDS, k_for_rls, rls
from lorp.methods.registry import (
    Selection,
    _jsonable,
    as_similarity,
    register_method,
    resolve_budget,
)
from lorp.similarity import LayerSimilarity, SimilarityStats


@dataclass(frozen=True)
class LorpExplanation:
    """Why LoRP pruned what it pruned."""

    rls: float
    k: int
    k_from_rls: bool
    labels: tuple[int, ...]
    redundancy: tuple[float, ...]
    layers: tuple[int, ...]
    order: tuple[int, ...]
    stages: dict[int, str]
    variant: str
    stage1: bool

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(
            {
                "rls": self.rls,
                "k": self.k,
                "k_from_rls": self.k_from_rls,
                "labels": list(self.labels),
                "redundancy": list(self.redundancy),
                "pruned": list(self.layers),
                "order": list(self.order),
                "stages": {str(k): v for k, v in sorted(self.stages.items())},
                "variant": self.variant,
                "stage1": self.stage1,
            }
        )


def explain(
    stats: SimilarityStats | LayerSimilarity | np.ndarray,
    budget: int | float,
    *,
    variant: Variant = "paper",
    k: int | None = None,
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    ks: Sequence[int] = DEFAULT_KS,
    seed: int = 0,
    stage1: bool = True,
) -> LorpExplanation:
    """Run LoRP and return RLS, K, cluster labels, r(l) and the stage of every pick."""
    similarity = as_similarity(stats)
    S = similarity.blocks
    n_budget = resolve_budget(budget, similarity.n_blocks)
    try:
        score = rls(S)
    except ValueError:
        if k is None:
            raise
        score = math.nan  # K is given, so RLS is only reported; it is undefined here
    if k is None:
        chosen_k = k_for_rls(score, thresholds, ks)
    elif isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
        raise ValueError(f"k must be a positive integer or null, got {k!r}")
    else:
        chosen_k = int(k)
    if chosen_k > S.shape[0]:
        raise ValueError(f"k={chosen_k} exceeds the number of blocks ({S.shape[0]})")
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    labels = cluster_layers(S, chosen_k, seed=int(seed))
    alloc = allocate_detailed(S, labels, n_budget, variant=variant, stage1=stage1)
    return LorpExplanation(
        rls=score,
        k=chosen_k,
        k_from_rls=k is None,
        labels=tuple(int(x) for x in alloc.labels),
        redundancy=tuple(float(x) for x in alloc.redundancy),
        layers=alloc.layers,
        order=alloc.order,
        stages=alloc.stages,
        variant=variant,
        stage1=stage1,
    )


@register_method("lorp")
def lorp(
    similarity: LayerSimilarity,
    budget: int,
    *,
    variant: Variant = "paper",
    k: int | None = None,
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    ks: Sequence[int] = DEFAULT_KS,
    seed: int = 0,
) -> Selection:
    """LoRP (this paper): RLS-guided spectral clustering, then two-stage allocation."""
    exp = explain(similarity, budget, variant=variant, k=k, thresholds=thresholds, ks=ks, seed=seed)
    return Selection(layers=exp.layers, details=exp.to_dict())


@register_method("lorp-stage2")
def lorp_stage2(
    similarity: LayerSimilarity,
    budget: int,
    *,
    variant: Variant = "paper",
    k: int | None = None,
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    ks: Sequence[int] = DEFAULT_KS,
    seed: int = 0,
) -> Selection:
    """LoRP without Stage 1 (the paper's Table 5 ablation): Stage 2 from an empty set."""
    exp = explain(
        similarity,
        budget,
        variant=variant,
        k=k,
        thresholds=thresholds,
        ks=ks,
        seed=seed,
        stage1=False,
    )
    return Selection(layers=exp.layers, details=exp.to_dict())


__all__ = ["STAGE1", "LorpExplanation", "explain", "lorp", "lorp_stage2"]
