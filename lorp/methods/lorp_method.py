"""LoRP: Locality-Aware Redundancy Pruning (the paper, Sec. 4) and its Stage-2-only ablation.

Rule: RLS of S (Eq. 5-6) picks K (Sec. 5.1) unless K is given; spectral clustering on
A = (S + 1) / 2 (Eq. 7) partitions the N blocks; the two-stage allocation (Eq. 8-11)
spends the budget. `explain` returns every intermediate quantity for the catalog and the
dashboards.

RLS, K and the clusters do not depend on the budget: a precomputed `lorp.Profile` of the
same S (`profile=`) supplies them, so a grid of budgets clusters once. It is used where it
provably gives the same labels: same seed, and the same K (fixed `k` equal to the
profile's K, or K from RLS with the profile's thresholds and ks); otherwise the labels are
computed afresh. A profile of another S is an error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lorp.locality.allocation import STAGE1, VARIANTS, Variant, allocate_detailed
from lorp.locality.clustering import cluster_layers
from lorp.locality.profile import Profile, matrix_hash, rls_or_nan
from lorp.locality.profile import profile as compute_profile
from lorp.locality.rls import DEFAULT_KS, DEFAULT_THRESHOLDS, check_k_policy, is_int, rls
from lorp.locality.similarity import LayerSimilarity
from lorp.locality.similarity_stats import SimilarityStats
from lorp.methods.registry import (
    Selection,
    as_similarity,
    check_choice,
    check_seed,
    jsonable,
    register_method,
    resolve_budget,
)


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
        return jsonable(
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


def check_lorp_options(options: Mapping[str, Any], n_blocks: int | None) -> None:
    """The option values of `lorp` and `lorp-stage2` (`validate_options` calls it)."""
    check_choice("variant", options["variant"], VARIANTS)
    k = options["k"]
    if k is not None and (not is_int(k) or k < 1):
        raise ValueError(f"option 'k': must be a positive integer or null, got {k!r}")
    if k is not None and n_blocks is not None and k > n_blocks:
        raise ValueError(f"option 'k': {k} exceeds the number of blocks ({n_blocks})")
    try:
        check_k_policy(options["thresholds"], options["ks"])
    except ValueError as exc:
        raise ValueError(f"options 'thresholds', 'ks': {exc}") from None
    check_seed("seed", options["seed"])


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
    profile: Profile | None = None,
) -> LorpExplanation:
    """Run LoRP and return RLS, K, cluster labels, r(l) and the stage of every pick.

    `profile`: a `lorp.profile` of the same S, whose clusters are reused when its seed and
    K policy match these options (module docstring); the result is the same either way.
    """
    similarity = as_similarity(stats)
    S = similarity.blocks
    options = {"variant": variant, "k": k, "thresholds": thresholds, "ks": ks, "seed": seed}
    check_lorp_options(options, S.shape[0])
    n_budget = resolve_budget(budget, similarity.n_blocks)
    score, chosen_k, labels = cluster_labels(S, k, thresholds, ks, int(seed), profile)
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


def cluster_labels(
    S: np.ndarray,
    k: int | None,
    thresholds: Sequence[float],
    ks: Sequence[int],
    seed: int,
    given: Profile | None,
) -> tuple[float, int, np.ndarray]:
    """RLS, K and the labels: from `given` where it provably matches, else computed (K
    from RLS through `lorp.profile`, the one place that turns S into model facts)."""
    if given is not None:
        if given.s_hash != matrix_hash(S):
            raise ValueError("profile was computed from another S than the one to prune")
        if _reusable(given, k, thresholds, ks, seed):
            return given.rls, int(given.k), np.asarray(given.labels)  # type: ignore[arg-type]
    if k is None:
        own = compute_profile(S, thresholds=thresholds, ks=ks, seed=seed)
        if own.k is None:
            rls(S)  # raises the one-line "RLS is undefined" error
        return own.rls, int(own.k), np.asarray(own.labels)  # type: ignore[arg-type]
    return rls_or_nan(S), int(k), cluster_layers(S, int(k), seed=seed)


def _reusable(
    given: Profile, k: int | None, thresholds: Sequence[float], ks: Sequence[int], seed: int
) -> bool:
    """True when `given`'s labels are the ones these options would compute."""
    if given.labels is None or given.k is None or given.seed != seed:
        return False
    if k is not None:
        return int(k) == given.k
    return given.thresholds == tuple(float(t) for t in thresholds) and given.ks == tuple(
        int(x) for x in ks
    )


def _lorp_method(stage1: bool, doc: str) -> Callable[..., Selection]:
    """LoRP as a registry method; `stage1=False` is the Stage-2-only ablation."""

    def method(
        similarity: LayerSimilarity,
        budget: int,
        *,
        variant: Variant = "paper",
        k: int | None = None,
        thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
        ks: Sequence[int] = DEFAULT_KS,
        seed: int = 0,
        profile: Profile | None = None,
    ) -> Selection:
        exp = explain(
            similarity,
            budget,
            variant=variant,
            k=k,
            thresholds=thresholds,
            ks=ks,
            seed=seed,
            stage1=stage1,
            profile=profile,
        )
        return Selection(layers=exp.layers, details=exp.to_dict())

    method.__doc__ = doc
    return method


lorp = register_method("lorp", check=check_lorp_options)(
    _lorp_method(
        True, "LoRP (this paper): RLS-guided spectral clustering, then two-stage allocation."
    )
)
lorp_stage2 = register_method("lorp-stage2", check=check_lorp_options)(
    _lorp_method(
        False, "LoRP without Stage 1 (the paper's Table 5 ablation): Stage 2 from an empty set."
    )
)


__all__ = [
    "STAGE1",
    "LorpExplanation",
    "check_lorp_options",
    "cluster_labels",
    "explain",
    "lorp",
    "lorp_stage2",
]
