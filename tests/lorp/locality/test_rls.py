"""RLS (Eq. 5-6) against brute force and the paper's extremes; the K policy (Sec. 5.1)
reproduces Table 1 and checks custom policies."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lorp import k_for_rls, off_diagonal_mean, rls
from tests.helpers.similarity_matrices import random_S


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
