"""One model's page rendered (`dashboards.model_page`): the perplexity table ranks by the
held-out ratio and badges what fits only its calibration text."""

from __future__ import annotations

from dashboards.catalog_rows import group_pages
from dashboards.links import job_tracking
from dashboards.model_view import metric_tables
from dashboards.overview_view import overview
from tests.helpers.dashboard_data import UI, row


def test_held_out_judgement_ranks_and_marks_what_fits_only_calibration_text() -> None:
    """Best ranks by the held-out ratio (`judged_on`), not the calibration corpus's
    perplexity, and a variant good only on its calibration text carries the badge."""
    from dashboards.model_page import perplexity_table

    judged = {"judged_on": "lee"}
    rows = [
        row(method="dense", budget=0, ppl_ptb=10.0, ppl_lee=20.0, ppl_ratio=1.0, **judged),
        row(
            method="lorp",
            budget=1,
            ppl_ptb=11.0,
            ppl_lee=60.0,
            ratio_ptb=1.1,
            ratio_lee=3.0,
            ppl_ratio=3.0,
            fits_calibration_only=True,
            **judged,
        ),
        row(
            method="shortgpt",
            budget=1,
            ppl_ptb=13.0,
            ppl_lee=30.0,
            ratio_ptb=1.3,
            ratio_lee=1.5,
            ppl_ratio=1.5,
            fits_calibration_only=False,
            **judged,
        ),
    ]
    ov = overview(group_pages(rows), job_tracking(rows), UI)
    line = ov["rows"][0]
    assert line["metric"] == "ppl_ratio" and line["best"][0]["label"] == "shortgpt"
    t = metric_tables(rows, {}, UI)
    assert t["ratio_cols"] == ["ratio_lee", "ratio_ptb"] and t["judged_on"] == ["lee"]
    html = str(perplexity_table(t))
    assert html.count("fits calibration only</span>") == 1
    assert "judged = the ratio on the worst domain of the variant" in html and "some: lee)" in html
