"""Zero-shot accuracy intervals (`dashboards.intervals`), against values worked out by hand."""

from __future__ import annotations

import math

import pytest

from dashboards.intervals import SMALL, UNKNOWN, accuracy_interval, average_interval
from tests.helpers.dashboard_data import row


def test_accuracy_interval_numbers() -> None:
    # p = 0.40 over 50 items: SE = 100 sqrt(0.4 * 0.6 / 50) = 6.9282, half = 1.96 SE.
    small = accuracy_interval(40.0, 50.0)
    assert small["half"] == pytest.approx(13.579278, abs=1e-6)
    assert (small["lo"], small["hi"]) == pytest.approx((26.420722, 53.579278), abs=1e-6)
    assert small["flag"] == SMALL  # under 100 items: not comparable to the paper
    # p = 0.62 over 3270 items (BoolQ's validation split).
    large = accuracy_interval(62.0, 3270.0)
    assert large["half"] == pytest.approx(1.663680, abs=1e-6)
    assert large["flag"] is None
    # Exactly 100 items is comparable; p = 0.5 gives half = 1.96 * 5 = 9.8.
    assert accuracy_interval(50.0, 100.0)["half"] == pytest.approx(9.8)
    assert accuracy_interval(50.0, 100.0)["flag"] is None
    # Item count absent or NaN: value kept, no interval, flagged unknown.
    for n in (None, math.nan):
        unknown = accuracy_interval(55.0, n)
        assert unknown["value"] == 55.0 and unknown["half"] is None
        assert unknown["flag"] == UNKNOWN
    # Interval clipped to [0, 100] at the extremes.
    assert accuracy_interval(98.0, 20.0)["hi"] == 100.0


def test_average_interval_combines_task_errors() -> None:
    r = row(acc_arc_easy=40.0, n_arc_easy=50.0, acc_boolq=62.0, n_boolq=3270.0, acc_avg=51.0)
    avg = average_interval(r, ["arc_easy", "boolq"])
    # 1.96 * sqrt(6.9282^2 + 0.84882^2) / 2
    assert avg["half"] == pytest.approx(6.840406, abs=1e-6)
    assert avg["flag"] == SMALL and avg["n"] == 3320.0
    r.pop("n_boolq")
    assert average_interval(r, ["arc_easy", "boolq"])["flag"] == UNKNOWN
    assert average_interval(r, ["arc_easy", "boolq"])["half"] is None
