"""`validate_options`: every option value of every built-in method is checked up front,
without running the method, and a bad one is one line naming the method, option and value."""

from __future__ import annotations

import numpy as np
import pytest

from lorp import SimilarityStats, register_method, select_layers, unregister_method
from lorp.methods import Selection, validate_options
from tests.helpers.states import make_states

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


def test_k_bounded_by_the_blocks_only_when_known() -> None:
    assert validate_options("lorp", {"k": 31})["k"] == 31
    with pytest.raises(
        ValueError, match=r"^method 'lorp' option 'k': 31 exceeds the number of blocks \(30\)$"
    ):
        validate_options("lorp", {"k": 31}, n_blocks=30)
    assert validate_options("lorp", {"k": 30}, n_blocks=30)["k"] == 30


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
