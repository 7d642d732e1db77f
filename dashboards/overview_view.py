"""The fleet page, as data: catalog rows grouped by (model, protocol) in, dicts out.

Pure functions, no HTML and no file IO; `overview.py` renders what they return. "Best"
skips variants the quality gate marked degraded; rows without `tracking_uri` /
`experiment_id` get the caller's fallback (`links.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dashboards.catalog_rows import is_degraded, page_names, ppl_metric, rank_metric, split_dense
from dashboards.links import run_url, tracking_view
from dashboards.shapes import Row, View
from pipeline.catalog.ranking import finite, order_key


def best_per_budget(rows: Sequence[Row], metric: str | None, budget: int) -> View:
    """The lowest-`metric` variant at `budget` that the quality gate passed.

    status: "ok" (label, value), "all-degraded" (every variant failed the gate), or
    "none" (no variant at that budget, or no metric); `skipped` counts degraded variants.
    """
    cands = [r for r in rows if r["budget"] == budget and r["method"] != "dense"]
    passed = [r for r in cands if not is_degraded(r)]
    view: View = {
        "budget": budget,
        "status": "none",
        "label": None,
        "value": None,
        "skipped": len(cands) - len(passed),
    }
    if cands and not passed:
        view["status"] = "all-degraded"
    elif passed and metric:
        best = min(passed, key=lambda r: order_key(r, metric))  # the aliases' order
        view.update(status="ok", label=best["method_label"], value=finite(best.get(metric)))
    return view


def overview_row(
    key: tuple[str, str], rows: Sequence[Row], budgets: Sequence[int], links: View, page: str
) -> View:
    """One (model, protocol)'s line of the overview table (links: tracking and
    mlflow_ui); "best" ranks by the protocol's first perplexity."""
    model, protocol = key
    first = rows[0]
    dense, _ = split_dense(rows)
    metric = rank_metric(rows)
    return {
        "model": model,
        "protocol": protocol,
        "metric": metric,
        "page": page,
        "family": first["family"],
        "n_blocks": first["n_blocks"],
        "rls": finite(first.get("rls")),
        "k": first.get("k"),
        "dense_value": finite(dense.get(metric)) if dense and metric else None,
        "best": [best_per_budget(rows, metric, b) for b in budgets],
        "methods": sorted({r["method_label"] for r in rows}),
        "budgets": sorted({r["budget"] for r in rows}),
        "degraded": sum(is_degraded(r) for r in rows),
        "run_url": run_url(dense or first, links["tracking"], links["mlflow_ui"]),
    }


def overview(
    by_page: Mapping[tuple[str, str], Sequence[Row]],
    tracking: Mapping[str, View],
    mlflow_ui: str,
) -> View:
    """Everything the fleet page shows, by (model, protocol) (`group_pages`)."""
    all_rows = [r for rs in by_page.values() for r in rs]
    pages = page_names(by_page)
    metric = ppl_metric(all_rows)
    budgets = sorted({r["budget"] for r in all_rows if r["budget"]})
    links = {"tracking": tracking, "mlflow_ui": mlflow_ui}
    return {
        "metric": metric,
        "budgets": budgets,
        "families": sorted({r["family"] for r in all_rows}),
        "methods": sorted({r["method_label"] for r in all_rows if r["method"] != "dense"}),
        "n_points": sum(1 for r in all_rows if r["method"] != "dense"),
        "n_degraded": sum(is_degraded(r) for r in all_rows),
        "protocols": sorted({k[1] for k in by_page}),
        "n_models": len({k[0] for k in by_page}),
        "rows": [overview_row(k, rs, budgets, links, pages[k]) for k, rs in by_page.items()],
        "jobs": tracking_view(tracking, mlflow_ui),
    }
