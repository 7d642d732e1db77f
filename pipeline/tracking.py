"""MLflow records: a parent run per model, a child run per grid point.

The default store is sqlite inside the run directory (no server); MLFLOW_TRACKING_URI or
the spec points elsewhere. Runs are found again by tags, so a rerun reuses the model's
parent run and never duplicates a grid point's child run. A crashed attempt's runs are
closed as FAILED on the next start, unless the catalog shows their point completed.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

import lorp

log = logging.getLogger(__name__)

KIND, JOB, MODEL_KEY, GRID_KEY = "lorp.kind", "lorp.job", "lorp.model_key", "lorp.grid_key"


def git_commit() -> str:
    """The lorp source commit, when it runs from a checkout; LORP_GIT_COMMIT otherwise."""
    if os.environ.get("LORP_GIT_COMMIT"):
        return os.environ["LORP_GIT_COMMIT"]
    src = Path(lorp.__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            ["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def redact(uri: str) -> str:
    """A URI fit for logs: any user:password@ part is replaced by ***@."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(uri)
    if parts.username or parts.password:
        host = parts.hostname or ""
        netloc = f"***@{host}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    return uri


def default_tracking_uri(run_dir: Path) -> str:
    return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


class Tracker:
    """Thin wrapper over MlflowClient for one job's experiment."""

    def __init__(self, uri: str, experiment: str, artifact_dir: Path) -> None:
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            artifact_dir.mkdir(parents=True, exist_ok=True)
            self.experiment_id = self.client.create_experiment(
                experiment, artifact_location=artifact_dir.resolve().as_uri()
            )
        else:
            self.experiment_id = exp.experiment_id
        self.base_tags = {"lorp.version": lorp.__version__, "lorp.git_commit": git_commit()}

    # -- finding runs ----------------------------------------------------------------------

    def _search(self, filter_string: str) -> list[Any]:
        runs, token = [], None
        while True:
            page = self.client.search_runs(
                [self.experiment_id], filter_string, max_results=1000, page_token=token
            )
            runs.extend(page)
            token = page.token
            if not token:
                return runs

    def runs_of_kind(self, kind: str, job: str) -> list[Any]:
        return self._search(f"tags.`{KIND}` = '{kind}' and tags.`{JOB}` = '{job}'")

    # -- parent (model) runs ---------------------------------------------------------------

    def model_run(self, job: str, model_key: str, name: str) -> str:
        """The model's parent run id, created once per job."""
        for run in self.runs_of_kind("model", job):
            if run.data.tags.get(MODEL_KEY) == model_key:
                return run.info.run_id
        run = self.client.create_run(
            self.experiment_id,
            run_name=name,
            tags={**self.base_tags, KIND: "model", JOB: job, MODEL_KEY: model_key},
        )
        return run.info.run_id

    def record_model(
        self,
        run_id: str,
        params: Mapping[str, Any],
        metrics: Mapping[str, float],
        S: np.ndarray,
        labels: list[int] | None,
    ) -> None:
        self.log(run_id, params=params, metrics=metrics)
        with tempfile.TemporaryDirectory() as tmp:
            np.save(Path(tmp) / "S.npy", S)
            self.client.log_artifact(run_id, str(Path(tmp) / "S.npy"))
            heatmap_png(S, Path(tmp) / "S.png", title=str(params.get("model", "")))
            self.client.log_artifact(run_id, str(Path(tmp) / "S.png"))
            if labels is not None:
                (Path(tmp) / "clusters.json").write_text(json.dumps({"labels": labels}))
                self.client.log_artifact(run_id, str(Path(tmp) / "clusters.json"))
        self.client.set_terminated(run_id, "FINISHED")

    # -- child (grid point) runs -----------------------------------------------------------

    def start_point(self, job: str, parent_id: str, grid_key: str, name: str) -> str:
        run = self.client.create_run(
            self.experiment_id,
            run_name=name,
            tags={
                **self.base_tags,
                KIND: "point",
                JOB: job,
                GRID_KEY: grid_key,
                "mlflow.parentRunId": parent_id,
            },
        )
        return run.info.run_id

    def log(
        self,
        run_id: str,
        *,
        params: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> None:
        self.client.log_batch(
            run_id,
            metrics=[
                Metric(k, float(v), 0, 0)
                for k, v in (metrics or {}).items()
                if v is not None and np.isfinite(v)
            ],
            params=[Param(k, _param(v)) for k, v in (params or {}).items()],
            tags=[RunTag(k, str(v)) for k, v in (tags or {}).items()],
        )

    def finish(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status)

    def close_stale_runs(self, job: str, completed: Mapping[str, str]) -> int:
        """Close runs a killed driver left RUNNING: FINISHED when the catalog holds their
        point (`completed`: grid_key -> run id), FAILED otherwise. Returns how many."""
        n = 0
        for kind in ("point", "model"):
            for run in self.runs_of_kind(kind, job):
                if run.info.status != "RUNNING":
                    continue
                done = completed.get(run.data.tags.get(GRID_KEY, "")) == run.info.run_id
                self.client.set_terminated(run.info.run_id, "FINISHED" if done else "FAILED")
                n += 1
        return n

    def delete(self, run_id: str) -> None:
        self.client.delete_run(run_id)


def _param(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text[:6000]


def heatmap_png(S: np.ndarray, path: Path, title: str = "") -> Path:
    """The S heatmap (the paper's Fig. 1) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.2, 3.6), dpi=110)
    im = ax.imshow(S, cmap="viridis", vmin=min(0.0, float(S.min())), vmax=1.0, origin="upper")
    ax.set_xlabel("block input j")
    ax.set_ylabel("block input i")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="mean token cosine")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
