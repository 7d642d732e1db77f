"""`JobRun`: one execution of a job spec, the context every stage of the driver shares:
the spec, the run directory, the storage, the MLflow tracker, the event log, the catalog,
progress, and what the stages learn on the way (model facts, parent runs, point runs).

The storage (`pipeline.records.storage`) is where results live for every node: by default the run
directory itself; with `storage:` set, the run directory is the driver's working copy,
whose catalog and events come from storage at the start and go back after every point.
MLflow's tracking store stays where `tracking` says (sqlite in the run directory by
default): a job resumed on another machine wants a shared tracking server too."""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorp import Selection, get_method
from lorp import profile as lorp_profile
from lorp.repair_stats import RepairStats
from pipeline.plan import (
    CHECKPOINTS,
    GridPoint,
    ModelPlan,
    checkpoint_rel,
    plan_points,
    repair_selector,
    similarity_selector,
)
from pipeline.records.catalog import Catalog, slot
from pipeline.records.progress import Progress
from pipeline.records.rows import EventLog, ModelFacts, RunSummary
from pipeline.records.storage import Storage
from pipeline.records.tracking import Tracker, default_tracking_uri
from pipeline.spec import JobSpec, MethodSpec
from pipeline.stages.calibration import CalibrationShards
from pipeline.stages.losses import LossSelector


@dataclass(frozen=True)
class PreparedModel:
    """A model ready for its grid points: S, profile, every point, those still to do."""

    plan: ModelPlan
    ms: Any
    """`pipeline.stages.statistics.ModelStats`."""
    profile: Any
    key: str
    """The model key (weights, calibration, dtype): its parent run's identity."""
    points: list[GridPoint]
    pending: list[GridPoint]
    skipped: int


class JobRun:
    """One execution of a job spec: its run directory, records and progress."""

    def __init__(self, spec: JobSpec, force: bool, progress: Progress) -> None:
        self.spec, self.force, self.progress = spec, force, progress
        self.run_dir = spec.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        uri = os.environ.get("MLFLOW_TRACKING_URI") or spec.tracking.mlflow_uri
        uri = uri or default_tracking_uri(self.run_dir)
        self.storage = Storage(spec.storage or self.run_dir)
        here = self.storage.local_path() == self.run_dir.resolve()
        mirror = None if here else self.storage
        self.catalog = Catalog(self.run_dir / Catalog.NAME, mirror)
        self.events = EventLog(self.run_dir / EventLog.NAME, mirror)
        ckpts, elsewhere = self.storage.uri(CHECKPOINTS), None if here else self.storage.uri()
        self.summary = RunSummary(self.run_dir, self.catalog.path, uri, ckpts, storage=elsewhere)
        experiment = spec.tracking.experiment or spec.name
        self.tracker = Tracker(uri, experiment, self.storage.mlflow_uri("mlartifacts"))
        self.facts: dict[str, ModelFacts] = {}
        self.parents: dict[str, str] = {}
        self.run_ids: dict[str, str] = {}
        self.shards: dict[str, CalibrationShards] = {}
        self.repair_refs: dict[tuple[str, tuple[int, int]], Any] = {}
        """(model label, run) -> ObjectRef of that run's `RepairStats`."""
        self.repair_known: dict[tuple[str, tuple[int, int]], Path] = {}
        """(model label, run) -> the local file holding its sums, already captured to rank
        windows (`window`); read back only for the runs a repaired point needs."""

    def open(self) -> None:
        """Repair what a killed predecessor left: stale MLflow runs, partial checkpoints."""
        self.catalog.compact()  # what a killed predecessor recorded, folded in
        completed = {r["grid_key"]: r["mlflow_run_id"] for r in self.catalog.rows}
        closed = self.tracker.close_stale_runs(self.spec.name, completed)
        ckpt_root = self.storage.local_path(CHECKPOINTS)  # remote: unmarked, ignored
        if ckpt_root is not None and ckpt_root.is_dir():
            for partial in ckpt_root.glob("*/.*.partial"):
                shutil.rmtree(partial, ignore_errors=True)
        self.events(
            "start",
            job=self.spec.name,
            force=self.force,
            closed_stale_runs=closed,
            pid=os.getpid(),
            host=socket.gethostname(),
        )

    def prepare_model(
        self, plan: ModelPlan, backend: str, emit: Callable[[str, Any], None] | None = None
    ) -> PreparedModel:
        """S (cached or captured), the model's profile, its points (every selection made)
        and, for the points still to do, the repair sums they need. Runs in a thread of
        the fleet (`pipeline.fleet`) beside other models' stages: it records events and
        log lines, never MLflow or the catalog (`adopt` does, on the driver's thread).

        `emit` hands the fleet what is ready on the way, in order: ("adopt", the
        model's `PreparedModel` so far, for its records), then ("points", points to do)
        each time some can start: the dense point once S is there, each unrepaired point
        once its selection is made, the repaired ones once their sums are."""
        from pipeline.stages.statistics import describe, model_statistics

        start = time.time()
        ms = model_statistics(self.spec, plan, self.run_dir, self.force)
        self.events("capture", model=plan.label, **describe(ms))
        self.progress.capture(plan.label, ms.source, ms.seconds, ms.stats.tokens)
        prof = lorp_profile(ms.stats.matrix())
        key = plan.model_key(ms.stats.calibration_fingerprint)
        emit = emit or (lambda kind, what: None)
        emit("adopt", PreparedModel(plan, ms, prof, key, [], [], 0))
        emitted: set[str] = set()  # points handed to the fleet, or found done
        handed: list[GridPoint] = []
        skipped = [0]

        def ready(points: list[GridPoint]) -> None:
            todo, done = self.pending(points)
            skipped[0] += done
            emitted.update(p.key for p in points)
            handed.extend(todo)
            if todo:
                emit("points", todo)

        if ms.shards is not None:
            self.shards[plan.label] = ms.shards
        loss_guided = LossSelector(self, plan, ms.stats, ms.file.stem, prof)
        plain = similarity_selector(ms.stats, prof)
        by_repair = repair_selector(ms.stats, prof, self.repair_scorer(plan, ms.shards))

        def select(m: MethodSpec, budget: int) -> tuple[Selection, float]:
            method = get_method(m.name)
            if method.needs_repair:
                return by_repair(m, budget)
            return (loss_guided if method.needs_evaluator else plain)(m, budget)

        def refused(point: GridPoint, why: str) -> None:
            self.summary.refused.append(f"{plan.label} {point.name}: {why}")
            self.events("repair_refused", model=plan.label, point=point.name, reason=why)
            self.progress.note(f"{plan.label} {point.name}: not repaired: {why}")

        try:
            points = plan_points(self.spec, plan, key, backend, select, refused, ready)
        finally:
            loss_guided.close()
        todo, done = self.pending([p for p in points if p.key not in emitted])
        rest = self.prepare_repairs(todo)
        if rest:
            emit("points", rest)
        pending = handed + rest  # every point this start runs
        seconds = time.time() - start
        self.events(
            "span",
            stage="prepare",
            model=plan.label,
            start=start,
            end=start + seconds,
            node="driver",
            worker="driver",
            slots={},
        )
        return PreparedModel(plan, ms, prof, key, points, pending, skipped[0] + done)

    def adopt(self, prep: PreparedModel) -> None:
        """A prepared model's records on the driver's thread: its parent MLflow run (S,
        profile, heatmap), the facts its rows share, the capture counters."""
        plan, ms, prof = prep.plan, prep.ms, prep.profile
        self.summary.captured += ms.source == "computed"
        self.summary.cached += ms.source == "cache"
        parent = self.tracker.model_run(self.spec.name, prep.key, plan.label)
        self.tracker.record_model(parent, self.spec, plan, ms, prof)
        self.facts[plan.label] = ModelFacts(
            prof.rls, prof.k, list(prof.labels) if prof.labels is not None else None, ms.location
        )
        self.parents[plan.label] = parent

    def repair_scorer(
        self, plan: ModelPlan, shards: CalibrationShards | None
    ) -> Callable[[list[tuple[int, int]]], list[float]]:
        """`repair_scores` for the repair-aware methods: the candidate runs' sums from
        the capture workers (one pass per call, cached), ranked on the driver; the sums
        are kept for the repaired points that will need them."""
        from lorp.repair import window_scores
        from pipeline.stages.statistics import repair_statistics

        def scores(runs: list[tuple[int, int]]) -> list[float]:
            assert shards is not None
            rs = repair_statistics(self.spec, plan, shards, runs, self.run_dir, self.force)
            self.events(
                "repair_scores",
                model=plan.label,
                source=rs.source,
                runs=len(runs),
                seconds=round(rs.seconds, 3),
            )
            where = "from the cache" if rs.source == "cache" else f"captured in {rs.seconds:.1f} s"
            self.progress.note(f"repair scores {plan.label}: {len(runs)} candidate runs, {where}")
            for run in rs.stats.runs:
                self.repair_known[(plan.label, run)] = rs.file
            ranked = window_scores(rs.stats)
            return [ranked[(int(s), int(e))] for s, e in runs]

        return scores

    def prepare_repairs(self, todo: list[GridPoint]) -> list[GridPoint]:
        """The repair sums of every run the repaired points to do need, per model (cached,
        or one capture over S's shards), each run's sums put in the object store once.
        A model whose repair capture fails fails its repaired points, with the reason;
        the rest of `todo` is returned."""
        import ray

        from pipeline.cluster.scheduler import first_line
        from pipeline.stages.statistics import repair_statistics

        by_model: dict[str, list[GridPoint]] = {}
        for p in todo:
            if p.repair != "none":
                by_model.setdefault(p.model.label, []).append(p)
        failed: set[str] = set()
        for label, points in by_model.items():
            plan = points[0].model
            runs = sorted({r for p in points for r in p.runs})
            known = {
                r: self.repair_known[(label, r)] for r in runs if (label, r) in self.repair_known
            }
            for run, file in known.items():
                self.repair_refs[(label, run)] = ray.put(RepairStats.from_file(file, [run]))
            runs = [r for r in runs if r not in known]
            if not runs:
                continue
            try:
                rs = repair_statistics(
                    self.spec, plan, self.shards[label], runs, self.run_dir, self.force
                )
            except Exception as exc:  # noqa: BLE001 - the job goes on without this model's repairs
                cause = first_line(exc)
                for p in points:
                    failed.add(p.key)
                    self.summary.failed.append(f"{label}/{p.label}/{p.budget}: {cause}")
                    self.events("point_failed", grid_key=p.key, error=str(exc)[-4000:], cause=cause)
                self.progress.note(f"repair statistics of {label} failed: {cause}")
                continue
            for run in runs:
                self.repair_refs[(label, run)] = ray.put(rs.stats.subset([run]))
            self.events(
                "repair_capture",
                model=label,
                source=rs.source,
                runs=[list(r) for r in runs],
                passes=rs.passes,
                seconds=round(rs.seconds, 3),
                tokens=rs.stats.tokens,
                file=rs.location,
            )
            where = (
                "from the cache"
                if rs.source == "cache"
                else (f"captured in {rs.seconds:.1f} s, {rs.passes} pass(es)")
            )
            self.progress.note(
                f"repair statistics {label}: {len(runs)} run(s) for {len(points)} "
                f"variant(s), {where}"
            )
        return [p for p in todo if p.key not in failed]

    def pending(self, points: list[GridPoint]) -> tuple[list[GridPoint], int]:
        """Points not yet in the catalog (all with `force`), and how many are skipped."""
        if self.force:
            return list(points), 0
        done = self.catalog.by_key()
        todo = [p for p in points if p.key not in done]
        return todo, len(points) - len(todo)

    def replace_old(self, point: GridPoint) -> None:
        """A point about to run replaces its slot's old row: the old MLflow run goes."""
        done = self.catalog.by_key()
        old = done.get(point.key)
        if old is None:
            slots = {slot(r): r for r in self.catalog.rows}
            old = slots.get((self.spec.name, point.model.label, point.label, point.budget))
        if old and old.get("mlflow_run_id"):
            self.tracker.delete(old["mlflow_run_id"])

    def checkpoint(self, point: GridPoint) -> str | None:
        """The point's checkpoint below the storage; None when it is not saved."""
        if not (self.spec.save_checkpoints and point.layers):
            return None
        return checkpoint_rel(point)

    def checkpoint_uri(self, point: GridPoint) -> str | None:
        """Where the point's checkpoint lives (the catalog's `checkpoint`)."""
        rel = self.checkpoint(point)
        return self.storage.uri(rel) if rel else None
