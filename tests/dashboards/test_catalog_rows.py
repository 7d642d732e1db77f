"""How the dashboard reads catalog rows (`dashboards.catalog_rows`): a catalog without the
`degraded` column has no degraded rows."""

from __future__ import annotations

from dashboards.catalog_rows import is_degraded
from dashboards.overview_view import best_per_budget
from tests.helpers.dashboard_data import row


def test_missing_degraded_column_means_not_degraded() -> None:
    rows = [row(budget=1, ppl_ptb=11.0), row(method="x", budget=1, ppl_ptb=9.0, degraded=None)]
    assert not any(is_degraded(r) for r in rows)
    assert best_per_budget(rows, "ppl_ptb", 1)["label"] == "x"
