"""MLflow links (`dashboards.links`) from the rows' tracking columns, else the caller's fallback."""

from __future__ import annotations

from dashboards.links import job_tracking, mlflow_command, run_url, tracking_view
from dashboards.site import legacy_tracking
from tests.helpers.dashboard_data import UI, row


def test_links_from_tracking_columns() -> None:
    uri = "sqlite:////runs/a/mlflow.db"
    r = row(tracking_uri=uri, experiment_id="7", mlflow_run_id="abc")
    tracking = job_tracking([r])
    assert tracking == {"job-a": {"tracking_uri": uri, "experiment_id": "7"}}
    assert run_url(r, tracking, UI) == f"{UI}/#/experiments/7/runs/abc"
    (job,) = tracking_view(tracking, UI)
    assert job["command"] == f"mlflow ui --host 127.0.0.1 --backend-store-uri {uri}"
    assert not job["redacted"]
    # A redacted database URI is shown as recorded, with a note.
    db = "postgresql://***@db:5432/ml"
    assert tracking_view(job_tracking([row(tracking_uri=db)]), UI)[0]["redacted"]
    # A tracking server serves its own run pages; the redacted user part is dropped.
    server = row(tracking_uri="https://***@mlflow.example.org/", experiment_id="3")
    assert run_url(server, job_tracking([server]), UI) == (
        "https://mlflow.example.org/#/experiments/3/runs/run-lorp-1"
    )
    assert mlflow_command("https://mlflow.example.org") is None


def test_fallback_only_fills_what_rows_lack() -> None:
    fallback = {"job-a": {"tracking_uri": "sqlite:///old.db", "experiment_id": "1"}}
    old = row()  # an older catalog: no tracking columns
    assert job_tracking([old], fallback)["job-a"] == fallback["job-a"]
    assert (
        run_url(old, job_tracking([old], fallback), UI) == f"{UI}/#/experiments/1/runs/run-lorp-1"
    )
    new = row(tracking_uri="sqlite:///new.db", experiment_id="9")
    assert job_tracking([new], fallback)["job-a"]["experiment_id"] == "9"
    assert run_url(old, job_tracking([old]), UI) is None  # nothing known: no link
    assert legacy_tracking("/nonexistent", [new]) == {}  # rows name their store: no query
