"""Spectral clustering (Eq. 7) is sklearn's partition renumbered by depth, and recovers planted
non-contiguous clusters."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.cluster import SpectralClustering

from lorp import affinity, cluster_layers
from tests.helpers.similarity_matrices import random_S


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
