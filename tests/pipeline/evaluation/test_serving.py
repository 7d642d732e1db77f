"""The serving figures (`pipeline.evaluation.serving`): a round's TTFT, TPOT and throughput
by value from scripted clock readings, each round's own prompts, and the speed-up's rule,
Hodges-Lehmann ratio and Moses interval over two samples of rounds (vLLM serves in
tests/integration/test_pipeline.py)."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from pipeline.evaluation.serving import (
    _mann_whitney_counts,
    _round_figures,
    ratio_interval,
    round_prompts,
    serving_speedup,
)
from pipeline.spec.evaluation import ServingSpec


def test_a_rounds_figures_by_value_from_scripted_times() -> None:
    """Three requests; the third is sent late (the first two were in flight), so its TTFT
    counts from its own submission, not the round's start; a one-token request has no
    TPOT."""
    sent = {"a": 0.0, "b": 0.0, "c": 1.0}
    first = {"a": 0.1, "b": 0.3, "c": 1.2}
    ended = {"a": (1.0, 10), "b": (2.3, 21), "c": (1.2, 1)}
    got = _round_figures(sent, first, ended, wall=2.5)
    assert got["output_tokens"] == 32
    assert got["output_tps"] == pytest.approx(32 / 2.5)
    assert got["ttft_ms"] == pytest.approx(200.0)  # median of 100, 300 and 200 (not 1200)
    # TPOT over n - 1: a (1.0 - 0.1) / 9 = 100 ms, b (2.3 - 0.3) / 20 = 100 ms; c has none.
    assert got["tpot_ms"] == pytest.approx(100.0)
    assert math.isnan(_round_figures({}, {}, {}, 1.0)["ttft_ms"])


def test_every_round_has_its_own_prompts_and_a_rerun_the_same() -> None:
    spec = ServingSpec(concurrency=2, prompt_len=8, output_len=4, requests=3, rounds=4)
    warm, *timed = round_prompts(spec, 5000)
    assert len(warm) == 2 and len(timed) == 4 and all(len(r) == 3 for r in timed)
    firsts = [tuple(map(tuple, r)) for r in [warm[:2], *timed]]
    assert len({p for r in firsts for p in r}) == 2 + 4 * 3  # no prompt served twice
    assert len({r for r in firsts[1:]}) == 4  # no two timed rounds alike
    assert all(1000 <= t < 5000 for r in timed for p in r for t in p)
    assert round_prompts(spec, 5000) == [warm, *timed]  # seeded: the same on a rerun


def test_the_mann_whitney_distribution_is_exact() -> None:
    # Every ordering of m + n distinct values counted once, as brute force counts them.
    for m, n in ((2, 2), (3, 4), (5, 5)):
        counts = _mann_whitney_counts(m, n)
        assert sum(counts) == math.comb(m + n, m)
        brute = [0] * (m * n + 1)
        for xs in itertools.combinations(range(m + n), m):
            ys = [v for v in range(m + n) if v not in xs]
            brute[sum(x > y for x in xs for y in ys)] += 1
        assert list(counts) == brute


def test_moses_interval_by_value() -> None:
    # 5 rounds a side: the 3rd smallest and 3rd largest of the 25 ratios (P(U <= 2) =
    # 4/252 <= 2.5% < P(U <= 3) = 7/252).
    v, d = [10.0, 11.0, 12.0, 13.0, 14.0], [8.0, 9.0, 10.0, 11.0, 12.0]
    ratios = sorted(a / b for a in v for b in d)
    mid, lo, hi, enough = ratio_interval(v, d)
    assert (mid, lo, hi, enough) == (statistics.median(ratios), ratios[2], ratios[22], True)
    # 3 a side cannot reach 95% (P(U = 0) = 1/20): [min, max], flagged short
    mid, lo, hi, enough = ratio_interval(v[:3], d[:3])
    assert not enough and (lo, hi) == (10.0 / 10.0, 12.0 / 8.0)
    # It covers the true ratio at least 95% of the time (log-normal rounds, ratio 1.3).
    rng, hits, trials = random.Random(3), 0, 1500
    for _ in range(trials):
        dense = [100 * math.exp(rng.gauss(0, 0.05)) for _ in range(5)]
        variant = [130 * math.exp(rng.gauss(0, 0.05)) for _ in range(5)]
        _, lo, hi, _ = ratio_interval(variant, dense)
        hits += lo <= 1.3 <= hi
    assert 0.95 <= hits / trials <= 0.995


def test_a_serving_speedup_is_published_only_when_narrow_and_possible() -> None:
    dense = [100.0, 101.0, 100.5, 99.5, 100.2]
    tight = [120.0, 120.5, 119.8, 120.2, 121.0]
    out = serving_speedup(tight, dense, bound=1.25, half_width=0.02)
    assert out["serve_resolved"] == 1.0 and out["serve_speedup"] == pytest.approx(1.2, rel=0.01)
    noisy = [100.0, 140.0, 120.0, 105.0, 135.0]
    out = serving_speedup(noisy, dense, bound=1.5, half_width=0.02)
    assert out["serve_resolved"] == 0.0 and math.isnan(out["serve_speedup"])
    assert out["serve_speedup_measured"] == pytest.approx(1.2, rel=0.01)
    impossible = [150.0, 150.5, 149.8, 150.2, 151.0]  # 1.5 against 1.05 x 1.25
    assert serving_speedup(impossible, dense, bound=1.25, half_width=0.02)["serve_resolved"] == 0
