"""Spectral clustering of layers on the affinity A = (S + 1) / 2 (the paper's Sec. 4.2, Eq. 7).

Clusters need not be contiguous in depth: spectral clustering groups layers whose states
are similar wherever they sit. Labels are re-indexed by first occurrence along depth, so
layer 0 is always in cluster 0 and lower cluster indices are shallower.
"""

from __future__ import annotations

import warnings

import numpy as np

from lorp.locality.similarity import check_similarity_matrix


def affinity(S: np.ndarray) -> np.ndarray:
    """Eq. 7 with a unit diagonal, clipped to [0, 1] against rounding."""
    A = (np.asarray(S, dtype=np.float64) + 1.0) / 2.0
    np.fill_diagonal(A, 1.0)
    return np.clip(A, 0.0, 1.0)


def reindex_by_depth(labels: np.ndarray) -> np.ndarray:
    """Renumber cluster labels in order of first appearance along depth."""
    mapping: dict[int, int] = {}
    for lab in labels.tolist():
        mapping.setdefault(lab, len(mapping))
    return np.array([mapping[lab] for lab in labels.tolist()], dtype=np.int64)


def cluster_layers(S: np.ndarray, k: int, seed: int = 0) -> np.ndarray:
    """Partition the N layers of S into k clusters; returns labels of length N."""
    S = np.asarray(S, dtype=np.float64)
    check_similarity_matrix(S)
    n = S.shape[0]
    if not isinstance(k, int | np.integer) or not 1 <= k <= n:
        raise ValueError(f"k must be an integer in [1, {n}], got {k!r}")
    if k == 1:
        return np.zeros(n, dtype=np.int64)
    from sklearn.cluster import SpectralClustering  # 1.6 s to import: only when clustering

    model = SpectralClustering(
        n_clusters=int(k),
        affinity="precomputed",
        assign_labels="kmeans",
        random_state=seed,
    )
    with warnings.catch_warnings():
        # A nearly block-diagonal A is the interesting case; sklearn warns that the graph
        # is "not fully connected" there, which is expected, not a fault.
        warnings.filterwarnings("ignore", message="Graph is not fully connected")
        labels = model.fit_predict(affinity(S))
    return reindex_by_depth(np.asarray(labels))
