"""The speed pass's rounds: one dense timing per round for a group of variants, each
variant leaving the rounds once resolved, unresolved ones marked (scripted timings)."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import tiny_model

from lorp.surgery import drop_layers
from pipeline.evaluation import speed
from pipeline.evaluation.speed import timed_speedups
from pipeline.stages.workers import _groups


def scripted(monkeypatch: pytest.MonkeyPatch, times: dict[int, list[float]]) -> list[int]:
    calls: list[int] = []
    left = {key: iter(values) for key, values in times.items()}

    def timed(model: object, ids: torch.Tensor) -> float:
        calls.append(id(model))
        return next(left[id(model)])

    monkeypatch.setattr(speed, "_time_ms", timed)
    return calls


def test_rounds_time_dense_once_for_every_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    dense = tiny_model("llama")
    a, b = tiny_model("llama"), tiny_model("llama")
    drop_layers(a, [1])
    drop_layers(b, [1, 2, 3])
    D, A, B = id(dense), id(a), id(b)
    # a settles at 10 / 8.4 = 1.19 (bound 6/5 = 1.2) after 5 rounds and leaves; b's floor
    # never agrees (its two best runs 10% apart) and it is timed to max_runs.
    dense_ms = [900.0, 10.0, 10.1, 10.5, 10.05, 10.3, 10.2, 10.4]
    a_ms = [900.0, 8.4, 8.45, 8.9, 8.5, 8.6]
    b_ms = [900.0, 6.0, 6.6, 6.9, 7.0, 6.8, 6.7, 6.75]
    calls = scripted(monkeypatch, {D: dense_ms, A: a_ms, B: b_ms})
    out = timed_speedups(dense, {"a": (a, 1), "b": (b, 3)}, 64, n_blocks=6, min_runs=5, max_runs=7)
    # warm-up, then rounds: dense first on even rounds, last on odd ones; a leaves after 5
    assert calls == [D, A, B] + [D, A, B, B, A, D] * 2 + [D, A, B] + [B, D, D, B]
    assert out["a"]["speedup"] == pytest.approx(10.0 / 8.4) and out["a"]["speed_resolved"] == 1
    assert out["a"]["speed_runs"] == 5.0
    assert math.isnan(out["b"]["speedup"]) and out["b"]["speed_resolved"] == 0
    assert out["b"]["speedup_measured"] == pytest.approx(10.0 / 6.0)
    assert out["b"]["speed_runs"] == 7.0
    assert out[""]["latency_dense_ms"] == 10.0 and out[""]["speedup"] == 1.0


def test_a_ratio_above_the_bound_is_never_published(monkeypatch: pytest.MonkeyPatch) -> None:
    dense, fast = tiny_model("llama"), tiny_model("llama")
    drop_layers(fast, [1])
    scripted(monkeypatch, {id(dense): [900.0] + [10.0] * 3, id(fast): [900.0] + [7.0] * 3})
    out = timed_speedups(dense, {"x": (fast, 1)}, 64, n_blocks=6, min_runs=2, max_runs=3)
    assert math.isnan(out["x"]["speedup"]) and out["x"]["speed_resolved"] == 0  # 1.43 > 1.26
    assert out["x"]["speedup_measured"] == pytest.approx(10.0 / 7.0)


def test_groups_fit_the_memory_budget() -> None:
    items = [("a", 1), ("b", 2), ("c", 3), ("d", 4)]
    assert _groups(items, lambda n: n, 5) == [[("a", 1), ("b", 2)], [("c", 3)], [("d", 4)]]
    assert _groups(items, lambda n: n, 100) == [items]
    assert _groups(items, lambda n: 10 * n, 1) == [[i] for i in items]  # one each, at least
