"""The method registry and the baselines, each against its rule written out by hand."""

from __future__ import annotations

import math

import pytest
from conftest import make_states

from lorp import (
    SimilarityStats,
    available_methods,
    explain,
    get_method,
    register_method,
    select_layers,
    unregister_method,
)
from lorp.methods import Selection


@pytest.fixture(scope="module")
def stats() -> SimilarityStats:
    s = SimilarityStats(12, model_fingerprint="tiny")
    for seed in range(3):
        s.update(make_states(13, 30, 24, seed=seed))
    return s


def test_builtin_methods_registered() -> None:
    assert available_methods() == [
        "angular",
        "lorp",
        "lorp-stage2",
        "random",
        "shortgpt",
        "streamline",
    ]
    assert get_method("shortgpt").needs_output_state
    assert not get_method("lorp").needs_output_state
    assert set(get_method("lorp").defaults) == {"variant", "k", "thresholds", "ks", "seed"}


def test_shortgpt_lowest_block_influence(stats: SimilarityStats) -> None:
    S = stats.matrix(include_output=True)
    bi = {l: 1 - S[l, l + 1] for l in range(12)}
    expected = sorted(sorted(bi, key=lambda l: (bi[l], l))[:3])
    sel = select_layers(stats, 3, "shortgpt")
    assert list(sel.layers) == expected
    assert sel.details["block_influence"][5] == pytest.approx(bi[5])


def test_streamline_best_contiguous_window(stats: SimilarityStats) -> None:
    S = stats.matrix(include_output=True)
    for n in (2, 4, 10):
        best = max(range(1, 12 - n + 1), key=lambda s: (S[s, s + n], -s))
        assert select_layers(stats, n, "streamline").layers == tuple(range(best, best + n))


def test_angular_minimises_arccos(stats: SimilarityStats) -> None:
    S = stats.matrix(include_output=True)
    for n in (2, 5):
        dist = {s: math.acos(min(1.0, S[s, s + n])) / math.pi for s in range(0, 12 - n + 1)}
        best = min(dist, key=lambda s: (dist[s], s))
        sel = select_layers(stats, n, "angular")
        assert sel.layers == tuple(range(best, best + n))
        assert sel.details["window_start"] == best


def test_random_is_seeded_and_avoids_boundaries(stats: SimilarityStats) -> None:
    a = select_layers(stats, 5, "random", seed=7)
    assert a.layers == select_layers(stats, 5, "random", seed=7).layers
    assert {0, 11}.isdisjoint(a.layers) and len(set(a.layers)) == 5
    picks = {select_layers(stats, 5, "random", seed=s).layers for s in range(10)}
    assert len(picks) > 1


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


def test_budget_fractions(stats: SimilarityStats) -> None:
    assert select_layers(stats, 0.25, "shortgpt").budget == 3  # round(0.25 * 12)
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\), got 1.5"):
        select_layers(stats, 1.5)
    with pytest.raises(ValueError, match=r"1 <= blocks <= 10 for N=12, got 11"):
        select_layers(stats, 11)
    with pytest.raises(ValueError, match=r"got 0.01 \(= 0 blocks\)"):
        select_layers(stats, 0.01)
    with pytest.raises(ValueError, match="got True"):
        select_layers(stats, True)


def test_bad_method_and_options(stats: SimilarityStats) -> None:
    with pytest.raises(ValueError, match="unknown method 'lorpp' \\(known: angular, lorp"):
        select_layers(stats, 2, "lorpp")
    with pytest.raises(ValueError, match="method 'shortgpt' has no option 'k' \\(options: none\\)"):
        select_layers(stats, 2, "shortgpt", k=3)
    with pytest.raises(ValueError, match="variant must be one of"):
        select_layers(stats, 2, "lorp", variant="latest")
    with pytest.raises(ValueError, match="k must be a positive integer"):
        select_layers(stats, 2, "lorp", k=0)


def test_bare_matrix_serves_only_block_input_methods(stats: SimilarityStats) -> None:
    S = stats.matrix()
    assert select_layers(S, 3, "lorp").layers == select_layers(stats, 3, "lorp").layers
    with pytest.raises(ValueError, match="needs the last block's output state"):
        select_layers(S, 3, "shortgpt")


def test_registry_refuses_duplicates() -> None:
    with pytest.raises(ValueError, match="'lorp' is already registered"):
        register_method("lorp")(lambda similarity, budget: Selection(layers=()))


def test_a_method_that_evaluates_candidates(stats: SimilarityStats) -> None:
    """The registry's hook for SLEB-like methods: they get an evaluator, nobody else does."""
    calls: list[tuple[int, ...]] = []

    def loss(pruned: tuple[int, ...]) -> float:
        calls.append(pruned)
        return float(sum(pruned))  # prefers shallow blocks

    @register_method("greedy-eval-test", needs_evaluator=True)
    def greedy(similarity, budget, *, evaluator=None):  # type: ignore[no-untyped-def]
        """Greedy removal by evaluator loss (test only)."""
        chosen: tuple[int, ...] = ()
        for _ in range(budget):
            cands = [l for l in range(1, similarity.n_blocks - 1) if l not in chosen]
            chosen += (min(cands, key=lambda l: evaluator(tuple(sorted(chosen + (l,))))),)
        return Selection(layers=chosen)

    try:
        assert select_layers(stats, 3, "greedy-eval-test", evaluator=loss).layers == (1, 2, 3)
        assert len(calls) == 10 + 9 + 8
        with pytest.raises(ValueError, match="scores candidate models: pass evaluator="):
            select_layers(stats, 3, "greedy-eval-test")
        # Methods without the flag never receive an evaluator.
        assert select_layers(stats, 3, "shortgpt", evaluator=loss).layers
    finally:
        unregister_method("greedy-eval-test")
