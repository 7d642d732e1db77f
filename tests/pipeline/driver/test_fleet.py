"""The fleet's scheduling (`pipeline.driver.fleet.Fleet`), step by step on a real local Ray
with a real recorder (sqlite MLflow, the job's Delta catalog) and real point tasks on
tiny models: earlier models' points are submitted first, at most `max_concurrent_points`
plus the queued-ahead allowance are in flight, a model's speed task starts only once its
last point ended, and a stop closes the points in flight as KILLED and says what is left.

The grid points are made by hand (`tests.helpers.grid_points`): the fleet schedules what
a preparation hands it, whichever blocks were chosen."""

from __future__ import annotations

import dataclasses
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import ray
from mlflow.tracking import MlflowClient

from pipeline.catalog.table import read_catalog
from pipeline.driver.fleet import Fleet, Stopped
from pipeline.driver.model_stages import PreparedModel, Preparer, Stage
from pipeline.driver.recorder import Recorder
from pipeline.driver.tasks import TaskMaker
from pipeline.events.log import read_events
from pipeline.events.progress import Progress
from pipeline.plan.grid import GridPoint, ModelPlan
from pipeline.plan.models import plan_models, resolve_backend
from pipeline.spec.job import JobSpec
from pipeline.spec.parse import parse_spec
from pipeline.spec.resources import Resources
from pipeline.tracking.runs import default_tracking_uri
from tests.helpers.grid_points import CALIBRATION, model_grid, model_stats, selected
from tests.helpers.job_specs import tiny_job
from tests.helpers.tiny_models import save_tiny_ptb

RAY_CPUS = 2
"""Two CPU slots: two points of one CPU run at once."""
EVALUATION = {"perplexity": ["ptb"], "seq_len": 48, "max_windows": 2, "speed": True}

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny models whose weights differ (their points' keys differ)."""
    root = tmp_path_factory.mktemp("models")
    return {name: save_tiny_ptb("llama", root / name, seed=i) for i, name in enumerate("ab")}


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    return default_tracking_uri(tmp_path_factory.mktemp("mlflow"))


@pytest.fixture(autouse=True)
def no_tracking_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # it would win over the spec's


def job(root: Path, models: dict[str, Path], uri: str, name: str, **fields: Any) -> JobSpec:
    """A job over `models` (shortgpt, evaluation off unless `fields` say), nothing stored
    or registered."""
    spec = tiny_job(root, models["a"], name)
    spec["models"] = [{"ref": str(path), "name": label} for label, path in models.items()]
    spec["methods"] = [{"name": "shortgpt"}]
    spec["tracking"] = {"mlflow_uri": uri, "register": False}
    spec["checkpoints"] = "none"
    return parse_spec(spec | fields)


def fleet_for(spec: JobSpec, preparer: Any = None) -> Fleet:
    """The job's fleet as `run_job` builds it (the job's own `Preparer` unless given)."""
    recorder = Recorder(spec, False, Progress(bar=False))
    done = recorder.open()
    preparer = preparer or Preparer(spec, False, done, recorder.preparation, lambda line: None)
    backend = resolve_backend(spec, vllm_installed=False)
    tasks = TaskMaker.for_job(spec, recorder.storage.location, backend)
    return Fleet(tasks, preparer, recorder, plan_models(spec))


def prepared(spec: JobSpec, plan: ModelPlan, points: list[GridPoint]) -> PreparedModel:
    """The model as its preparation returns it, with `points` all to run."""
    ms, profile = model_stats(plan, spec.run_dir)
    return PreparedModel(plan, ms, profile, plan.model_key(CALIBRATION), points, points, 0)


def pruned(spec: JobSpec, plan: ModelPlan) -> list[GridPoint]:
    """Two shortgpt points: budget 1 (block 1 removed), budget 2 (blocks 1 and 2)."""
    return [point for layers in ((1,), (1, 2)) for point in selected(spec, plan, layers)]


def record_models(fleet: Fleet, spec: JobSpec) -> None:
    """What each model's `prepared` hand-over records: its parent run and facts."""
    for chain in fleet.chains:
        prep = prepared(spec, chain.plan, [])
        fleet.recorder.model_prepared(prep.plan, prep.stats, prep.profile, prep.key)


def events(spec: JobSpec) -> list[dict[str, Any]]:
    return read_events(spec.run_dir / "events.jsonl")


def begun(spec: JobSpec) -> list[str]:
    """The points the fleet submitted, in order (each one's `begin` event)."""
    return [e["unit"] for e in events(spec) if e["event"] == "begin" and e["stage"] == "point"]


def keys(points: list[GridPoint]) -> list[str]:
    return [p.key for p in points]


@dataclasses.dataclass
class Queued:
    """A two-model fleet whose points are queued, model b's before model a's."""

    spec: JobSpec
    fleet: Fleet
    a: list[GridPoint]
    b: list[GridPoint]


def queued(root: Path, models: dict[str, Path], uri: str, name: str) -> Queued:
    spec = job(root, models, uri, name)
    fleet = fleet_for(spec)
    record_models(fleet, spec)
    a, b = fleet.chains
    points_a, points_b = pruned(spec, a.plan), pruned(spec, b.plan)
    fleet._enqueue(b, points_b)  # model b's points are ready first
    fleet._enqueue(a, points_a)
    return Queued(spec, fleet, points_a, points_b)


def test_earlier_models_points_go_first_and_the_window_bounds_those_in_flight(
    ray_cluster: None, models: dict[str, Path], mlflow_uri: str, tmp_path: Path
) -> None:
    q = queued(tmp_path, models, mlflow_uri, "order")
    fleet, (a, b) = q.fleet, q.fleet.chains
    # two slots of one CPU each, and two points at most: one more is queued in Ray
    assert fleet.capacity == 2 and fleet._queued_ahead() == 1
    fleet._submit()
    assert len(fleet.in_flight) == 3 and [p.key for *_, p in fleet.queue] == [q.b[1].key]
    assert begun(q.spec) == [*keys(q.a), q.b[0].key]  # a's first, then in order
    assert (a.running, b.running) == (2, 2)
    runs = MlflowClient(tracking_uri=mlflow_uri).search_runs(
        [fleet.recorder.tracker.experiment_id], "tags.`lorp.kind` = 'point'"
    )
    assert sorted(r.info.run_name for r in runs) == ["shortgpt-b1", "shortgpt-b1", "shortgpt-b2"]


def test_each_point_is_recorded_as_it_ends_and_the_queue_drains_in_order(
    ray_cluster: None, models: dict[str, Path], mlflow_uri: str, tmp_path: Path
) -> None:
    q = queued(tmp_path, models, mlflow_uri, "drain")
    fleet, (a, b) = q.fleet, q.fleet.chains
    while fleet.in_flight or fleet.queue:
        fleet._submit()
        assert len(fleet.in_flight) <= 3
        fleet._wait()
    assert begun(q.spec) == keys(q.a) + keys(q.b)
    assert (a.running, b.running, fleet.recorded) == (0, 0, 4)
    rows = {r["grid_key"]: r for r in read_catalog(q.spec.run_dir / "catalog")}
    assert set(rows) == set(keys(q.a + q.b))
    assert sorted((r["model"], r["budget"], r["pruned_layers"]) for r in rows.values()) == [
        (m, b, [1, 2][:b]) for m in "ab" for b in (1, 2)
    ]


def test_the_queued_ahead_allowance_is_half_the_points_where_slots_bind(
    ray_cluster: None, models: dict[str, Path], mlflow_uri: str, tmp_path: Path
) -> None:
    fleet = fleet_for(job(tmp_path, models, mlflow_uri, "allowance"))
    allowance = {}
    for capacity in (1, 2, 4, 5):
        fleet.capacity = capacity
        allowance[capacity] = fleet._queued_ahead()
    # one point fits the 2 slots with room to spare: none queued ahead
    assert allowance == {1: 0, 2: 1, 4: 2, 5: 2}
    fleet.backend = "vllm"  # each point there starts an evaluator actor
    assert fleet._queued_ahead() == 0


class HandOver:
    """A model's preparation that hands the fleet `PreparedModel`s made by hand, as the
    real one does from the model's thread: its records, then its points; the fleet uses
    nothing else of a `Preparer` but `stopping`."""

    def __init__(self, models: dict[str, PreparedModel]) -> None:
        self.models = models
        self.stopping = threading.Event()

    def prepare(
        self, plan: ModelPlan, backend: str, emit: Any, cancel: threading.Event
    ) -> PreparedModel:
        prep = self.models[plan.label]
        emit("prepared", dataclasses.replace(prep, points=[], pending=[]))
        emit("points", (prep.points, {}))
        return prep


def test_a_models_speed_task_starts_only_once_its_last_point_ended(
    ray_cluster: None, models: dict[str, Path], mlflow_uri: str, tmp_path: Path
) -> None:
    speed = {"num_cpus": 1}  # not a whole node: a point never holds the speed task back
    resources = {"capture_workers": 1, "speed": speed}
    one = {"a": models["a"]}
    spec = job(tmp_path, one, mlflow_uri, "speed", evaluation=EVALUATION, resources=resources)
    (plan,) = plan_models(spec)
    dense = model_grid(spec, plan).dense()
    assert dense is not None
    points = [dense, *pruned(spec, plan)]
    fleet = fleet_for(spec, HandOver({"a": prepared(spec, plan, points)}))
    (a,) = fleet.chains

    fleet._start_models()
    a.future.result(timeout=30)
    fleet._harvest()  # its records, its points queued, its preparation ended
    assert (a.state, a.prepared, a.running, len(fleet.queue)) == ("points", True, 3, 3)
    fleet._submit()
    while a.running:
        fleet._finish_models()
        assert not fleet.speeds and a.state == "points", f"{a.running} point(s) still running"
        fleet._wait()
    fleet._finish_models()
    assert a.state == "speed" and a.stage == Stage("speed", Resources(**speed))
    (ref,) = fleet.speeds
    kinds = [(e["event"], e.get("unit")) for e in events(spec) if e["event"] in ("begin", "finish")]
    last_point = max(kinds.index(("finish", p.key)) for p in points)
    assert kinds.index(("begin", "speed:a")) > last_point

    ray.cancel(ref, force=True)  # what it measures is not the fleet's: a failed speed task
    while fleet.speeds:
        fleet._wait()
    assert a.state == "done" and not fleet._pending()
    said = [e["event"] for e in events(spec)]
    assert said.index("speed_failed") < said.index("model_done")


def test_a_stop_kills_the_points_in_flight_and_says_what_is_left(
    ray_cluster: None, models: dict[str, Path], mlflow_uri: str, tmp_path: Path
) -> None:
    fleet = queued(tmp_path, models, mlflow_uri, "stop").fleet
    fleet._submit()
    in_flight = [point for point, _ in fleet.in_flight.values()]
    assert len(in_flight) == 3
    fleet.stop_requested = signal.SIGTERM  # what `stop_signals` sets
    with pytest.raises(Stopped, match="^stopped by SIGTERM$") as stopped:
        fleet.run()
    assert (stopped.value.name, stopped.value.exit_code) == ("SIGTERM", 128 + 15)
    assert fleet.in_flight == {} and fleet.cut_short == 3
    assert fleet.preparer.stopping.is_set() and all(c.cancel.is_set() for c in fleet.chains)
    client = MlflowClient(tracking_uri=mlflow_uri)
    runs = [client.get_run(fleet.recorder.run_ids[p.key]) for p in in_flight]
    assert [r.info.status for r in runs] == ["KILLED"] * 3
    assert fleet.status_line() == (
        "0 point(s) done this attempt, 0 failed, 4 point(s) stopped or queued, "
        "2 model(s) not yet prepared"
    )


def test_a_stop_by_ctrl_c_exits_with_130() -> None:
    stop = Stopped(signal.SIGINT)
    assert (stop.name, stop.exit_code, str(stop)) == ("SIGINT", 130, "stopped by SIGINT")
