"""Two-stage pruning-budget allocation over layer clusters (the paper's Sec. 4.3, Eq. 8-11).

r(l) (Eq. 8) is the mean similarity of layer l to the other members of its cluster,
computed once over the whole cluster; a singleton's r is -inf. Boundary blocks 0 and N-1
are never pruned. Ties (equal to 12 decimals) go to the lower layer index, then the lower
cluster index; cluster indices follow first occurrence along depth.

Two variants:

- ``paper``: Sec. 4.3 as written. Stage 1 takes each cluster's highest-r eligible layer
  (Eq. 9); if the budget is smaller than the number of these candidates, the highest-r ones
  are kept. Stage 2 repeatedly picks the cluster with the largest residual redundancy mu_k
  (Eq. 10: mean pairwise S over its remaining eligible layers, -inf below two) and prunes
  its highest-r remaining layer (Eq. 11). When every mu_k is -inf, the remaining eligible
  layer with the highest r goes.
- ``released``: the authors' public code, which departs from the text in three places:
  Stage 1 walks clusters in depth order and stops at the budget; Stage 2's mu_k averages
  over all unpruned members, boundary layers included, and skips clusters with no eligible
  layer left; when no mu_k is finite it takes the next candidate of the shallowest cluster
  that still has one. Needed to reproduce published layer lists.

``stage1=False`` is the Stage-2-only ablation (Table 5).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from lorp.locality.clustering import reindex_by_depth
from lorp.locality.similarity import check_similarity_matrix

Variant = Literal["paper", "released"]
VARIANTS: tuple[str, ...] = ("paper", "released")
STAGE1, STAGE2, FALLBACK = "stage1", "stage2", "fallback"
# Scores equal to 12 decimals are ties. Exact ties computed in different summation orders
# (shards merged in another order, another device) differ in the last bits; without this,
# the tie rules would depend on them.
TIE_DECIMALS = 12


def tie_key(value: float) -> float:
    return round(value, TIE_DECIMALS)


@dataclass(frozen=True)
class Allocation:
    """The pruned blocks, the order they were chosen in and the stage of each."""

    layers: tuple[int, ...]
    order: tuple[int, ...]
    stages: dict[int, str]
    redundancy: np.ndarray
    labels: np.ndarray


def redundancy_scores(S: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Eq. 8: r(l) = mean_{m in C(l), m != l} S_lm; -inf for a singleton cluster."""
    S = np.asarray(S, dtype=np.float64)
    labels = np.asarray(labels)
    r = np.full(S.shape[0], -math.inf)
    for k in np.unique(labels):
        idx = np.flatnonzero(labels == k)
        if idx.size < 2:
            continue
        block = S[np.ix_(idx, idx)].copy()
        # Zero the diagonal rather than subtract it: equal rows then sum in the same order,
        # so exact ties stay exact and the tie rules apply.
        np.fill_diagonal(block, 0.0)
        r[idx] = block.sum(axis=1) / (idx.size - 1)
    return r


def mean_pairwise(S: np.ndarray, idx: Sequence[int]) -> float:
    """Eq. 10: mean of S_ij over i < j in idx; -inf below two members."""
    if len(idx) < 2:
        return -math.inf
    block = S[np.ix_(idx, idx)]
    iu = np.triu_indices(len(idx), k=1)
    return float(block[iu].mean())


def allocate(
    S: np.ndarray,
    labels: Sequence[int] | np.ndarray,
    budget: int,
    variant: Variant = "paper",
    stage1: bool = True,
) -> list[int]:
    """Sorted 0-based indices of the `budget` blocks to prune."""
    return list(allocate_detailed(S, labels, budget, variant=variant, stage1=stage1).layers)


def allocate_detailed(
    S: np.ndarray,
    labels: Sequence[int] | np.ndarray,
    budget: int,
    variant: Variant = "paper",
    stage1: bool = True,
    eligible: Sequence[int] | None = None,
) -> Allocation:
    """`allocate`, keeping r(l), the pick order and the stage each block came from.

    `eligible`: the layers the budget may take (default: all but the first and last).
    Sub-layer LoRP clusters all 2N units and spends an attention-only budget on the
    attention units (`lorp.methods.sublayer_selection`)."""
    n_all = np.asarray(S).shape[0]
    pool = sorted({int(i) for i in (range(1, n_all - 1) if eligible is None else eligible)})
    S, lab = _validate(S, labels, budget, variant, pool)
    r = redundancy_scores(S, lab)
    members = [np.flatnonzero(lab == k).tolist() for k in range(int(lab.max()) + 1)]
    eligible = set(pool)
    pruned: list[int] = []
    stages: dict[int, str] = {}

    def best(cands: Sequence[int]) -> int:
        return min(cands, key=lambda l: (-tie_key(r[l]), l))

    def remaining(k: int) -> list[int]:
        return [l for l in members[k] if l in eligible and l not in stages]

    def take(layer: int, stage: str) -> None:
        pruned.append(layer)
        stages[layer] = stage

    if stage1:
        picks = [(best(c), k) for k in range(len(members)) if (c := remaining(k))]
        if variant == "paper":
            if budget < len(picks):
                picks = sorted(picks, key=lambda lk: (-tie_key(r[lk[0]]), lk[0], lk[1]))[:budget]
        else:
            picks = picks[:budget]  # released: depth order, stop at the budget
        for layer, _ in picks:
            take(layer, STAGE1)

    while len(pruned) < budget:
        best_k, best_mu = None, -math.inf
        for k in range(len(members)):
            rem = remaining(k)
            if variant == "paper":
                mu = mean_pairwise(S, rem)
            else:
                if not rem:
                    continue
                mu = mean_pairwise(S, [l for l in members[k] if l not in stages])
            mu = tie_key(mu)
            if mu > best_mu:  # strict: ties stay with the lower cluster index
                best_k, best_mu = k, mu
        if best_k is not None:
            take(best(remaining(best_k)), STAGE2)
        elif variant == "paper":
            take(best([l for l in sorted(eligible) if l not in stages]), FALLBACK)
        else:
            k = next(k for k in range(len(members)) if remaining(k))
            take(best(remaining(k)), FALLBACK)

    return Allocation(
        layers=tuple(sorted(pruned)),
        order=tuple(pruned),
        stages=stages,
        redundancy=r,
        labels=lab,
    )


def _validate(
    S: np.ndarray,
    labels: Sequence[int] | np.ndarray,
    budget: int,
    variant: str,
    pool: Sequence[int],
) -> tuple[np.ndarray, np.ndarray]:
    S = np.asarray(S, dtype=np.float64)
    check_similarity_matrix(S)
    n = S.shape[0]
    lab = np.asarray(labels)
    if lab.ndim != 1 or lab.shape[0] != n:
        raise ValueError(f"labels must have one entry per layer ({n}), got shape {lab.shape}")
    if lab.size and (not np.issubdtype(lab.dtype, np.integer) or lab.min() < 0):
        raise ValueError(f"labels must be non-negative integers, got {lab.tolist()}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {list(VARIANTS)}, got {variant!r}")
    if any(not 0 <= i < n for i in pool):
        raise ValueError(f"eligible layers must be in [0, {n - 1}], got {list(pool)}")
    eligible = len(pool)
    if isinstance(budget, bool) or not isinstance(budget, int | np.integer):
        raise ValueError(f"budget must be an integer, got {budget!r}")
    if not 1 <= budget <= eligible:
        if eligible == max(n - 2, 0) and list(pool) == list(range(1, n - 1)):
            raise ValueError(
                f"budget must be in [1, {eligible}] (N={n} blocks less the 2 boundary blocks), "
                f"got {budget}"
            )
        raise ValueError(f"budget must be in [1, {eligible}] (the eligible layers), got {budget}")
    return S, reindex_by_depth(lab)
