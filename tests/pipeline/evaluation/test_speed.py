"""Speed and memory of a model (`pipeline.evaluation.speed`): prefill timing, the speed
rule's rounds and intervals (scripted timings, exact answers), parameters."""

from __future__ import annotations

import gc
import math
import random
import statistics
from pathlib import Path

import pytest
import torch

from lorp.models.surgery import drop_layers
from pipeline.evaluation import speed
from pipeline.evaluation.speed import (
    count_params,
    interleaved_speedup,
    median_interval,
    prefill_latency,
    rounds_for,
    speedup_bound,
    timed_speedup,
    timed_speedups,
)
from tests.helpers.tiny_models import tiny_model


def known_timings(
    monkeypatch: pytest.MonkeyPatch, times: dict[int, list[float]]
) -> list[tuple[int, bool]]:
    """Each model's forwards take the given milliseconds, in order (keyed by `id(model)`):
    the summaries then have exact answers. Returns (model id, gc on) per timed forward."""
    calls: list[tuple[int, bool]] = []
    left = {key: iter(values) for key, values in times.items()}

    def timed(model: object, ids: torch.Tensor) -> float:
        calls.append((id(model), gc.isenabled()))
        return next(left[id(model)])

    monkeypatch.setattr(speed, "_time_ms", timed)
    return calls


def test_prefill_latency_is_mean_and_std_after_warmup(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("llama")
    known_timings(monkeypatch, {id(model): [500.0, 2.0, 3.0, 7.0]})  # a slow first call
    got = prefill_latency(model, 64, warmup=1, repeats=3)
    assert got == pytest.approx({"latency_ms": 4.0, "latency_std_ms": statistics.stdev([2, 3, 7])})


def test_a_timed_forward_is_a_prefill() -> None:
    """Batch 1, cache off, logits for the last position only (not the whole LM head)."""
    seen: dict[str, object] = {}
    ids = torch.zeros(1, 8, dtype=torch.long)
    assert speed._time_ms(lambda **kw: seen.update(kw), ids) >= 0.0
    assert seen.keys() == {"input_ids", "use_cache", "logits_to_keep"}
    assert seen["input_ids"] is ids and seen["use_cache"] is False and seen["logits_to_keep"] == 1


def test_interleaved_speedup_reports_medians_and_spread(monkeypatch: pytest.MonkeyPatch) -> None:
    dense, pruned = tiny_model("llama"), tiny_model("llama")
    drop_layers(pruned, [1, 2, 3, 4])
    D, P = id(dense), id(pruned)
    # Warm-ups (1000 ms) do not count; then pairs of ratios 10/5, 14/4 and 11/8.
    calls = known_timings(monkeypatch, {D: [1000.0, 10.0, 14.0, 11.0], P: [1000.0, 5.0, 4.0, 8.0]})
    t = interleaved_speedup(dense, pruned, 64, pairs=3, warmup=1)
    ratios = [10 / 5, 14 / 4, 11 / 8]
    assert t == pytest.approx(
        {
            "latency_ms": 5.0,  # the pruned model's median
            "latency_dense_ms": 11.0,
            "speedup": 2.0,  # the median ratio, not the ratio of the medians (2.2)
            "speedup_std": statistics.stdev(ratios),
        }
    )
    # Warm-up, then pairs in ABBA order; the garbage collector off for every timing.
    assert [model for model, _ in calls] == [D, P, D, P, P, D, D, P]
    assert not any(gc_on for _, gc_on in calls) and gc.isenabled()

    calls = known_timings(monkeypatch, {D: [1000.0, 12.0, 9.0, 30.0]})
    alone = interleaved_speedup(dense, None, 64, pairs=3, warmup=1)
    assert alone == {
        "latency_ms": 12.0,
        "latency_dense_ms": 12.0,
        "speedup": 1.0,
        "speedup_std": 0.0,
    }
    assert [model for model, _ in calls] == [D] * 4


def test_speedup_bound_is_n_over_n_minus_k(monkeypatch: pytest.MonkeyPatch) -> None:
    assert speedup_bound(30, 10) == 1.5 and speedup_bound(6, 0) == 1.0
    assert speedup_bound(8, 2) == pytest.approx(4 / 3)
    # Blocks that are all the time: 2 of 6 gone take a third of it, and that is the bound,
    # which a resolved figure may reach (six rounds: the fewest for a 95% interval).
    dense, pruned = tiny_model("llama"), tiny_model("llama")
    drop_layers(pruned, [1, 2])
    known_timings(monkeypatch, {id(dense): [1.0] + [12.0] * 6, id(pruned): [1.0] + [8.0] * 6})
    t = timed_speedup(dense, pruned, 64, n_blocks=6, removed=2, min_runs=2, warmup=1)
    assert t["speedup"] == speedup_bound(6, 2) and t["speedup_std"] == 0.0
    assert t["speed_resolved"] == 1.0 and t["speed_runs"] == 6.0


def test_param_count_drops_by_the_removed_blocks() -> None:
    model = tiny_model("llama")
    dense = count_params(model)
    assert dense == sum(p.numel() for p in model.parameters())  # nothing tied here
    blocks = sum(p.numel() for i in (1, 2, 3, 4) for p in model.model.layers[i].parameters())
    drop_layers(model, [1, 2, 3, 4])
    assert count_params(model) == dense - blocks
    tied = tiny_model("gemma3_text")  # embedding and LM head are one tensor, counted once
    head = tied.lm_head.weight
    assert head.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    every = sum(p.numel() for _, p in tied.named_parameters(remove_duplicate=False))
    assert count_params(tied) == every - head.numel()


@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").is_file(), reason="the CPU high-water mark is Linux's"
)
def scripted(monkeypatch: pytest.MonkeyPatch, times: dict[int, list[float]]) -> list[int]:
    """Each model's forwards take the given milliseconds, in order (keyed by `id`); a
    forward past the script raises StopIteration, so a test also pins the round count."""
    calls: list[int] = []
    left = {key: iter(values) for key, values in times.items()}

    def timed(model: object, ids: torch.Tensor) -> float:
        assert not gc.isenabled()  # the collector is off for every timing
        calls.append(id(model))
        return next(left[id(model)])

    monkeypatch.setattr(speed, "_time_ms", timed)
    return calls


def pruned_copies(*removed: list[int]) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    dense, out = tiny_model("llama"), []
    for layers in removed:
        m = tiny_model("llama")
        drop_layers(m, layers)
        out.append(m)
    return dense, out


def test_the_interval_is_the_medians_order_statistics() -> None:
    # n = 6: only [min, max] reaches 95% (1 - 2/64 = 96.9%); n = 10: the 2nd and 9th.
    assert rounds_for() == 6
    assert median_interval([3.0, 1.0, 2.0, 6.0, 5.0, 4.0]) == (3.5, 1.0, 6.0)
    ten = [float(x) for x in range(10, 0, -1)]
    assert median_interval(ten) == (5.5, 2.0, 9.0)
    assert median_interval([5.0, 1.0, 3.0, 2.0, 4.0]) == (3.0, 1.0, 5.0)  # too few: [min, max]
    # 17 values: P(B(17, 1/2) <= 4) = 2.5% on the nose, so the 5th and 13th.
    seventeen = [float(x) for x in range(17)]
    assert median_interval(seventeen)[1:] == (4.0, 12.0)
    # It covers the true median at least 95% of the time, whatever the distribution
    # (skewed here, as timings are).
    rng, hits, trials = random.Random(7), 0, 2000
    true_median = math.log(2)  # of an exponential with rate 1
    for _ in range(trials):
        sample = [rng.expovariate(1.0) for _ in range(12)]
        _, lo, hi = median_interval(sample)
        hits += lo <= true_median <= hi
    assert 0.95 <= hits / trials <= 0.995


def test_rounds_time_dense_once_for_every_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    dense, (a, b) = pruned_copies([1], [1, 2, 3])
    D, A, B = id(dense), id(a), id(b)
    # a's ratios agree within 1% from round one: it resolves after 6 rounds (the fewest
    # for a 95% interval) and leaves; b's swing 10% to 30% and never resolve: it is
    # timed up to max_runs = 8.
    dense_ms = [900.0] + [10.0] * 8
    a_ms = [900.0, 8.4, 8.45, 8.42, 8.5, 8.41, 8.44]
    b_ms = [900.0, 9.0, 7.7, 8.5, 7.8, 9.0, 7.6, 8.8, 7.7]
    calls = scripted(monkeypatch, {D: dense_ms, A: a_ms, B: b_ms})
    out = timed_speedups(dense, {"a": (a, 1), "b": (b, 3)}, 64, n_blocks=6, min_runs=5, max_runs=8)
    # warm-up, then rounds: dense first on even rounds, last on odd ones; a leaves after 6
    assert calls == [D, A, B] + [D, A, B, B, A, D] * 3 + [D, B, B, D]
    ratios_a = [10.0 / t for t in a_ms[1:]]
    assert out["a"]["speedup"] == pytest.approx(statistics.median(ratios_a))
    assert (out["a"]["speedup_low"], out["a"]["speedup_high"]) == (min(ratios_a), max(ratios_a))
    assert out["a"]["speed_resolved"] == 1.0 and out["a"]["speed_runs"] == 6.0
    assert out["a"]["latency_ms"] == pytest.approx(statistics.median(a_ms[1:]))
    assert out["a"]["latency_dense_ms"] == 10.0
    ratios_b = [10.0 / t for t in b_ms[1:]]
    assert math.isnan(out["b"]["speedup"]) and out["b"]["speed_resolved"] == 0.0
    assert out["b"]["speedup_measured"] == pytest.approx(statistics.median(ratios_b))
    assert out["b"]["speed_runs"] == 8.0
    # the dense model's own row: speed-up 1 by definition, resolved, its median latency
    assert out[""]["speedup"] == 1.0 and out[""]["speed_resolved"] == 1.0
    assert out[""]["latency_ms"] == 10.0 and out[""]["speed_runs"] == 8.0


def test_a_round_that_slows_the_machine_slows_both_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine drifts 40% slower and back across rounds (another job, frequency):
    the paired ratio stays put, so the figure resolves at the true 1.2; the ratio of each
    side's minimum would have read 10 / 11.2 x 1.4 ... anything in between."""
    dense, (pruned,) = pruned_copies([1])
    drift = [1.0, 1.4, 1.2, 1.35, 1.1, 1.25]
    dense_ms = [900.0] + [12.0 * f for f in drift]
    pruned_ms = [900.0] + [10.0 * f for f in drift]
    scripted(monkeypatch, {id(dense): dense_ms, id(pruned): pruned_ms})
    t = timed_speedup(dense, pruned, 64, n_blocks=6, removed=1, min_runs=5, warmup=1)
    assert t["speedup"] == pytest.approx(1.2) and t["speed_resolved"] == 1.0
    assert t["speedup_std"] == pytest.approx(0.0)


@pytest.mark.parametrize("hit", ["dense", "pruned"])
def test_interference_on_one_side_moves_nothing_or_resolves_nothing(
    monkeypatch: pytest.MonkeyPatch, hit: str
) -> None:
    """Interference hits one side of some rounds. In 3 of 16 rounds it moves neither the
    median nor the interval (16 ratios: the 4th to the 13th): the true 1.5 is published.
    In 9 of 16 the interval spans the hit and the clean ratios: no figure, rather than a
    wrong one."""
    dense, (pruned,) = pruned_copies([1, 2])
    clean_d = [12.0, 12.1, 12.0, 12.05] * 4
    clean_p = [8.0, 8.05, 8.0, 8.05] * 4
    for hit_rounds, resolved in (({2, 7, 11}, True), ({0, 2, 3, 5, 7, 8, 10, 12, 15}, False)):
        slow = {i: 1.7 for i in hit_rounds}
        d = [x * (slow.get(i, 1.0) if hit == "dense" else 1.0) for i, x in enumerate(clean_d)]
        p = [x * (slow.get(i, 1.0) if hit == "pruned" else 1.0) for i, x in enumerate(clean_p)]
        scripted(monkeypatch, {id(dense): [900.0] + d, id(pruned): [900.0] + p})
        t = timed_speedup(
            dense, pruned, 64, n_blocks=6, removed=2, min_runs=16, max_runs=16, warmup=1
        )
        assert t["speed_resolved"] == (1.0 if resolved else 0.0), hit_rounds
        if resolved:
            assert t["speedup"] == pytest.approx(1.5, rel=0.01)
            assert t["speedup_std"] <= 0.01 * t["speedup"]
        else:
            assert math.isnan(t["speedup"]) and t["speedup_high"] / t["speedup_low"] > 1.5


def test_an_impossible_ratio_is_never_published(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steady ratios, but 10 / 7 = 1.43 against 1.05 x 6/5 = 1.26 (1 of 6 blocks removed),
    or a pruned model 5% slower than dense: timed to max_runs, then unresolved."""
    dense, (fast,) = pruned_copies([1])
    for pruned_ms, ratio in ((7.0, 10.0 / 7.0), (10.5, 10.0 / 10.5)):
        calls = scripted(
            monkeypatch, {id(dense): [900.0] + [10.0] * 7, id(fast): [900.0] + [pruned_ms] * 7}
        )
        t = timed_speedup(dense, fast, 64, n_blocks=6, removed=1, min_runs=5, max_runs=7, warmup=1)
        assert math.isnan(t["speedup"]) and t["speed_resolved"] == 0.0
        assert t["speedup_measured"] == pytest.approx(ratio) and t["speed_runs"] == 7.0
        assert len(calls) == 2 * 8


def test_a_spent_budget_ends_the_timing_unresolved(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each forward advances a fake clock by its milliseconds; a 0.1 s budget is spent
    after the warm-ups (40 ms) and three rounds (60 ms), before six rounds."""
    dense, (pruned,) = pruned_copies([1])
    clock_ms = [0]

    def timed(model: object, ids: torch.Tensor) -> float:
        clock_ms[0] += 10
        return 10.0

    monkeypatch.setattr(speed, "_time_ms", timed)
    monkeypatch.setattr(speed, "_now", lambda: clock_ms[0] / 1000)
    t = timed_speedup(dense, pruned, 64, n_blocks=6, removed=1, budget_s=0.1, min_runs=5)
    assert t["speed_runs"] == 3.0 and t["speed_resolved"] == 0.0 and math.isnan(t["speedup"])
    assert t["speedup_measured"] == 1.0


def test_the_dense_model_alone_is_its_own_row(monkeypatch: pytest.MonkeyPatch) -> None:
    dense = tiny_model("llama")
    calls = scripted(monkeypatch, {id(dense): [900.0] + [12.0, 30.0, 12.1, 12.2, 12.0, 13.0]})
    alone = timed_speedup(dense, None, 64, n_blocks=6, removed=0, min_runs=5, warmup=1)
    assert alone["speedup"] == 1.0 and alone["speed_resolved"] == 1.0
    assert alone["latency_ms"] == pytest.approx(12.15) and alone["speed_runs"] == 6.0
    assert calls == [id(dense)] * 7
