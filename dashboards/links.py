"""MLflow links and how to browse each job's store, from the rows' own records.

Every catalog row names its store (`tracking_uri`, credentials already redacted) and its
experiment (`experiment_id`); a run page is `{ui}/#/experiments/{experiment}/runs/{run}`,
and a registered variant's version page (its `model_uri`, `models:/<name>/<version>`) is
`{ui}/#/models/{name}/versions/{version}`.
A local store (sqlite, a file path, a database) is served by `mlflow ui`; a tracking
server (http/https) serves its own pages. Catalogs written before those columns existed
get them from a caller's fallback (`site.legacy_tracking`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from urllib.parse import quote, urlsplit, urlunsplit

from dashboards.shapes import Row, View

NO_TRACKING: Mapping[str, None] = {"tracking_uri": None, "experiment_id": None}


def _strip_userinfo(uri: str) -> str:
    parts = urlsplit(uri)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2])).rstrip("/")


def is_server(tracking_uri: str) -> bool:
    return tracking_uri.startswith(("http://", "https://"))


def ui_base(tracking_uri: str | None, mlflow_ui: str) -> str:
    """Where run pages live: the tracking server itself, or a local `mlflow ui`."""
    if tracking_uri and is_server(tracking_uri):
        return _strip_userinfo(tracking_uri)
    return mlflow_ui.rstrip("/")


def mlflow_command(tracking_uri: str | None) -> str | None:
    """The command that serves a store's runs (None for a tracking server: open it)."""
    if not tracking_uri or is_server(tracking_uri):
        return None
    return f"mlflow ui --host 127.0.0.1 --backend-store-uri {tracking_uri}"


def job_tracking(rows: Iterable[Row], fallback: Mapping[str, Row] | None = None) -> dict[str, View]:
    """job -> {tracking_uri, experiment_id}: from the rows' own columns, else `fallback`
    (what an older catalog's store says), else Nones."""
    out: dict[str, View] = {}
    for r in rows:
        seen = out.setdefault(r["job"], dict(NO_TRACKING))
        for key in seen:
            if seen[key] is None and r.get(key):
                seen[key] = str(r[key])
    for job, seen in out.items():
        for key in seen:
            if seen[key] is None and fallback and (fallback.get(job) or {}).get(key):
                seen[key] = str(fallback[job][key])
    return out


def run_url(row: Row, tracking: Mapping[str, View], mlflow_ui: str) -> str | None:
    """`{ui}/#/experiments/{experiment_id}/runs/{mlflow_run_id}`, or None when unknown."""
    job = tracking.get(row.get("job", ""), {})
    exp = row.get("experiment_id") or job.get("experiment_id")
    run = row.get("mlflow_run_id")
    if not run or not exp:
        return None
    base = ui_base(row.get("tracking_uri") or job.get("tracking_uri"), mlflow_ui)
    return f"{base}/#/experiments/{exp}/runs/{run}"


def model_version_url(row: Row, tracking: Mapping[str, View], mlflow_ui: str) -> str | None:
    """`{ui}/#/models/{name}/versions/{version}` from the row's `model_uri`, or None when
    the row's variant is not registered."""
    m = re.fullmatch(r"models:/([^/@]+)/(\d+)", str(row.get("model_uri") or ""))
    if not m:
        return None
    job = tracking.get(row.get("job", ""), {})
    base = ui_base(row.get("tracking_uri") or job.get("tracking_uri"), mlflow_ui)
    return f"{base}/#/models/{quote(m.group(1), safe='')}/versions/{m.group(2)}"


def tracking_view(tracking: Mapping[str, View], mlflow_ui: str) -> list[View]:
    """One entry per job: store, experiment, the command to browse it, the UI address."""
    out = []
    for job, t in sorted(tracking.items()):
        uri = t["tracking_uri"]
        out.append(
            {
                "job": job,
                "tracking_uri": uri,
                "experiment_id": t["experiment_id"],
                "command": mlflow_command(uri),
                "ui": ui_base(uri, mlflow_ui),
                "redacted": bool(uri and "***" in uri),
            }
        )
    return out
