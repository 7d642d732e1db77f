"""The registry and `select_layers`: built-in methods and flags, budgets, every option checked
up front in one line, losses and a profile given only to methods that take them."""

from __future__ import annotations

import numpy as np
import pytest

from lorp import (
    SimilarityStats,
    available_methods,
    get_method,
    profile,
    register_method,
    select_layers,
    unregister_method,
)
from lorp.methods import Selection, validate_options
from tests.helpers.similarity_matrices import locality_matrix
from tests.helpers.states import make_states

S6 = locality_matrix((3, 3))


def test_builtin_methods_registered() -> None:
    assert available_methods() == [
        "angular",
        "finercut",
        "linear-patch",
        "lorp",
        "lorp-loss",
        "lorp-stage2",
        "ppl",
        "prune-comp",
        "random",
        "replaceme",
        "shortgpt",
        "sleb",
        "streamline",
        "streamline-layer",
        "window",
    ]
    assert get_method("replaceme").peer == "cosine-map" and get_method("lorp").peer is None
    assert get_method("prune-comp").needs_model and not get_method("replaceme").needs_model
    assert get_method("window").needs_repair and not get_method("streamline").needs_repair
    assert get_method("shortgpt").needs_output_state
    assert not get_method("lorp").needs_output_state
    assert get_method("angular").needs_last_token and not get_method("lorp").needs_last_token
    assert get_method("lorp").takes_profile and not get_method("shortgpt").takes_profile
    assert set(get_method("lorp").defaults) == {"variant", "k", "thresholds", "ks", "seed"}
    assert get_method("shortgpt").defaults == {"candidates": "inner"}
    assert get_method("streamline").defaults == {"last_block": False}
    assert get_method("angular").defaults == {"last_block": False}


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
    with pytest.raises(ValueError, match="unknown method 'lorpp' \\(known: angular, finercut"):
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


BAD = [
    (
        "lorp",
        {"variant": "latest"},
        "option 'variant': must be one of paper, released, got 'latest'",
    ),
    ("lorp", {"k": 0}, "option 'k': must be a positive integer or null, got 0"),
    ("lorp", {"k": 2.5}, "option 'k': must be a positive integer or null, got 2.5"),
    ("lorp", {"k": True}, "option 'k': must be a positive integer or null, got True"),
    ("lorp", {"k": "3"}, "option 'k': must be a positive integer or null, got '3'"),
    ("lorp", {"thresholds": 1.0}, "thresholds must be a list, got 1.0"),
    ("lorp", {"thresholds": [0.7, 1.0]}, "strictly descending, got [0.7, 1.0]"),
    ("lorp", {"thresholds": [1.0, float("nan")]}, "finite and strictly descending"),
    ("lorp", {"ks": [2, 3]}, "ks needs exactly one entry more than thresholds"),
    ("lorp", {"ks": [2, 0, 4]}, "ks must be positive integers, got [2, 0, 4]"),
    ("lorp", {"ks": [2, True, 4]}, "ks must be positive integers, got [2, True, 4]"),
    ("lorp", {"seed": -1}, "option 'seed': must be an integer in [0, 2**32), got -1"),
    ("lorp", {"seed": "0"}, "option 'seed': must be an integer, got '0'"),
    ("lorp-stage2", {"variant": "v2"}, "method 'lorp-stage2' option 'variant'"),
    ("lorp-stage2", {"k": -3}, "option 'k': must be a positive integer or null, got -3"),
    ("random", {"seed": 1.5}, "option 'seed': must be an integer, got 1.5"),
    ("random", {"seed": 2**32}, "option 'seed': must be an integer in [0, 2**32), got 4294967296"),
    ("shortgpt", {"candidates": "paper"}, "option 'candidates': must be one of inner, all"),
    ("shortgpt", {"candidates": None}, "option 'candidates': must be a string, got None"),
    ("streamline", {"last_block": 1}, "option 'last_block': must be true or false, got 1"),
    ("angular", {"last_block": "yes"}, "option 'last_block': must be true or false, got 'yes'"),
]


@pytest.mark.parametrize(("method", "options", "message"), BAD)
def test_bad_values_are_one_line(method: str, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^method '{method}' ") as exc:
        validate_options(method, options)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_good_values_return_every_option() -> None:
    assert validate_options("shortgpt", {}) == {"candidates": "inner"}
    got = validate_options("lorp", {"k": np.int64(3), "thresholds": (1.2, 0.8), "ks": [2, 3, 5]})
    assert got == {
        "variant": "paper",
        "k": 3,
        "thresholds": (1.2, 0.8),
        "ks": [2, 3, 5],
        "seed": 0,
    }
    assert validate_options("lorp", {"k": None})["k"] is None
    assert validate_options("streamline", {"last_block": True}) == {"last_block": True}


def test_select_layers_validates_before_running() -> None:
    calls = []

    def check(options, n_blocks):  # type: ignore[no-untyped-def]
        if options["width"] > 3:
            raise ValueError(f"option 'width': must be at most 3, got {options['width']}")

    @register_method("options-test", check=check)
    def method(similarity, budget, *, width: int = 1):  # type: ignore[no-untyped-def]
        """Records its calls (test only)."""
        calls.append(width)
        return Selection(layers=tuple(range(1, 1 + budget)))

    stats = SimilarityStats(8)
    stats.update(make_states(9, 12, 16))
    try:
        with pytest.raises(ValueError, match="method 'options-test' option 'width': must be at"):
            select_layers(stats, 2, "options-test", width=5)
        with pytest.raises(ValueError, match="option 'width': must be an integer, got 2.0"):
            select_layers(stats, 2, "options-test", width=2.0)
        assert calls == []
        assert select_layers(stats, 2, "options-test", width=3).options == {"width": 3}
        assert calls == [3]
    finally:
        unregister_method("options-test")


@pytest.mark.parametrize("method", ["sleb", "ppl", "lorp-loss"])
def test_a_loss_method_without_losses_is_one_line(method: str) -> None:
    options = {"keep_first": 1, "keep_last": 1} if method == "ppl" else {}
    with pytest.raises(ValueError, match=f"^method '{method}' scores candidate models") as exc:
        select_layers(S6, 2, method, **options)
    assert "pass losses=" in str(exc.value) and "\n" not in str(exc.value)


BAD_LOSS_OPTIONS = [
    ("sleb", {"keep_first": -1}, "option 'keep_first': must be a non-negative integer, got -1"),
    ("sleb", {"keep_last": 1.5}, "option 'keep_last': must be an integer, got 1.5"),
    ("sleb", {"keep_first": True}, "option 'keep_first': must be an integer, got True"),
    ("ppl", {"keep_first": "4"}, "option 'keep_first': must be an integer, got '4'"),
    ("ppl", {"keep_last": -2}, "option 'keep_last': must be a non-negative integer, got -2"),
    ("ppl", {"depth": 3}, "has no option 'depth'"),
    ("lorp-loss", {"variant": "latest"}, "option 'variant': must be one of paper, released"),
    ("lorp-loss", {"k": 0}, "option 'k': must be a positive integer or null, got 0"),
    ("lorp-loss", {"seed": -1}, "option 'seed': must be an integer in [0, 2**32), got -1"),
    ("lorp-loss", {"ks": [2, 3]}, "ks needs exactly one entry more than thresholds"),
]


@pytest.mark.parametrize(("method", "options", "message"), BAD_LOSS_OPTIONS)
def test_bad_options_are_one_line(method: str, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^method '{method}' ") as exc:
        validate_options(method, options)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_methods_without_a_profile_parameter_ignore_it(profile_stats: SimilarityStats) -> None:
    p = profile(profile_stats)
    assert (
        select_layers(profile_stats, 3, "shortgpt", profile=p).layers
        == select_layers(profile_stats, 3, "shortgpt").layers
    )
