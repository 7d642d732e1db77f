"""LoRP's selection and explanation: the same with and without a precomputed profile (reused
only where provably equal), deterministic for a seed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lorp.locality.profile as model_profile
import lorp.methods.lorp_method as lorp_method
from lorp import (
    SimilarityStats,
    cluster_layers,
    explain,
    profile,
    select_layers,
)
from lorp.locality.similarity import LayerSimilarity
from lorp.methods import validate_options
from tests.helpers.similarity_matrices import problems
from tests.helpers.states import make_states


def test_lorp_selection_and_explanation(stats: SimilarityStats) -> None:
    sel = select_layers(stats, 4, "lorp")
    exp = explain(stats, 4)
    assert sel.layers == exp.layers
    assert sel.kept == tuple(i for i in range(12) if i not in exp.layers)
    d = sel.to_dict()
    assert d["details"]["rls"] == pytest.approx(exp.rls)
    assert d["details"]["k"] == exp.k and exp.k_from_rls
    assert set(d["details"]["stages"].values()) <= {"stage1", "stage2", "fallback"}
    assert len(d["details"]["labels"]) == 12
    assert d["options"]["variant"] == "paper" and d["budget"] == 4
    # A fixed K overrides the RLS policy; stage2-only never reports stage 1.
    assert explain(stats, 4, k=5).k == 5
    s2 = select_layers(stats, 4, "lorp-stage2")
    assert "stage1" not in s2.details["stages"].values()


def test_k_bounded_by_the_blocks_only_when_known() -> None:
    assert validate_options("lorp", {"k": 31})["k"] == 31
    with pytest.raises(
        ValueError, match=r"^method 'lorp' option 'k': 31 exceeds the number of blocks \(30\)$"
    ):
        validate_options("lorp", {"k": 31}, n_blocks=30)
    assert validate_options("lorp", {"k": 30}, n_blocks=30)["k"] == 30


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
    profile_stats: SimilarityStats, method: str, options: dict
) -> None:
    p = profile(profile_stats)
    for budget in (1, 4, 9):
        plain = select_layers(profile_stats, budget, method, **options)
        given = select_layers(profile_stats, budget, method, profile=p, **options)
        assert given.layers == plain.layers and given.details == plain.details
        assert given.options == plain.options  # the profile is not an option


def test_profile_labels_reused_only_when_they_match(
    profile_stats: SimilarityStats, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = profile(profile_stats)
    calls = []
    real = lorp_method.cluster_layers

    def counting(S, k, seed=0):  # type: ignore[no-untyped-def]
        calls.append((k, seed))
        return real(S, k, seed=seed)

    monkeypatch.setattr(lorp_method, "cluster_layers", counting)
    monkeypatch.setattr(model_profile, "cluster_layers", counting)
    for budget in (2, 3, 4):
        explain(profile_stats, budget, profile=p)
        explain(profile_stats, budget, k=p.k, profile=p)
    assert calls == []  # K from RLS with the same policy, or the same fixed K: reused
    explain(profile_stats, 2, seed=1, profile=p)
    explain(profile_stats, 2, k=p.k + 1, profile=p)
    explain(profile_stats, 2, thresholds=(2.0, 1.5), ks=(2, 3, 5), profile=p)
    assert len(calls) == 3


def test_profile_of_another_S_is_refused(profile_stats: SimilarityStats) -> None:
    other = SimilarityStats(14)
    other.update(make_states(15, 40, 24, seed=9))
    with pytest.raises(ValueError, match="profile was computed from another S"):
        select_layers(profile_stats, 3, "lorp", profile=profile(other))


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
