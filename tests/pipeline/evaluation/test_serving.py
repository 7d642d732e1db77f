"""The serving speed-up's rule (`pipeline.evaluation.serving`): Hodges-Lehmann ratio and Moses
interval over two samples of rounds (vLLM serves in tests/integration/test_pipeline.py)."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from pipeline.evaluation.serving import _mann_whitney_counts, ratio_interval, serving_speedup


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
