"""A model's preparation (`pipeline.driver.model_stages.Preparer`) on a tiny model and a real
local Ray: what it hands the fleet, in order (its capture stage, the prepared model, the
dense point once S is there, each unrepaired point as its selection is made, then the
repaired points with their runs' sums in the object store); what it skips when its
points are done; and a stop before a stage."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import pytest
import ray

from lorp.repair.stats import RepairStats
from pipeline.driver.model_stages import PreparedModel, Preparer, Stage, Stopping
from pipeline.driver.preparation_log import PreparationLog
from pipeline.driver.summary import RunSummary
from pipeline.driver.tasks import FOLLOWERS
from pipeline.events.log import EventLog
from pipeline.events.progress import Progress
from pipeline.messages import FollowerWindows
from pipeline.plan.grid import ModelPlan
from pipeline.plan.models import plan_models
from pipeline.spec.job import JobSpec
from pipeline.spec.parse import parse_spec
from pipeline.storage.store import Storage
from tests.helpers.job_specs import tiny_job
from tests.helpers.tiny_models import save_tiny_ptb

EVALUATION = {"perplexity": ["ptb"], "seq_len": 48, "max_windows": 2, "speed": False}
METHODS = [{"name": "shortgpt"}, {"name": "streamline"}]

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@dataclass
class Prepared:
    """One `prepare` of the model: what it handed over on the way, and what it returned."""

    emitted: list[tuple[str, Any]]
    model: PreparedModel


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> JobSpec:
    root = tmp_path_factory.mktemp("stages")
    model = save_tiny_ptb("llama", root / "llama")
    job = tiny_job(root, model, budgets=[1, 2], methods=METHODS, evaluation=EVALUATION)
    job["calibration"] |= {"samples": 8, "shards": 1}  # one capture pass of one worker
    return parse_spec(job | {"repair": ["none", "linear"]})


@pytest.fixture(scope="module")
def plan(spec: JobSpec) -> ModelPlan:
    (plan,) = plan_models(spec)
    return plan


def records(spec: JobSpec) -> PreparationLog:
    """What a preparation says, into the job's event log (no MLflow: the recorder's part)."""
    summary = RunSummary(spec.run_dir, spec.run_dir / "catalog", "", str(spec.run_dir))
    events = EventLog(spec.run_dir / EventLog.NAME)
    return PreparationLog(events, Progress(bar=False), summary, Storage(spec.run_dir))


def prepare(spec: JobSpec, plan: ModelPlan, done: frozenset[str] = frozenset()) -> Prepared:
    preparer = Preparer(spec, False, done, records(spec), lambda line: None)
    emitted: list[tuple[str, Any]] = []
    model = preparer.prepare(plan, "transformers", lambda kind, what: emitted.append((kind, what)))
    return Prepared(emitted, model)


@pytest.fixture(scope="module")
def first(ray_cluster: None, spec: JobSpec, plan: ModelPlan) -> Prepared:
    return prepare(spec, plan)


def handed(emitted: list[tuple[str, Any]]) -> list[list[str]]:
    """The points handed over, batch by batch, by name."""
    return [[p.name for p in what[0]] for kind, what in emitted if kind == "points"]


def test_it_hands_over_capture_the_model_dense_then_each_selection_then_repairs(
    first: Prepared, spec: JobSpec, plan: ModelPlan
) -> None:
    kinds = [kind if kind != "stage" else f"stage {what.name}" for kind, what in first.emitted]
    assert kinds == [
        "stage capture",
        "prepared",
        "stage selection",
        *["points"] * 5,  # dense, then each selection's unrepaired point
        "stage repair capture",
        "points",  # the repaired points, once their runs' sums are in the object store
    ]
    assert first.emitted[0][1] == Stage("capture", spec.resources.capture)
    assert first.emitted[2][1] == Stage("selection", None)  # no loss-guided method: the driver
    assert handed(first.emitted) == [
        ["dense"],
        ["shortgpt-b1"],
        ["shortgpt-b2"],
        ["streamline-b1"],
        ["streamline-b2"],
        [
            "shortgpt+linear-b1",
            "shortgpt+linear-b2",
            "streamline+linear-b1",
            "streamline+linear-b2",
        ],
    ]
    early = first.emitted[1][1]
    assert isinstance(early, PreparedModel) and early.points == [] and early.pending == []
    assert early.stats.source == "computed" and early.key == first.model.key
    assert early.plan == plan


def test_repaired_points_come_with_their_runs_sums_and_the_follower_windows(
    first: Prepared, plan: ModelPlan
) -> None:
    points, refs = first.emitted[-1][1]
    assert all(p.repair == "linear" for p in points)
    runs = sorted({run for p in points for run in p.runs})
    assert set(refs) == {("tiny", run) for run in runs} | {("tiny", FOLLOWERS)}
    for run in runs:
        sums = ray.get(refs[("tiny", run)])
        assert isinstance(sums, RepairStats) and sums.runs == [run] and sums.tokens > 0
    windows = ray.get(refs[("tiny", FOLLOWERS)])
    assert (
        isinstance(windows, FollowerWindows) and windows.held.shape[1] == windows.windows.shape[1]
    )
    unrepaired = [kind for kind, what in first.emitted[:-1] if kind == "points" and what[1]]
    assert unrepaired == []  # the other points need no sums


def test_the_prepared_model_has_every_point_all_pending(first: Prepared) -> None:
    model = first.model
    assert len(model.points) == 1 + 2 * 2 * 2  # dense; 2 methods x 2 budgets x 2 repairs
    assert [p.name for p in model.pending] == [n for batch in handed(first.emitted) for n in batch]
    assert model.skipped == 0 and model.stats.source == "computed"


def test_a_second_prepare_skips_the_done_points(
    first: Prepared, spec: JobSpec, plan: ModelPlan
) -> None:
    done = frozenset(p.key for p in first.model.points)
    again = prepare(spec, plan, done)
    assert [kind for kind, _ in again.emitted if kind not in ("stage", "prepared")] == ["done"] * 6
    skipped = [p.name for kind, what in again.emitted if kind == "done" for p in what]
    assert sorted(skipped) == sorted(p.name for p in first.model.points)
    assert again.model.pending == [] and again.model.skipped == 9
    assert again.model.stats.source == "cache"  # S captured by the first
    assert [p.key for p in again.model.points] == [p.key for p in first.model.points]


def test_with_the_dense_point_done_the_rest_is_handed_over(
    first: Prepared, spec: JobSpec, plan: ModelPlan
) -> None:
    dense = next(p for p in first.model.points if p.is_dense)
    again = prepare(spec, plan, frozenset({dense.key}))
    assert [p.name for kind, what in again.emitted if kind == "done" for p in what] == ["dense"]
    assert handed(again.emitted) == handed(first.emitted)[1:]
    assert again.model.skipped == 1 and len(again.model.pending) == 8


@pytest.mark.parametrize("how", ["stopping", "cancel"])
def test_a_stop_before_a_stage_ends_the_preparation(
    spec: JobSpec, plan: ModelPlan, how: str
) -> None:
    preparer = Preparer(spec, False, frozenset(), records(spec), lambda line: None)
    cancel = threading.Event()
    (preparer.stopping if how == "stopping" else cancel).set()
    emitted: list[tuple[str, Any]] = []
    with pytest.raises(Stopping, match=r"^tiny: stopped before capture$"):
        preparer.prepare(plan, "transformers", lambda *kw: emitted.append(kw), cancel)
    assert emitted == []
