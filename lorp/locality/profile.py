"""A model's locality profile: RLS (Eq. 6), the K it implies (Sec. 5.1) and the spectral
clusters at that K (Eq. 7), computed once from S.

These facts belong to the model and its calibration set, not to a pruning budget: the
pipeline records them once per model and hands the same `Profile` to every LoRP
selection (`select_layers(..., profile=)`), which then reuses the clusters instead of
clustering again. A profile remembers the K policy and seed it was made with and a hash
of its S, so a consumer reuses it only where the result is provably the same.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lorp.locality.clustering import cluster_layers
from lorp.locality.rls import (
    DEFAULT_KS,
    DEFAULT_THRESHOLDS,
    check_k_policy,
    k_for_rls,
    off_diagonal_mean,
)
from lorp.locality.similarity import LayerSimilarity, check_similarity_matrix
from lorp.locality.similarity_stats import SimilarityStats


@dataclass(frozen=True)
class Profile:
    """RLS, K and cluster labels of one S, with the policy that produced them."""

    rls: float  # Eq. 6; nan where undefined (mean off-diagonal S <= 0)
    k: int | None  # from RLS by `thresholds`/`ks`; None where RLS is undefined
    labels: tuple[int, ...] | None  # spectral clusters at k, relabelled by depth
    n_blocks: int
    thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS
    ks: tuple[int, ...] = DEFAULT_KS
    seed: int = 0
    s_hash: str = ""  # sha256 of S's float64 bytes: which S this profile describes

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types (nan RLS becomes None)."""
        return {
            "rls": self.rls if math.isfinite(self.rls) else None,
            "k": self.k,
            "labels": list(self.labels) if self.labels is not None else None,
            "n_blocks": self.n_blocks,
            "thresholds": list(self.thresholds),
            "ks": list(self.ks),
            "seed": self.seed,
            "s_hash": self.s_hash,
        }


def block_matrix(S: SimilarityStats | LayerSimilarity | np.ndarray) -> np.ndarray:
    """The paper's N x N S (block inputs) of any of the accepted forms, as float64."""
    if isinstance(S, SimilarityStats):
        return S.matrix()
    if isinstance(S, LayerSimilarity):
        return np.asarray(S.blocks, dtype=np.float64)
    return np.asarray(S, dtype=np.float64)


def matrix_hash(S: np.ndarray) -> str:
    """Identifies an S exactly (its float64 values, C order)."""
    return hashlib.sha256(np.ascontiguousarray(S, dtype=np.float64).tobytes()).hexdigest()[:32]


def rls_or_nan(S: np.ndarray) -> float:
    """Eq. 6, or nan where the mean off-diagonal similarity is not positive."""
    mean = off_diagonal_mean(S)
    return -math.log2(mean) if mean > 0.0 else math.nan


def profile(
    S: SimilarityStats | LayerSimilarity | np.ndarray,
    *,
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    ks: Sequence[int] = DEFAULT_KS,
    seed: int = 0,
) -> Profile:
    """RLS of S, K from RLS (`thresholds`/`ks`, Sec. 5.1) and the clusters at that K.

    Pure: the same S gives the same Profile. Where RLS is undefined, K and the labels are
    None. A K above N (tiny models) is an error, as in `lorp.explain`.
    """
    M = block_matrix(S)
    check_similarity_matrix(M)
    check_k_policy(thresholds, ks)
    score = rls_or_nan(M)
    k = k_for_rls(score, thresholds, ks) if math.isfinite(score) else None
    if k is not None and k > M.shape[0]:
        raise ValueError(
            f"k={k} (from RLS {score:.4f}) exceeds the number of blocks ({M.shape[0]})"
        )
    labels = None if k is None else tuple(int(x) for x in cluster_layers(M, k, seed=seed))
    return Profile(
        rls=score,
        k=k,
        labels=labels,
        n_blocks=M.shape[0],
        thresholds=tuple(float(t) for t in thresholds),
        ks=tuple(int(x) for x in ks),
        seed=int(seed),
        s_hash=matrix_hash(M),
    )
