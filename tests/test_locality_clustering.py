"""RLS (Eq. 5-6), the K policy (Sec. 5.1) and spectral clustering (Eq. 7)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sklearn.cluster import SpectralClustering

from lorp import affinity, cluster_layers, k_for_rls, off_diagonal_mean, rls


def random_S(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)) + 1.5
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x @ x.T


def test_rls_matches_brute_force() -> None:
    S = random_S(11, 0)
    total, pairs = 0.0, 0
    for i in range(11):
        for j in range(i + 1, 11):
            total += S[i, j]
            pairs += 1
    assert pairs == 11 * 10 // 2
    assert off_diagonal_mean(S) == pytest.approx(total / pairs, rel=1e-14)
    assert rls(S) == pytest.approx(-math.log2(total / pairs), rel=1e-14)


def test_rls_of_the_papers_extremes() -> None:
    # All layers identical: RLS = 0. Mean off-diagonal 0.5: RLS = 1 exactly.
    assert rls(np.ones((5, 5))) == 0.0
    S = np.full((4, 4), 0.5)
    np.fill_diagonal(S, 1.0)
    assert rls(S) == 1.0
    S = np.full((4, 4), -0.1)
    np.fill_diagonal(S, 1.0)
    with pytest.raises(ValueError, match="undefined.*-0.1"):
        rls(S)


@pytest.mark.parametrize(
    ("score", "k"),
    [(1.149, 2), (1.0, 2), (0.941, 3), (0.926, 3), (0.7, 3), (0.685, 4), (0.644, 4), (0.0, 4)],
)
def test_k_policy_reproduces_the_papers_table_1(score: float, k: int) -> None:
    assert k_for_rls(score) == k


def test_k_policy_configurable_and_checked() -> None:
    assert k_for_rls(0.5, thresholds=(0.8, 0.4), ks=(3, 5, 7)) == 5
    assert k_for_rls(0.1, thresholds=(0.8,), ks=(2, 6)) == 6
    with pytest.raises(ValueError, match="one entry more"):
        k_for_rls(0.5, thresholds=(1.0, 0.7), ks=(2, 3))
    with pytest.raises(ValueError, match="strictly descending"):
        k_for_rls(0.5, thresholds=(0.7, 1.0), ks=(2, 3, 4))
    with pytest.raises(ValueError, match="finite"):
        k_for_rls(math.nan)


def test_affinity_is_eq7_with_unit_diagonal() -> None:
    S = random_S(6, 1)
    A = affinity(S)
    for i in range(6):
        for j in range(6):
            assert A[i, j] == pytest.approx(1.0 if i == j else (S[i, j] + 1) / 2, abs=1e-15)


def test_clustering_equals_sklearn_then_reindexed_by_depth() -> None:
    S = random_S(14, 2)
    for k in (2, 3, 4):
        raw = SpectralClustering(
            n_clusters=k, affinity="precomputed", assign_labels="kmeans", random_state=0
        ).fit_predict(affinity(S))
        labels = cluster_layers(S, k, seed=0)
        assert labels[0] == 0
        # Same partition, labels renumbered by first occurrence.
        first = {}
        for lab in raw:
            first.setdefault(lab, len(first))
        assert labels.tolist() == [first[lab] for lab in raw]
        assert sorted(set(labels.tolist())) == list(range(k))


def test_clustering_finds_planted_blocks() -> None:
    # Three depth regions, similar within and dissimilar across; one region split in two.
    groups = [0, 0, 0, 1, 1, 1, 1, 2, 2, 0, 0]
    n = len(groups)
    S = np.full((n, n), 0.05)
    for i in range(n):
        for j in range(n):
            if groups[i] == groups[j]:
                S[i, j] = 0.9
    np.fill_diagonal(S, 1.0)
    labels = cluster_layers(S, 3)
    assert labels.tolist() == groups  # non-contiguous cluster 0 recovered


def test_clustering_bad_input() -> None:
    with pytest.raises(ValueError, match=r"k must be an integer in \[1, 4\], got 5"):
        cluster_layers(np.eye(4), 5)
    assert cluster_layers(np.eye(4), 1).tolist() == [0, 0, 0, 0]
