"""The method registry and the baselines, each against its rule written out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lorp import (
    SimilarityStats,
    available_methods,
    explain,
    get_method,
    register_method,
    select_layers,
    unregister_method,
)
from lorp.locality.similarity import LayerSimilarity
from lorp.methods import Selection
from tests.helpers.states import make_states


@pytest.fixture(scope="module")
def stats() -> SimilarityStats:
    s = SimilarityStats(12, model_fingerprint="tiny")
    for seed in range(3):
        s.update(make_states(13, 30, 24, seed=seed).reshape(13, 5, 6, 24))  # 5 sequences each
    return s


def test_builtin_methods_registered() -> None:
    assert available_methods() == [
        "angular",
        "lorp",
        "lorp-loss",
        "lorp-stage2",
        "ppl",
        "random",
        "shortgpt",
        "sleb",
        "streamline",
        "window",
    ]
    assert get_method("window").needs_repair and not get_method("streamline").needs_repair
    assert get_method("shortgpt").needs_output_state
    assert not get_method("lorp").needs_output_state
    assert get_method("angular").needs_last_token and not get_method("lorp").needs_last_token
    assert get_method("lorp").takes_profile and not get_method("shortgpt").takes_profile
    assert set(get_method("lorp").defaults) == {"variant", "k", "thresholds", "ks", "seed"}
    assert get_method("shortgpt").defaults == {"candidates": "inner"}
    assert get_method("streamline").defaults == {"last_block": False}
    assert get_method("angular").defaults == {"last_block": False}


@pytest.mark.parametrize(("candidates", "pool"), [("inner", range(1, 11)), ("all", range(12))])
def test_shortgpt_lowest_block_influence(
    stats: SimilarityStats, candidates: str, pool: range
) -> None:
    S = stats.matrix(include_output=True)
    bi = {l: 1 - S[l, l + 1] for l in pool}
    expected = sorted(sorted(bi, key=lambda l: (bi[l], l))[:3])
    sel = select_layers(stats, 3, "shortgpt", candidates=candidates)
    assert list(sel.layers) == expected
    assert sel.details["block_influence"][5] == pytest.approx(bi[5])
    assert sel.options == {"candidates": candidates}


@pytest.mark.parametrize(("last_block", "end"), [(False, 11), (True, 12)])
def test_streamline_best_contiguous_window(
    stats: SimilarityStats, last_block: bool, end: int
) -> None:
    S = stats.matrix(include_output=True)
    for n in (2, 4, 10):
        best = max(range(1, end - n + 1), key=lambda s: (S[s, s + n], -s))
        sel = select_layers(stats, n, "streamline", last_block=last_block)
        assert sel.layers == tuple(range(best, best + n))
        assert sorted(sel.details["window_cos"]) == list(range(1, end - n + 1))


@pytest.mark.parametrize(("last_block", "end"), [(False, 11), (True, 12)])
def test_angular_minimises_last_token_arccos(
    stats: SimilarityStats, last_block: bool, end: int
) -> None:
    D = stats.last_token_angular()
    for n in (2, 5):
        dist = {s: D[s, s + n] for s in range(0, end - n + 1)}
        best = min(dist, key=lambda s: (dist[s], s))
        sel = select_layers(stats, n, "angular", last_block=last_block)
        assert sel.layers == tuple(range(best, best + n))
        assert sel.details["window_start"] == best
        assert sorted(sel.details["angular_distance"]) == list(range(0, end - n + 1))


def chain(n_states: int, rho: float = 0.8) -> np.ndarray:
    """S_ij = rho^|i-j|: a symmetric matrix with depth decay to edit by hand."""
    idx = np.arange(n_states)
    return rho ** np.abs(idx[:, None] - idx[None, :])


def set_sym(M: np.ndarray, i: int, j: int, value: float) -> None:
    M[i, j] = M[j, i] = value


def test_reference_rules_keep_the_last_block() -> None:
    """The LoRP authors' released code (lib/layer_select.py) never lets ShortGPT take block
    0 or N-1, nor a Streamline window reach block N-1; angular follows the window rule."""
    N = 8
    M = chain(N + 1)
    set_sym(M, N - 1, N, 0.99)  # the last block barely changes its input: lowest BI
    set_sym(M, 0, 1, 0.98)  # so does the first
    set_sym(M, 5, N, 0.97)  # the best 3-block window is [5, 8): it contains block N-1
    sim = LayerSimilarity(M, N, last_token=M, last_token_angular=np.arccos(M) / math.pi)

    assert select_layers(sim, 1, "shortgpt").layers == (1,)  # 0.8 everywhere inside: lowest
    assert select_layers(sim, 1, "shortgpt", candidates="all").layers == (N - 1,)
    assert select_layers(sim, 2, "shortgpt", candidates="all").layers == (0, N - 1)
    assert N - 1 not in select_layers(sim, 3, "streamline").layers
    assert select_layers(sim, 3, "streamline", last_block=True).layers == (5, 6, 7)
    assert N - 1 not in select_layers(sim, 3, "angular").layers
    assert select_layers(sim, 3, "angular", last_block=True).layers == (5, 6, 7)


def test_angular_reads_the_last_token_not_the_token_mean() -> None:
    """Token-mean S favours the window at 1, the last-token angles the one at 4: streamline
    and angular disagree, each following its own statistic."""
    N = 8
    S = chain(N + 1)
    set_sym(S, 1, 3, 0.95)
    last = chain(N + 1)
    set_sym(last, 4, 6, 0.95)
    sim = LayerSimilarity(S, N, last_token=last, last_token_angular=np.arccos(last) / math.pi)
    assert select_layers(sim, 2, "streamline").layers == (1, 2)
    assert select_layers(sim, 2, "angular").layers == (4, 5)


def test_angular_refuses_stats_without_last_token(stats: SimilarityStats) -> None:
    with pytest.raises(ValueError, match="'angular' needs last-token statistics"):
        select_layers(stats.matrix(), 2, "angular")
    no_last = LayerSimilarity(stats.matrix(include_output=True), 12)
    with pytest.raises(ValueError, match="'angular' needs last-token statistics"):
        select_layers(no_last, 2, "angular")


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
    with pytest.raises(
        ValueError, match="method 'shortgpt' has no option 'k' \\(options: candidates\\)"
    ):
        select_layers(stats, 2, "shortgpt", k=3)
    with pytest.raises(ValueError, match="method 'random' has no option 'k' \\(options: seed\\)"):
        select_layers(stats, 2, "random", k=3)
    with pytest.raises(
        ValueError, match="method 'lorp' option 'variant': must be one of paper, released"
    ):
        select_layers(stats, 2, "lorp", variant="latest")
    with pytest.raises(ValueError, match="option 'k': must be a positive integer or null, got 0"):
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
    """The registry's hook for SLEB-like methods: they get `losses`, nobody else does."""
    calls: list[list[tuple[int, ...]]] = []

    def losses(candidates: list[tuple[int, ...]]) -> list[float]:
        calls.append(candidates)
        return [float(sum(c)) for c in candidates]  # prefers shallow blocks

    @register_method("greedy-eval-test", needs_evaluator=True)
    def greedy(similarity, budget, *, losses=None):  # type: ignore[no-untyped-def]
        """Greedy removal by calibration loss, one batch per step (test only)."""
        chosen: tuple[int, ...] = ()
        for _ in range(budget):
            cands = [l for l in range(1, similarity.n_blocks - 1) if l not in chosen]
            values = losses([tuple(sorted(chosen + (l,))) for l in cands])
            chosen += (cands[int(np.argmin(values))],)
        return Selection(layers=chosen)

    try:
        assert select_layers(stats, 3, "greedy-eval-test", losses=losses).layers == (1, 2, 3)
        assert [len(c) for c in calls] == [10, 9, 8]
        with pytest.raises(ValueError, match="scores candidate models: pass losses="):
            select_layers(stats, 3, "greedy-eval-test")
        # Methods without the flag never receive `losses`.
        assert select_layers(stats, 3, "shortgpt", losses=losses).layers
    finally:
        unregister_method("greedy-eval-test")


def test_window_keeps_the_window_whose_repair_leaves_least(stats: SimilarityStats) -> None:
    """Every allowed window is scored in one call, by the score the option names; the
    lowest wins, ties to the shallower."""
    asked: list[tuple[list[tuple[int, int]], str]] = []

    def scores(runs: list[tuple[int, int]], score: str) -> list[float]:
        asked.append((runs, score))
        low = (4, 6) if score == "residual" else (2,)
        return [0.5 if s in low else 1.0 + s for s, _ in runs]

    sel = select_layers(stats, 3, "window", repair_scores=scores)
    windows = [(s, s + 2) for s in range(1, 9)]  # s >= 1, ends before block 11
    assert asked == [(windows, "residual")]
    assert sel.layers == (4, 5, 6) and sel.details["window_start"] == 4
    assert sel.details["window_residual"][6] == 0.5
    by_loss = select_layers(stats, 3, "window", repair_scores=scores, score="loss")
    assert asked[-1] == (windows, "loss") and by_loss.layers == (2, 3, 4)
    assert by_loss.details["window_loss"][2] == 0.5 and by_loss.options["score"] == "loss"
    with pytest.raises(ValueError, match="option 'score'"):
        select_layers(stats, 3, "window", repair_scores=scores, score="cosine")
    with pytest.raises(ValueError, match="ranks runs by their linear repair"):
        select_layers(stats, 3, "window")
