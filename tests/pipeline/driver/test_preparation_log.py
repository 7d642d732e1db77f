"""What a model's preparation says as it goes (`pipeline.driver.preparation_log`): each
verb writes its event to the job's real event log, a line through `Progress` where a
person would want one, and the summary's lists where the job's end reports it."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorp.repair.stats import RepairStats
from pipeline.driver.preparation_log import PreparationLog
from pipeline.driver.summary import RunSummary
from pipeline.events.log import EventLog, read_events
from pipeline.events.progress import Progress
from pipeline.plan.grid import ModelPlan
from pipeline.plan.models import plan_models
from pipeline.spec.job import JobSpec
from pipeline.spec.parse import parse_spec
from pipeline.stages.statistics import ModelRepairStats
from pipeline.storage.bases import base_rel
from pipeline.storage.store import Storage
from tests.helpers.grid_points import model_stats, selected
from tests.helpers.job_specs import tiny_job
from tests.helpers.progress_lines import progress_lines
from tests.helpers.tiny_models import save_tiny


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> JobSpec:
    root = tmp_path_factory.mktemp("prep")
    model = save_tiny("llama", root / "llama")
    job = tiny_job(root, model, budgets=[2], methods=[{"name": "shortgpt"}])
    return parse_spec(job | {"repair": ["none", "linear"]})


@pytest.fixture(scope="module")
def plan(spec: JobSpec) -> ModelPlan:
    (plan,) = plan_models(spec)
    return plan


@pytest.fixture
def log(tmp_path: Path) -> PreparationLog:
    summary = RunSummary(tmp_path, tmp_path / "catalog", "sqlite:///x.db", str(tmp_path))
    events = EventLog(tmp_path / EventLog.NAME)
    return PreparationLog(events, Progress(bar=False), summary, Storage(tmp_path / "store"))


TRACEBACK = "Traceback (most recent call last):\n  ...\nOSError: worker died"
"""A Ray task's error: its last line is the cause."""


def events_of(log: PreparationLog) -> list[dict]:  # type: ignore[type-arg]
    """The events written, without their time stamps."""
    return [{k: v for k, v in e.items() if k != "time"} for e in read_events(log.events.path)]


def repair_stats(source: str, seconds: float, passes: int) -> ModelRepairStats:
    stats = RepairStats(6, 64, [(2, 3)])
    stats.tokens = 480
    return ModelRepairStats(stats, source, seconds, passes, "/cache/r.npz", Path("/cache/r.npz"))


def test_a_capture_is_an_event_and_a_line(log: PreparationLog, plan: ModelPlan, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ms, _ = model_stats(plan, tmp_path)
    with progress_lines() as lines:
        log.captured(plan, ms)
    assert events_of(log) == [
        {
            "event": "capture",
            "model": "tiny",
            "source": "computed",
            "file": str(ms.file),
            "seconds": 1.5,
            "tokens": 40,
            "early_workers": 0,
        }
    ]
    assert lines == [f"S {'tiny':<24} captured in 2s (40 calibration tokens)"]


def test_repair_scores_and_sums_are_events_and_lines(log: PreparationLog, plan: ModelPlan) -> None:
    with progress_lines() as lines:
        log.repair_scored(plan, repair_stats("cache", 0.0, 0), runs=3)
        log.repair_captured("tiny", repair_stats("computed", 1.2344, 2), [(2, 3)], variants=4)
    assert events_of(log) == [
        {"event": "repair_scores", "model": "tiny", "source": "cache", "runs": 3, "seconds": 0.0},
        {
            "event": "repair_capture",
            "model": "tiny",
            "source": "computed",
            "runs": [[2, 3]],
            "passes": 2,
            "seconds": 1.234,
            "tokens": 480,
            "file": "/cache/r.npz",
        },
    ]
    assert lines == [
        "repair scores tiny: 3 candidate runs, from the cache",
        "repair statistics tiny: 1 run(s) for 4 variant(s), captured in 1.2 s, 2 pass(es)",
    ]


def test_a_refused_repair_goes_into_the_summary(log: PreparationLog, spec, plan) -> None:  # type: ignore[no-untyped-def]
    _, repaired = selected(spec, plan, (0, 1))
    with progress_lines() as lines:
        log.repair_refused(repaired, "run 0-1 starts at block 0")
    assert log.summary.refused == ["tiny shortgpt+linear-b2: run 0-1 starts at block 0"]
    assert events_of(log) == [
        {
            "event": "repair_refused",
            "model": "tiny",
            "point": "shortgpt+linear-b2",
            "reason": "run 0-1 starts at block 0",
        }
    ]
    assert lines == ["tiny shortgpt+linear-b2: not repaired: run 0-1 starts at block 0"]


def test_a_failed_repair_capture_fails_each_repaired_point(log: PreparationLog, spec, plan) -> None:  # type: ignore[no-untyped-def]
    points = [selected(spec, plan, layers)[1] for layers in ((2, 3), (3, 4))]
    with progress_lines() as lines:
        log.repair_failed("tiny", points, RuntimeError(TRACEBACK))
    assert log.summary.failed == ["tiny/shortgpt+linear/2: OSError: worker died"] * 2
    events = events_of(log)
    assert [(e["event"], e["grid_key"], e["cause"]) for e in events] == [
        ("point_failed", p.key, "OSError: worker died") for p in points
    ]
    assert events[0]["error"] == TRACEBACK
    assert lines == ["repair statistics of tiny failed: OSError: worker died"]


def test_losses_and_spans_are_events(log: PreparationLog) -> None:
    spans = [{"stage": "losses", "start": 1.0, "end": 2.0}]
    log.losses(8, 6, spans)
    log.span("prepare", "tiny", 10.0, 12.5)
    assert events_of(log) == [
        {"event": "losses", "candidates": 8, "evaluated": 6, "spans": spans},
        {
            "event": "span",
            "stage": "prepare",
            "model": "tiny",
            "start": 10.0,
            "end": 12.5,
            "node": "driver",
            "worker": "driver",
            "slots": {},
        },
    ]


def test_the_base_is_stored_once_and_said_each_time(log: PreparationLog, plan: ModelPlan) -> None:
    with progress_lines() as lines:
        log.store_base(plan)
        log.store_base(plan)
    stored = log.storage.local_path(base_rel(plan.fingerprint))
    assert stored is not None and (stored / "model.safetensors").is_file()
    first, again = events_of(log)
    assert first["event"] == again["event"] == "base_stored"
    assert (first["written"], again["written"]) == (True, False)
    assert first["uri"] == again["uri"] == str(stored) and first["bytes"] == again["bytes"] > 0
    assert lines[1].endswith("MiB, stored by an earlier run)") and lines[1].startswith("base tiny:")
