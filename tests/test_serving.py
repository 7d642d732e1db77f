"""The serving speed-up's rule (two independent samples of rounds: Hodges-Lehmann ratio,
Moses interval) and the row update that applies it. vLLM itself serves in
`tests/test_pipeline.py::test_vllm_backend_through_the_pipeline`."""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
from dataclasses import dataclass

import pytest

from pipeline.evaluation.serving import _mann_whitney_counts, ratio_interval, serving_speedup
from pipeline.records.row_updates import serving_speedups


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


@dataclass(frozen=True)
class _Model:
    label: str = "m"
    n_blocks: int = 6


@dataclass(frozen=True)
class _Point:
    key: str
    layers: tuple[int, ...]
    model: _Model = _Model()

    @property
    def is_dense(self) -> bool:
        return not self.layers


def _row(tps: list[float]) -> dict[str, object]:
    return {"serving": json.dumps({"rounds": [{"output_tps": t} for t in tps]})}


def test_rows_get_their_speedup_over_the_dense_row() -> None:
    dense_tps = [100.0, 100.4, 99.8, 100.1]
    rows = {
        "d": _row(dense_tps),
        "a": _row([119.0, 120.0, 120.5, 119.5]),
        "b": _row([300.0, 301.0, 299.0, 300.5]),  # 3x with 1 of 6 blocks gone: impossible
        "c": {"ppl_ptb": 10.0},  # no serving rounds: nothing to say
    }
    points = [_Point("d", ()), _Point("a", (2,)), _Point("b", (3,)), _Point("c", (1,))]
    out = serving_speedups(rows, points, half_width=0.02)  # type: ignore[arg-type]
    assert set(out) == {"d", "a", "b"}
    assert out["d"]["serve_speedup"] == 1.0
    ratios = [v / d for v in [119.0, 120.0, 120.5, 119.5] for d in dense_tps]
    assert out["a"]["serve_speedup"] == pytest.approx(statistics.median(ratios))
    assert out["a"]["serve_resolved"] == 1.0
    assert out["b"]["serve_resolved"] == 0.0 and out["b"]["serve_speedup_measured"] > 2.9
    # written once: rows that already hold these values are not updated again
    rows["a"] = rows["a"] | out["a"]
    assert "a" not in serving_speedups(rows, points, half_width=0.02)  # type: ignore[arg-type]
