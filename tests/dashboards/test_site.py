"""The static site (`dashboards.site`) from hand-made catalogs and events: pages, links, the
timeline page; an empty catalog refused. No Ray, no browser."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from dashboards.links import job_tracking, run_url
from dashboards.site import build_site, legacy_tracking
from tests.helpers.dashboard_data import UI, row, timeline_events
from tests.helpers.dashboard_data import similarity_stats as _stats


def _catalog(stats_file: Path) -> list[dict]:
    """Two models; the new columns on one of them, an older catalog's columns on the other."""
    new: dict[str, Any] = dict(
        stats_file=str(stats_file),
        tracking_uri="sqlite:////r/mlflow.db",
        experiment_id="5",
        labels=[0, 0, 1, 1, 1, 1, 2, 2],
    )
    rows = [row("new<m>", "dense", 0, ppl_ptb=10.0, speedup=1.0, ppl_ratio=1.0, **new)]
    acc = dict(acc_copa=55.0, n_copa=60.0, acc_boolq=62.0, n_boolq=3270.0, speedup_std=0.01)
    for method, budget, ppl, speed, bad in [
        ("lorp", 1, 11.0, 1.1, False),
        ("shortgpt", 1, 10.5, 1.6, True),  # over the 8/7 bound, and degraded
        ("lorp", 2, 30.0, 1.2, True),
        ("shortgpt", 2, 40.0, 1.3, True),
    ]:
        measured = dict(ppl_ptb=ppl, ppl_ratio=ppl / 10, speedup=speed, degraded=bad)
        rows.append(row("new<m>", method, budget, **measured, **acc, **new))
    rows += [
        row("old", m, b, ppl_ptb=20.0 + b, acc_copa=50.0) for m, b in [("dense", 0), ("lorp", 1)]
    ]
    return rows


def test_site_from_hand_made_catalog(tmp_path: Path) -> None:
    stats_file = _stats(8).to_file(tmp_path / "s.npz")
    index = build_site(_catalog(stats_file), tmp_path / "site")
    assert sorted(p.name for p in index.parent.iterdir()) == [
        "index.html",
        "model-new_m_.html",
        "model-old.html",
    ]
    text = index.read_text()
    assert "new&lt;m&gt;" in text and "<m>" not in text  # names are escaped
    assert "none (all degraded)" in text  # budget 2 of new<m>
    assert "lorp: " in text and "shortgpt: 10.50" not in text  # degraded never best
    assert "mlflow ui --host 127.0.0.1 --backend-store-uri sqlite:////r/mlflow.db" in text
    assert f'href="{UI}/#/experiments/5/runs/run-dense-0"' in text
    assert not re.findall(r'(?:src|href)="https?://(?!127\.0\.0\.1)', text)
    page = (tmp_path / "site" / "model-new_m_.html").read_text()
    # Three degraded variants: a badge in the layer maps, the three tables and the run list.
    assert page.count('class="badge degraded"') == 3 * 5
    assert page.count('<tr class="degraded">') == 3 * 4
    assert page.count('data-degraded="true"') == 3
    assert '55.00 \u00b1 12.59<span class="mark small">\u2020</span>' in page
    assert "62.00 \u00b1 1.66</td>" in page  # 3270 items: no mark
    assert page.count("above bound</span>") == 1 and "1.60 \u00b1 0.01" in page
    assert "from the catalog" in page and "<svg" in page
    old = (tmp_path / "site" / "model-old.html").read_text()
    assert '50.00<span class="mark unknown">\u2021</span>' in old
    assert "degraded</span>" not in old and "No cached S" in old


def test_empty_catalog_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="empty"):
        build_site([], tmp_path)


@pytest.mark.integration
def test_legacy_catalog_links_from_the_run_sqlite_store(tmp_path: Path) -> None:
    """A catalog from before the tracking columns: the experiment comes from RUN_DIR's store."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}"
    client = MlflowClient(uri)
    exp = client.create_experiment("job-a", artifact_location=str(tmp_path / "art"))
    run = client.create_run(exp).info.run_id
    old = row(mlflow_run_id=run)
    fallback = legacy_tracking(tmp_path, [old])
    assert fallback == {"job-a": {"tracking_uri": uri, "experiment_id": exp}}
    assert run_url(old, job_tracking([old], fallback), UI) == f"{UI}/#/experiments/{exp}/runs/{run}"
    assert legacy_tracking(tmp_path / "elsewhere", [old]) == {}  # no store there: no links


def test_timeline_page_in_the_site(tmp_path: Path) -> None:
    import json

    from pipeline.events.timeline import summarise

    rows = [row("a", "dense", 0, ppl_ptb=10.0), row("a", "lorp", 1, ppl_ptb=11.0)]
    events = tmp_path / "run" / "events.jsonl"
    events.parent.mkdir()
    events.write_text("".join(json.dumps(e) + "\n" for e in timeline_events()) + '{"cut')
    index = build_site(rows, tmp_path / "site", events_file=events)
    assert sorted(p.name for p in index.parent.iterdir()) == [
        "index.html",
        "model-a.html",
        "timeline.html",
    ]
    assert '<nav class="pages">Pages: <a href="timeline.html">job timeline</a></nav>' in (
        index.read_text()
    )
    page = (tmp_path / "site" / "timeline.html").read_text()
    assert "<h1>Timeline: tl&lt;job&gt;</h1>" in page  # names escaped
    # The utilisation printed is summarise's, to 0.1%: 78 / 168 = 46.4%.
    shown = f"{100 * summarise(timeline_events()[:-1]).utilisation:.1f}%"
    assert shown == "46.4%"
    assert f'<td class="l" data-figure="utilisation">{shown} ' in page
    assert '<td class="l" data-figure="slots">4 CPU</td>' in page
    assert "makespan / bound 1.05" in page and "40.0 s (a)" in page
    assert page.count("data-stage=") == 8 and page.count('data-failed="true"') == 1
    assert "Running now (1): b p2 point" in page
    assert '<td data-v="38.0"><span>38.0</span></td>' in page  # b's busy slot-seconds
    assert not re.findall(r'(?:src|href)="https?://', page)
    # An old run: events without spans; no events file at all. The site builds either way.
    events.write_text(json.dumps({"event": "start"}) + "\n")
    index = build_site(rows, tmp_path / "old", events_file=events)
    old = (tmp_path / "old" / "timeline.html").read_text()
    assert "No timeline: no span recorded in events.jsonl" in old and "<svg" not in old
    assert 'href="timeline.html"' in index.read_text()  # it has events: linked, says why
    index = build_site(rows, tmp_path / "none", events_file=tmp_path / "missing.jsonl")
    assert (
        "No timeline: no events.jsonl in the run directory"
        in (tmp_path / "none" / "timeline.html").read_text()
    )
    assert "timeline.html" not in index.read_text() and "<nav" not in index.read_text()
