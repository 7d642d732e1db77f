"""Two-stage allocation (Eq. 8-11) against brute force, hand-worked cases and, for any drawn S
and budget, a literal transcription of Sec. 4.3."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lorp import allocate, allocate_detailed, redundancy_scores
from lorp.locality.allocation import mean_pairwise
from tests.helpers.similarity_matrices import problems


def build_S(n: int, pairs: dict[tuple[int, int], float], other: float = 0.1) -> np.ndarray:
    S = np.full((n, n), other)
    for (i, j), v in pairs.items():
        S[i, j] = S[j, i] = v
    np.fill_diagonal(S, 1.0)
    return S


def test_redundancy_is_eq8_brute_force() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(9, 5)) + 1
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    S = x @ x.T
    labels = np.array([0, 0, 1, 1, 1, 2, 0, 1, 3])
    r = redundancy_scores(S, labels)
    for l in range(9):
        mates = [m for m in range(9) if labels[m] == labels[l] and m != l]
        if not mates:
            assert r[l] == -math.inf  # singleton (layers 5 and 8)
        else:
            assert r[l] == pytest.approx(sum(S[l, m] for m in mates) / len(mates), rel=1e-14)
    assert r[5] == r[8] == -math.inf


def test_mean_pairwise_is_eq10_brute_force() -> None:
    S = build_S(6, {(1, 2): 0.3, (1, 4): 0.7, (2, 4): 0.5})
    assert mean_pairwise(S, [1, 2, 4]) == pytest.approx((0.3 + 0.7 + 0.5) / 3)
    assert mean_pairwise(S, [2]) == -math.inf
    assert mean_pairwise(S, []) == -math.inf


# Case 1, two clusters {0,1,2} {3,4,5}:
#   r = 0:.85  1:.80  2:.75 | 3:.60  4:.825  5:.725
CASE1 = build_S(6, {(0, 1): 0.9, (0, 2): 0.8, (1, 2): 0.7, (3, 4): 0.7, (3, 5): 0.5, (4, 5): 0.95})


TWO = [0, 0, 0, 1, 1, 1]


def test_budget_below_k_paper_keeps_highest_r() -> None:
    # Stage-1 candidates are 1 (r .80) and 4 (r .825): the paper keeps the higher-r one.
    d = allocate_detailed(CASE1, TWO, 1, variant="paper")
    assert d.layers == (4,) and d.stages == {4: "stage1"}
    np.testing.assert_allclose(d.redundancy, [0.85, 0.8, 0.75, 0.6, 0.825, 0.725])


def test_budget_below_k_released_takes_shallowest_clusters() -> None:
    assert allocate(CASE1, TWO, 1, variant="released") == [1]


# Case 2: r = 0:.85 1:.76 2:.71 | 3:.725 4:.70 5:.925; S02=.80 < S45=.90.
CASE2 = build_S(6, {(0, 1): 0.9, (0, 2): 0.8, (1, 2): 0.62, (3, 4): 0.5, (3, 5): 0.95, (4, 5): 0.9})


def test_all_minus_inf_fallback_paper() -> None:
    # After Stage 1 takes {1, 3}, each cluster has one eligible layer left: every mu is
    # -inf, so the remaining eligible layer of highest r goes (2: .71 beats 4: .70).
    d = allocate_detailed(CASE2, TWO, 3, variant="paper")
    assert d.layers == (1, 2, 3)
    assert d.stages == {1: "stage1", 3: "stage1", 2: "fallback"}
    assert d.order == (1, 3, 2)


def test_released_mu_counts_boundary_layers() -> None:
    # Released: mu_0 over unpruned {0, 2} = .80, mu_1 over {4, 5} = .90 -> cluster 1.
    d = allocate_detailed(CASE2, TWO, 3, variant="released")
    assert d.layers == (1, 3, 4)
    assert d.stages == {1: "stage1", 3: "stage1", 4: "stage2"}


def test_singleton_clusters() -> None:
    # Clusters {0,1} {2} {3,4,5}: the singleton 2 has r = -inf.
    S = build_S(6, {(0, 1): 0.9, (3, 4): 0.8, (3, 5): 0.7, (4, 5): 0.6})
    labels = [0, 0, 1, 2, 2, 2]
    d = allocate_detailed(S, labels, 2, variant="paper")
    assert d.redundancy[2] == -math.inf
    assert d.layers == (1, 3)  # candidates 1 (.9), 2 (-inf), 3 (.75): keep the top two
    assert allocate(S, labels, 2, variant="released") == [1, 2]  # depth order
    # With budget for every candidate, Eq. 9 takes the singleton as its cluster's pick.
    assert allocate(S, labels, 3, variant="paper") == [1, 2, 3]


def test_cluster_holding_only_a_boundary_layer() -> None:
    # Clusters {0,1,2} {3,4,5} {6}: cluster 2 has no eligible layer, so no Stage-1 pick,
    # and the released variant skips it in Stage 2.
    S = build_S(7, {(0, 1): 0.9, (0, 2): 0.9, (1, 2): 0.8, (3, 4): 0.7, (3, 5): 0.6, (4, 5): 0.5})
    labels = [0, 0, 0, 1, 1, 1, 2]
    for variant in ("paper", "released"):
        d = allocate_detailed(S, labels, 2, variant=variant)
        assert d.layers == (1, 3), variant
        assert set(d.stages.values()) == {"stage1"}
    # Budget 4, paper: Stage 2 has mu_0 = -inf ({2}) and mu_1 over {4, 5} = .5, so 4
    # (r .60 beats .55); then both clusters hold one layer: fallback to the best r, 2 (.85).
    d = allocate_detailed(S, labels, 4, variant="paper")
    assert d.order == (1, 3, 4, 2)
    assert d.stages == {1: "stage1", 3: "stage1", 4: "stage2", 2: "fallback"}


def test_paper_vs_released_mu_with_boundary() -> None:
    # Stage 2 only. Cluster 0 = {0,1,2}: layers 1, 2 are unlike each other (.3) but both
    # like the boundary 0 (.99). Cluster 1 = {3,4,5,6}: all pairs .5.
    pairs = {(0, 1): 0.99, (0, 2): 0.99, (1, 2): 0.3}
    pairs |= {(i, j): 0.5 for i in range(3, 7) for j in range(i + 1, 7)}
    S = build_S(7, pairs)
    labels = [0, 0, 0, 1, 1, 1, 1]
    # Paper: mu_0 over {1,2} = .3 < mu_1 over {3,4,5} = .5 -> cluster 1, r ties -> layer 3.
    assert allocate(S, labels, 1, variant="paper", stage1=False) == [3]
    # Released: mu_0 over {0,1,2} = .76 > .5 -> cluster 0, r(1) = r(2) -> layer 1.
    assert allocate(S, labels, 1, variant="released", stage1=False) == [1]


def test_ties_lower_layer_then_lower_cluster() -> None:
    S = np.full((6, 6), 0.5)
    np.fill_diagonal(S, 1.0)
    assert allocate(S, TWO, 1) == [1]  # candidates 1 and 3 tie on r
    assert allocate_detailed(S, TWO, 3).order == (1, 3, 2)
    assert allocate(S, TWO, 4) == [1, 2, 3, 4]
    # Stage 2 only: mu_0 = mu_1 -> cluster 0 first; then cluster 0 is exhausted.
    assert allocate_detailed(S, TWO, 2, stage1=False).order == (1, 3)
    assert allocate_detailed(S, TWO, 2, variant="released", stage1=False).order == (1, 2)


def test_labels_are_reindexed_by_depth() -> None:
    flipped = [1, 1, 1, 0, 0, 0]
    assert allocate(CASE1, flipped, 1, variant="released") == [1]
    assert allocate_detailed(CASE1, flipped, 1).labels.tolist() == TWO


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"budget": 0}, r"budget must be in \[1, 4\].*got 0"),
        ({"budget": 5}, r"budget must be in \[1, 4\].*got 5"),
        ({"budget": 2.0}, "budget must be an integer, got 2.0"),
        ({"labels": [0, 1]}, r"one entry per layer \(6\)"),
        ({"labels": [0, 0, -1, 1, 1, 1]}, "non-negative integers"),
        ({"variant": "nope"}, "variant must be one of.*'nope'"),
        ({"S": np.ones((6, 5))}, r"square, got shape \(6, 5\)"),
        ({"S": np.triu(np.ones((6, 6)))}, "symmetric"),
        ({"S": np.full((6, 6), np.nan)}, "finite, got nan"),
    ],
)
def test_bad_input(kwargs: dict, message: str) -> None:
    args = {"S": CASE1, "labels": TWO, "budget": 2} | kwargs
    with pytest.raises(ValueError, match=message):
        allocate(args.pop("S"), args.pop("labels"), **args)


def literal_paper_allocation(
    S: np.ndarray, labels: list[int], budget: int, stage1: bool = True
) -> list[int]:
    """Sec. 4.3 transcribed with sets and loops, independent of lorp.locality.allocation."""
    n = len(S)
    B = {0, n - 1}
    clusters = {}
    for l, k in enumerate(labels):
        clusters.setdefault(k, []).append(l)
    order = sorted(clusters, key=lambda k: min(clusters[k]))  # depth order
    C = [clusters[k] for k in order]

    def r(l: int) -> float:
        mates = next(c for c in C if l in c)
        others = [m for m in mates if m != l]
        return sum(S[l][m] for m in others) / len(others) if others else -math.inf

    def argmax_r(cands):  # ties: equal to 12 decimals, then the lower layer
        return sorted(cands, key=lambda l: (-round(r(l), 12), l))[0]

    P: list[int] = []
    if stage1:
        P0 = [(argmax_r(set(c) - B), ci) for ci, c in enumerate(C) if set(c) - B]
        if budget < len(P0):
            P0 = sorted(P0, key=lambda lc: (-round(r(lc[0]), 12), lc[0], lc[1]))[:budget]
        P = [l for l, _ in P0]
    while len(P) < budget:
        mus = []
        for c in C:
            rem = sorted(set(c) - set(P) - B)
            pairs = [(i, j) for i in rem for j in rem if i < j]
            mus.append(
                round(sum(S[i][j] for i, j in pairs) / len(pairs), 12) if pairs else -math.inf
            )
        if max(mus) == -math.inf:
            P.append(argmax_r(set(range(n)) - set(P) - B))
        else:
            k = mus.index(max(mus))  # first maximum: lower cluster index
            P.append(argmax_r(set(C[k]) - set(P) - B))
    return sorted(P)


@settings(max_examples=300, deadline=None)
@given(problems(), st.sampled_from(["paper", "released"]), st.booleans())
def test_allocation_is_a_valid_budget(problem, variant: str, stage1: bool) -> None:  # type: ignore[no-untyped-def]
    S, labels, budget = problem
    n = len(S)
    layers = allocate(S, labels, budget, variant=variant, stage1=stage1)
    assert len(layers) == budget == len(set(layers))
    assert layers == sorted(layers)
    assert 0 not in layers and n - 1 not in layers
    assert layers == allocate(S, labels, budget, variant=variant, stage1=stage1)


@settings(max_examples=300, deadline=None)
@given(problems(), st.booleans())
def test_paper_variant_equals_literal_transcription(problem, stage1: bool) -> None:  # type: ignore[no-untyped-def]
    S, labels, budget = problem
    assert allocate(S, labels, budget, stage1=stage1) == literal_paper_allocation(
        S.tolist(), labels, budget, stage1
    )
