"""`lorp.profile`: RLS, K and clusters computed once, and LoRP's results identical with and
without a precomputed profile."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import lorp.locality.profile as model_profile
import lorp.methods.lorp_method as lorp_method
from lorp import (
    Profile,
    SimilarityStats,
    cluster_layers,
    explain,
    k_for_rls,
    profile,
    rls,
    select_layers,
)
from tests.helpers.states import make_states


@pytest.fixture(scope="module")
def stats() -> SimilarityStats:
    s = SimilarityStats(14)
    for seed in range(2):
        s.update(make_states(15, 40, 24, seed=seed, drift=0.6))
    return s


def test_profile_is_rls_k_and_labels(stats: SimilarityStats) -> None:
    S = stats.matrix()
    p = profile(stats)
    assert p.rls == rls(S) and p.k == k_for_rls(rls(S))
    assert p.labels == tuple(cluster_layers(S, p.k, seed=0).tolist())
    assert p.n_blocks == 14 and p.seed == 0
    assert profile(S) == p == profile(stats.similarity())  # any form of the same S
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


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"variant": "released"},
        {"k": 2},
        {"k": 5, "seed": 3},
        {"thresholds": [2.0, 1.5], "ks": [2, 3, 5]},
        {"seed": 1},
    ],
)
@pytest.mark.parametrize("method", ["lorp", "lorp-stage2"])
def test_selection_identical_with_and_without_profile(
    stats: SimilarityStats, method: str, options: dict
) -> None:
    p = profile(stats)
    for budget in (1, 4, 9):
        plain = select_layers(stats, budget, method, **options)
        given = select_layers(stats, budget, method, profile=p, **options)
        assert given.layers == plain.layers and given.details == plain.details
        assert given.options == plain.options  # the profile is not an option


def test_profile_labels_reused_only_when_they_match(
    stats: SimilarityStats, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = profile(stats)
    calls = []
    real = lorp_method.cluster_layers

    def counting(S, k, seed=0):  # type: ignore[no-untyped-def]
        calls.append((k, seed))
        return real(S, k, seed=seed)

    monkeypatch.setattr(lorp_method, "cluster_layers", counting)
    monkeypatch.setattr(model_profile, "cluster_layers", counting)
    for budget in (2, 3, 4):
        explain(stats, budget, profile=p)
        explain(stats, budget, k=p.k, profile=p)
    assert calls == []  # K from RLS with the same policy, or the same fixed K: reused
    explain(stats, 2, seed=1, profile=p)
    explain(stats, 2, k=p.k + 1, profile=p)
    explain(stats, 2, thresholds=(2.0, 1.5), ks=(2, 3, 5), profile=p)
    assert len(calls) == 3


def test_profile_of_another_S_is_refused(stats: SimilarityStats) -> None:
    other = SimilarityStats(14)
    other.update(make_states(15, 40, 24, seed=9))
    with pytest.raises(ValueError, match="profile was computed from another S"):
        select_layers(stats, 3, "lorp", profile=profile(other))


def test_methods_without_a_profile_parameter_ignore_it(stats: SimilarityStats) -> None:
    p = profile(stats)
    assert (
        select_layers(stats, 3, "shortgpt", profile=p).layers
        == select_layers(stats, 3, "shortgpt").layers
    )


def test_profile_policy_errors() -> None:
    S = np.full((3, 3), 0.1)
    np.fill_diagonal(S, 1.0)  # RLS 3.3 -> K 2: fine; K 4 from a custom policy is not
    assert profile(S).k == 2
    with pytest.raises(ValueError, match="k=4 .*exceeds the number of blocks \\(3\\)"):
        profile(S, thresholds=(9.0,), ks=(2, 4))
    with pytest.raises(ValueError, match="ks needs exactly one entry more"):
        profile(S, ks=(2, 3))
    assert isinstance(profile(S), Profile)
