"""Property tests: any similarity structure, any budget, the allocation stays valid, and
the paper variant equals a literal transcription of Sec. 4.3."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lorp import allocate, cluster_layers, select_layers
from lorp.locality.similarity import LayerSimilarity


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


@st.composite
def problems(draw):  # type: ignore[no-untyped-def]
    n = draw(st.integers(4, 24))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, draw(st.integers(2, 12)))) + draw(st.floats(0.2, 3.0))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    S = np.round(x @ x.T, 2)  # rounding makes exact ties common
    np.fill_diagonal(S, 1.0)
    k = draw(st.integers(1, min(6, n)))
    labels = draw(st.lists(st.integers(0, k - 1), min_size=n, max_size=n))
    budget = draw(st.integers(1, n - 2))
    return S, labels, budget


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


@settings(max_examples=40, deadline=None)
@given(problems(), st.integers(0, 5))
def test_lorp_end_to_end_deterministic_for_a_seed(problem, seed: int) -> None:  # type: ignore[no-untyped-def]
    S, _, budget = problem
    sim = LayerSimilarity.from_matrix(S)
    a = select_layers(sim, budget, "lorp", k=min(3, len(S)), seed=seed)
    b = select_layers(sim, budget, "lorp", k=min(3, len(S)), seed=seed)
    assert a.layers == b.layers and a.details["labels"] == b.details["labels"]
    assert len(a.layers) == budget and {0, len(S) - 1}.isdisjoint(a.layers)
    assert a.details["labels"] == cluster_layers(S, min(3, len(S)), seed=seed).tolist()
