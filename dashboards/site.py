"""The fleet catalog as a static, self-contained site: `lorp dashboard RUN_DIR`.

Pages: an overview of every model (N, RLS, K, best passing variant per budget; sortable and
filterable; links to model pages and MLflow runs; how to browse each job's MLflow store)
with the paper's Table 1 and Fig. 2, and one page per model with Fig. 1 (S), Fig. 2, the
cluster labels along depth, Fig. 4 (the pruned-block map of every method and budget),
Tables 2-3 (perplexity, accuracy with intervals, with the dense row), size and speed
against the N/(N-k) bound, and the quality/cost trade-off; and the job's timeline (a
Gantt chart of every span per worker slot, with the utilisation figures) from the run
directory's events.jsonl. Everything is inline: no network at view time.

This module only orchestrates: `overview_view`, `model_view` and `timeline_view` shape
the data, `overview`, `model_page` and `timeline_page` render it, and this writes the
files. It is also the only place that reads files (each model's S, once; the events) or
asks an MLflow store (older catalogs only).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from dashboards.catalog_rows import group_by_model, group_pages, page_names
from dashboards.links import job_tracking
from dashboards.model_page import model_page
from dashboards.model_view import model_view
from dashboards.overview import overview_page
from dashboards.overview_view import overview
from dashboards.shapes import Row
from dashboards.timeline_page import PAGE as TIMELINE
from dashboards.timeline_page import timeline_page
from dashboards.timeline_view import timeline_view

MLFLOW_UI = "http://127.0.0.1:5000"
log = logging.getLogger(__name__)


def load_S(row: Row) -> np.ndarray | None:
    """The S matrix of the row's cached statistics (`stats_file`: a path, or a file in a
    job's remote storage), or None when the file is absent or unreadable (e.g. written by
    another lorp version): no S figures then."""
    import tempfile

    from lorp import SimilarityStats
    from pipeline.storage.store import is_remote, split_location

    path = row.get("stats_file")
    if not path or not (is_remote(path) or Path(path).is_file()):
        return None
    try:
        if not is_remote(path):
            return SimilarityStats.from_file(path).matrix()
        store, name = split_location(path)
        with tempfile.TemporaryDirectory() as tmp:
            if not store.get_file(name, Path(tmp) / name):
                return None
            return SimilarityStats.from_file(Path(tmp) / name).matrix()
    except (ValueError, OSError) as exc:
        log.warning("%s: no S figures for %s", exc, row.get("model"))
        return None


def build_site(
    rows: Sequence[Row],
    out_dir: str | os.PathLike[str],
    *,
    mlflow_ui: str = MLFLOW_UI,
    fallback_tracking: Mapping[str, Row] | None = None,
    events_file: str | os.PathLike[str] | None = None,
) -> Path:
    """Write index.html, one page per model and the job's timeline.html into `out_dir`;
    returns index.html.

    MLflow links come from each row's `tracking_uri` and `experiment_id`;
    `fallback_tracking` (job -> {tracking_uri, experiment_id}, see `legacy_tracking`)
    fills in for catalogs written before those columns existed. `events_file` is the run
    directory's `events.jsonl`: the timeline page's spans (when the file is missing or has
    no spans, the page says so in one line), linked from the overview when the file has
    events; no timeline page without it.
    """
    if not rows:
        raise ValueError("the catalog is empty: nothing to show")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    has_events = write_timeline(events_file, out / TIMELINE)
    by_model = group_by_model(rows)
    S_of = {m: load_S(rs[0]) for m, rs in by_model.items()}
    profiles = {m: S for m, S in S_of.items() if S is not None}
    tracking = job_tracking(rows, fallback_tracking)
    by_page = group_pages(rows)
    for (model, protocol), page_rows in by_page.items():
        view = model_view(model, page_rows, S_of[model], tracking, mlflow_ui)
        page = model_page(view, S_of[model], profiles)
        (out / page_names(by_page)[(model, protocol)]).write_text(page)
    index = out / "index.html"
    nav = [("job timeline", TIMELINE)] if has_events else []
    ov = overview(by_page, tracking, mlflow_ui)
    index.write_text(overview_page(ov, profiles, nav=nav))
    return index


def write_timeline(events_file: str | os.PathLike[str] | None, path: Path) -> bool:
    """The timeline page from the run's events (or the line saying there is none; no page
    when no run directory was named); whether the file had any event."""
    from pipeline.events.log import read_events

    if events_file is None:
        return False
    if not Path(events_file).is_file():
        path.write_text(timeline_page(None, "no events.jsonl in the run directory"))
        return False
    events = read_events(Path(events_file))
    path.write_text(timeline_page(timeline_view(events)))
    return bool(events)


def experiment_ids(tracking_uri: str, rows: Sequence[Row]) -> dict[str, str]:
    """job -> MLflow experiment id, asked of the store (empty when it is unreachable)."""
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri)
        out = {}
        for job in sorted({r["job"] for r in rows}):
            run_id = next(
                r["mlflow_run_id"] for r in rows if r["job"] == job and r.get("mlflow_run_id")
            )
            out[job] = client.get_run(run_id).info.experiment_id
        return out
    except Exception as exc:  # links are a convenience: the site builds without them
        log.warning("no MLflow run links: %s", exc)
        return {}


def legacy_tracking(run_dir: str | os.PathLike[str], rows: Sequence[Row]) -> dict[str, dict]:
    """For catalogs without `tracking_uri`/`experiment_id`: the run directory's default
    sqlite store (RUN_DIR/mlflow.db), when present, for the jobs whose rows lack them."""
    recorded = job_tracking(rows)
    missing = [r for r in rows if not all(recorded[r["job"]].values())]
    db = Path(run_dir) / "mlflow.db"
    if not missing or not db.is_file():
        return {}
    uri = f"sqlite:///{db.resolve()}"
    return {
        job: {"tracking_uri": uri, "experiment_id": exp}
        for job, exp in experiment_ids(uri, missing).items()
    }
