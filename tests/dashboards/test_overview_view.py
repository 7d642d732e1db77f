"""The fleet page as data (`dashboards.overview_view`): the best variant per budget skips
degraded rows."""

from __future__ import annotations

from dashboards.catalog_rows import group_pages
from dashboards.links import job_tracking
from dashboards.overview_view import best_per_budget, overview
from tests.helpers.dashboard_data import UI, row


def test_best_per_budget_skips_degraded_rows() -> None:
    rows = [
        row(method="dense", budget=0, ppl_ptb=10.0),
        row(method="lorp", budget=1, ppl_ptb=11.0),
        row(method="shortgpt", budget=1, ppl_ptb=10.5, degraded=True),  # lowest, but failed
        row(method="streamline", budget=1, ppl_ptb=12.0, degraded=False),
        row(method="lorp", budget=2, ppl_ptb=30.0, degraded=True),
        row(method="shortgpt", budget=2, ppl_ptb=40.0, degraded=True),
    ]
    b1 = best_per_budget(rows, "ppl_ptb", 1)
    assert (b1["status"], b1["label"], b1["value"], b1["skipped"]) == ("ok", "lorp", 11.0, 1)
    b2 = best_per_budget(rows, "ppl_ptb", 2)
    assert b2["status"] == "all-degraded" and b2["label"] is None and b2["skipped"] == 2
    assert best_per_budget(rows, "ppl_ptb", 3)["status"] == "none"
    ov = overview(group_pages(rows), job_tracking(rows), UI)
    assert [b["status"] for b in ov["rows"][0]["best"]] == ["ok", "all-degraded"]
    assert ov["n_degraded"] == 3
