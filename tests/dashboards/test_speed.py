"""A variant's speed-up as the dashboard shows it (`dashboards.speed`): beside its bound,
flagged above it, and an unresolved timing never ranked or plotted."""

from __future__ import annotations

import pytest

from dashboards.model_view import metric_tables, tradeoff_lines
from dashboards.speed import speed_bound, speed_view
from tests.helpers.dashboard_data import UI, row


def test_speed_bound_and_flag() -> None:
    assert speed_bound(8, 2) == pytest.approx(8 / 6)
    assert speed_bound(6, 0) == 1.0
    ok = speed_view(row(n_blocks=6, budget=1, speedup=1.25, speedup_std=0.02))
    assert ok["bound"] == pytest.approx(1.2) and not ok["exceeds"]  # 4% above: noise
    assert ok["std"] == 0.02
    over = speed_view(row(n_blocks=6, budget=1, speedup=1.27))
    assert over["exceeds"] and over["std"] is None  # 5.8% above the bound: flagged
    assert not speed_view(row(n_blocks=6, budget=1))["exceeds"]  # no speed measured


def test_unresolved_speed_is_shown_as_such_and_never_ranked_or_plotted() -> None:
    from dashboards.components import speed_tds
    from dashboards.model_page import speed_table

    nan = float("nan")
    # The estimator's row: speed-up NaN, the measured ratio (above 1.05 x 6/5) kept.
    over = row(
        "m",
        "shortgpt",
        1,
        n_blocks=6,
        speedup=nan,
        speedup_measured=1.4,
        speedup_std=0.02,
        speed_resolved=0.0,
        latency_ms=7.0,
        ppl_ptb=12.0,
    )
    sv = speed_view(over)
    assert (sv["resolved"], sv["speedup"], sv["std"], sv["exceeds"]) == (False, None, None, False)
    assert sv["measured"] == 1.4 and sv["measured_exceeds"]
    # A settled-looking speed-up on a row marked unresolved is not shown either.
    stale = row("m", "lorp", 1, n_blocks=6, speedup=1.1, speed_resolved=0.0, latency_ms=9.0)
    assert speed_view(stale)["speedup"] is None
    # No `speed_resolved` column, but a measured ratio and no speed-up: unresolved too.
    bare = speed_view(row(n_blocks=6, speedup=nan, speedup_measured=1.1))
    assert not bare["resolved"] and not bare["measured_exceeds"]
    # A resolved row, and an old catalog's row (no new columns): a speed-up, as before.
    ok = row(
        "m",
        "lorp",
        2,
        n_blocks=6,
        speedup=1.3,
        speedup_std=0.01,
        speedup_measured=1.3,
        speed_resolved=1.0,
        latency_ms=8.0,
        ppl_ptb=15.0,
    )
    assert speed_view(ok)["speedup"] == 1.3
    old = speed_view(row(n_blocks=6, speedup=1.25))
    assert old["resolved"] and old["speedup"] == 1.25 and old["measured"] is None

    cell = str(speed_tds(sv)[0])
    assert "not resolved" in cell and "(1.40 measured)" in cell and 'data-v=""' in cell
    assert "above N/(N-k)" in cell and "\u00b1" not in cell and "above bound" not in cell
    assert "did not settle" in str(speed_tds(bare)[0])
    assert "not resolved" not in str(speed_tds(speed_view(ok))[0])
    # All rows unresolved: the column is still drawn, every cell saying so.
    only = metric_tables([over], {}, UI)
    assert only["speed"] and str(speed_table(only)).count("not resolved</span>") == 1
    # The latency plot leaves unresolved timings out; the parameter plot keeps them.
    points = [over, stale, ok]
    assert tradeoff_lines(points, "ppl_ptb", "latency_ms") == {"lorp": [(8.0, 15.0, None, False)]}
    assert len(tradeoff_lines([dict(r, params=1.0) for r in points], "ppl_ptb", "params")) == 2
