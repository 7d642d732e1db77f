"""Representation Locality Score (the paper's Eq. 5-6) and the K policy of Sec. 5.1.

RLS = -log2 of the mean off-diagonal similarity. A high RLS means similarity decays fast
with depth (redundancy is local, so few coarse clusters); a low RLS means it is spread
across depth (more clusters, so the budget spreads too).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from lorp.locality.similarity import check_similarity_matrix

# Sec. 5.1: RLS >= 1.0 -> K = 2; 0.7 <= RLS < 1.0 -> K = 3; RLS < 0.7 -> K = 4.
DEFAULT_THRESHOLDS: tuple[float, ...] = (1.0, 0.7)
DEFAULT_KS: tuple[int, ...] = (2, 3, 4)


def off_diagonal_mean(S: np.ndarray) -> float:
    """Eq. 5: 2 / (N (N - 1)) * sum_{i<j} S_ij."""
    S = np.asarray(S, dtype=np.float64)
    check_similarity_matrix(S)
    n = S.shape[0]
    iu = np.triu_indices(n, k=1)
    return float(S[iu].sum() * 2.0 / (n * (n - 1)))


def rls(S: np.ndarray) -> float:
    """Eq. 6: RLS(S) = -log2(mean off-diagonal S). S is the N x N block-input matrix."""
    mean = off_diagonal_mean(S)
    if mean <= 0.0:
        raise ValueError(
            f"RLS is undefined: the mean off-diagonal similarity is {mean:.4g} (must be > 0)"
        )
    return -math.log2(mean)


def k_for_rls(
    score: float,
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    ks: Sequence[int] = DEFAULT_KS,
) -> int:
    """Pick K from RLS: score >= thresholds[0] -> ks[0], thresholds[1] <= score <
    thresholds[0] -> ks[1], ..., below the last threshold -> ks[-1]."""
    check_k_policy(thresholds, ks)
    if not math.isfinite(score):
        raise ValueError(f"rls must be finite, got {score}")
    for threshold, k in zip(thresholds, ks, strict=False):
        if score >= threshold:
            return int(k)
    return int(ks[-1])


def check_k_policy(thresholds: Sequence[float], ks: Sequence[int]) -> None:
    """Raise ValueError unless thresholds are finite numbers descending strictly and ks
    positive integers, one more than thresholds."""
    for name, value in (("thresholds", thresholds), ("ks", ks)):
        if isinstance(value, str | bytes) or not isinstance(value, Sequence | np.ndarray):
            raise ValueError(f"{name} must be a list, got {value!r}")
    thresholds, ks = tuple(thresholds), tuple(ks)
    if len(ks) != len(thresholds) + 1:
        raise ValueError(
            f"ks needs exactly one entry more than thresholds, got thresholds={list(thresholds)} "
            f"ks={list(ks)}"
        )
    if any(not is_real(t) or not math.isfinite(t) for t in thresholds) or any(
        a <= b for a, b in zip(thresholds, thresholds[1:], strict=False)
    ):
        raise ValueError(
            f"thresholds must be finite and strictly descending, got {list(thresholds)}"
        )
    if any(not is_int(k) or k < 1 for k in ks):
        raise ValueError(f"ks must be positive integers, got {list(ks)}")


def is_int(value: object) -> bool:
    """An integer, and not a bool (True is an int to Python, not to a config file)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def is_real(value: object) -> bool:
    """An integer or a float, not a bool."""
    return is_int(value) or isinstance(value, float | np.floating)
