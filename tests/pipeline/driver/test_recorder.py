"""The recorder as the one writer of a job's records (`pipeline.driver.recorder`), on a real
sqlite MLflow and the job's real Delta catalog: a point's run holds its figures before
its one row goes in, and is closed after; a failed point closes its run FAILED and
writes no row; a later figure goes into the run, then the row; a restart finds the rows
done. The catalog's publisher seam (`Catalog.publish`) sees each commit as it happens,
so what the MLflow run held at that moment is read then."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from pipeline.catalog.table import read_catalog
from pipeline.driver.point_records import point_params
from pipeline.driver.recorder import Recorder
from pipeline.events.log import read_events
from pipeline.events.progress import Progress
from pipeline.messages import PointResult
from pipeline.plan.grid import GridPoint
from pipeline.plan.models import plan_models
from pipeline.spec.job import JobSpec
from pipeline.spec.parse import parse_spec
from pipeline.tracking.runs import GRID_KEY, default_tracking_uri
from tests.helpers.grid_points import CALIBRATION, model_stats, selected
from tests.helpers.job_specs import tiny_job
from tests.helpers.tiny_models import save_tiny

pytestmark = pytest.mark.integration

EVALUATION = {"perplexity": ["ptb"], "seq_len": 48, "max_windows": 2, "speed": False}
FIGURES = {"ppl_ptb": 31.5, "params": 150_000.0, "seconds": 2.0, "n_evals": 0.0, "select_s": 0.5}
"""The MLflow metrics of the point below: its perplexity, size, time and selection cost."""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("model") / "llama")


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One sqlite store for the module (each test its own job and experiment)."""
    return default_tracking_uri(tmp_path_factory.mktemp("mlflow"))


@pytest.fixture(autouse=True)
def no_tracking_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # it would win over the spec's


class Seen:
    """A catalog publisher (`pipeline.catalog.table.Publisher`) that reads, at each commit,
    what the row's MLflow run holds then."""

    def __init__(self, client: MlflowClient) -> None:
        self.client = client
        self.commits: list[dict[str, Any]] = []

    def changed(self, row: Mapping[str, Any], removed: Iterable[str] = ()) -> None:
        run = self.client.get_run(row["mlflow_run_id"])
        self.commits.append(
            {"key": row["grid_key"], "status": run.info.status, "metrics": run.data.metrics}
        )

    def whole(self) -> None:
        pass


class Job:
    """A job's recorder, its model prepared, and one point of `shortgpt` removing 2, 3."""

    def __init__(self, root: Path, model: Path, uri: str, name: str) -> None:
        spec = tiny_job(root, model, name, budgets=[2], methods=[{"name": "shortgpt"}])
        self.spec: JobSpec = parse_spec(
            spec | {"evaluation": EVALUATION, "tracking": {"mlflow_uri": uri}}
        )
        (self.plan,) = plan_models(self.spec)
        self.recorder = self.start()
        self.client = MlflowClient(tracking_uri=uri)
        self.done = self.recorder.open()
        ms, profile = model_stats(self.plan, root)
        self.recorder.model_prepared(self.plan, ms, profile, self.plan.model_key(CALIBRATION))
        (self.point,) = selected(self.spec, self.plan, (2, 3), seconds=0.5)
        self.seen = Seen(self.client)
        self.recorder.catalog.publish = self.seen

    def start(self, force: bool = False) -> Recorder:
        return Recorder(self.spec, force, Progress(bar=False))

    def run(self, point: GridPoint | None = None) -> Any:
        return self.client.get_run(self.recorder.run_ids[(point or self.point).key])

    def rows(self) -> list[dict[str, Any]]:
        return read_catalog(self.spec.run_dir / "catalog")

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in read_events(self.spec.run_dir / "events.jsonl") if e["event"] == kind]


def result(point: GridPoint) -> PointResult:
    return PointResult(point.key, [0, 1, 4, 5], 150_000, 200_000, {"ppl_ptb": 31.5}, seconds=2.0)


@pytest.fixture
def job(tmp_path: Path, model: Path, mlflow_uri: str, request: pytest.FixtureRequest) -> Job:
    name = request.node.name.removeprefix("test_")[:40].replace("_", "-")
    return Job(tmp_path, model, mlflow_uri, name)


def test_a_fresh_run_directory_has_no_point_done(job: Job) -> None:
    assert job.done == frozenset()
    (start,) = job.events("start")
    assert start["job"] == job.spec.name and start["closed_stale_runs"] == 0
    assert start["run_id"] == job.recorder.run_id and start["force"] is False


def test_a_finished_points_run_holds_its_figures_before_its_one_row_goes_in(job: Job) -> None:
    rec, point = job.recorder, job.point
    rec.point_started(point)
    run = job.run()
    assert run.info.status == "RUNNING" and run.data.tags[GRID_KEY] == point.key
    assert run.data.tags["mlflow.parentRunId"] == rec.parents["tiny"]
    assert run.data.params["pruned_layers"] == "[2, 3]"
    assert set(run.data.params) == set(point_params(point))

    rec.point_done(point, result(point), "transformers")
    # at the row's commit the run held every figure, and was not yet closed
    assert job.seen.commits == [{"key": point.key, "status": "RUNNING", "metrics": FIGURES}]
    run = job.run()
    assert run.info.status == "FINISHED" and run.data.metrics == FIGURES
    checkpoint = rec.storage.uri(point.checkpoint or "")
    assert run.data.tags["checkpoint"] == checkpoint and checkpoint.endswith("shortgpt-b2")
    assert run.data.tags["eval_backend"] == "transformers"

    (row,) = job.rows()
    expected = {
        "grid_key": point.key,
        "job": job.spec.name,
        "run_id": rec.run_id,
        "model": "tiny",
        "method": "shortgpt",
        "method_label": "shortgpt",
        "budget": 2,
        "pruned_layers": [2, 3],
        "kept_layers": [0, 1, 4, 5],
        "repair": "none",
        "params": 150_000,
        "params_dense": 200_000,
        "checkpoint": checkpoint,
        "eval_backend": "transformers",
        "mlflow_run_id": run.info.run_id,
        "ppl_ptb": 31.5,
        "select_s": 0.5,
    }
    assert {k: row[k] for k in expected} == expected
    assert rec.summary.done == 1
    (event,) = job.events("point")
    assert (event["grid_key"], event["method"], event["budget"]) == (point.key, "shortgpt", 2)
    assert [e["unit"] for e in job.events("finish")] == [point.key]


def test_a_restart_finds_the_done_points_key_unless_forced(job: Job) -> None:
    job.recorder.point_started(job.point)
    job.recorder.point_done(job.point, result(job.point), "transformers")
    assert job.start().open() == frozenset({job.point.key})
    assert job.start(force=True).open() == frozenset()


def test_a_failed_point_closes_its_run_failed_and_writes_no_row(job: Job) -> None:
    rec, point = job.recorder, job.point
    rec.point_started(point)
    rec.point_failed(point, RuntimeError("Traceback (most recent call last):\nOSError: died"))
    assert job.run().info.status == "FAILED"
    assert job.rows() == [] and job.seen.commits == []
    assert rec.summary.failed == ["tiny/shortgpt/2: OSError: died"] and rec.summary.done == 0
    (event,) = job.events("point_failed")
    assert (event["grid_key"], event["cause"]) == (point.key, "OSError: died")
    assert job.start().open() == frozenset()


def test_a_later_figure_goes_into_the_run_then_the_row(job: Job) -> None:
    rec, point = job.recorder, job.point
    rec.point_started(point)
    rec.point_done(point, result(point), "transformers")
    rec.speed_done("tiny", {point.key: {"speedup": 1.25, "latency_ms": 3.5}})
    assert job.seen.commits[-1]["metrics"] == FIGURES | {"speedup": 1.25, "latency_ms": 3.5}
    (row,) = job.rows()
    assert (row["speedup"], row["latency_ms"]) == (1.25, 3.5)
    rec._update(point.key, {"speed_skipped": "why"}, tags={"speed_skipped": "why"})
    assert job.run().data.tags["speed_skipped"] == "why"
    assert job.rows()[0]["speed_skipped"] == "why"
    (speed,) = job.events("speed")
    assert speed == speed | {"model": "tiny", "variants": 1}


def test_a_point_run_again_replaces_its_old_run(job: Job) -> None:
    rec, point = job.recorder, job.point
    rec.point_started(point)
    rec.point_done(point, result(point), "transformers")
    old = job.run().info.run_id
    rec.point_started(point)  # a forced rerun of the same slot
    assert job.client.get_run(old).info.lifecycle_stage == "deleted"
    assert job.run().info.run_id != old and job.run().info.status == "RUNNING"


def test_a_point_cut_short_by_a_stop_has_its_run_killed(job: Job) -> None:
    job.recorder.point_started(job.point)
    job.recorder.killed([job.point])
    assert job.run().info.status == "KILLED"
    assert job.rows() == [] and job.start().open() == frozenset()
