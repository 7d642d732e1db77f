"""`lorp.profile` computes RLS, K and clusters once, the same from any form of S, and refuses a
K policy that cannot apply."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from lorp import (
    Profile,
    SimilarityStats,
    cluster_layers,
    k_for_rls,
    profile,
    rls,
)


def test_profile_is_rls_k_and_labels(profile_stats: SimilarityStats) -> None:
    S = profile_stats.matrix()
    p = profile(profile_stats)
    assert p.rls == rls(S) and p.k == k_for_rls(rls(S))
    assert p.labels == tuple(cluster_layers(S, p.k, seed=0).tolist())
    assert p.n_blocks == 14 and p.seed == 0
    assert profile(S) == p == profile(profile_stats.similarity())  # any form of the same S
    d = p.to_dict()
    assert json.loads(json.dumps(d)) == d and d["labels"] == list(p.labels)
    with pytest.raises(AttributeError):
        p.k = 3  # type: ignore[misc]


def test_undefined_rls_gives_nan_and_no_k() -> None:
    S = np.full((5, 5), -0.1)
    np.fill_diagonal(S, 1.0)
    p = profile(S)
    assert math.isnan(p.rls) and p.k is None and p.labels is None
    assert p.to_dict()["rls"] is None


def test_profile_policy_errors() -> None:
    S = np.full((3, 3), 0.1)
    np.fill_diagonal(S, 1.0)  # RLS 3.3 -> K 2: fine; K 4 from a custom policy is not
    assert profile(S).k == 2
    with pytest.raises(ValueError, match="k=4 .*exceeds the number of blocks \\(3\\)"):
        profile(S, thresholds=(9.0,), ks=(2, 4))
    with pytest.raises(ValueError, match="ks needs exactly one entry more"):
        profile(S, ks=(2, 3))
    assert isinstance(profile(S), Profile)
