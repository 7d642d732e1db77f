"""The recorder: the one writer of a job's records. The catalog (rows and their updates),
the MLflow runs and their tags, the registry's versions, the event log and the run's
summary are written here and nowhere else; the scheduler (`pipeline.driver.fleet`) and the
model preparations (`pipeline.driver.model_stages`) call its verbs.

A row is written once, when its point ends, with the figures known then; whatever it
learns later (speed, a repaired variant's twin speed, the quality gate, its registry
version) goes through `_update`. The catalog says what is done, so it is written last:
a point's figures go into its MLflow run (still RUNNING), then its row into the catalog,
then the run is closed; an update goes into the run, then into the row. A driver killed
anywhere in between leaves either a run whose point is not done (the next start closes
it FAILED and runs the point again) or a row whose run holds every figure in it (the
next start closes it FINISHED): never a FINISHED run without its row or its figures.

Where things live: the run directory is the driver's; the storage (`pipeline.storage.store`)
is where results live for every node (by default the run directory itself; with
`storage:` set, the run directory is a working copy whose catalog and events come from
storage at the start and go back after every change). MLflow's tracking store is where
`tracking` says (sqlite in the run directory by default).

The preparation verbs (`captured`, `repair_*`, `losses`, `span`) are called from the
model threads: they write events (the log is locked), log lines and appends to the
summary's lists, all thread-safe.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import time
import traceback
from collections.abc import Iterable, Mapping
from typing import Any

from lorp.locality.profile import Profile
from pipeline.catalog.run_identity import run_identity
from pipeline.catalog.shared import JobPublisher, SharedCatalog
from pipeline.catalog.table import Catalog, slot
from pipeline.cluster.nodes import first_line
from pipeline.driver import row_updates
from pipeline.driver.point_records import (
    headline,
    point_memory,
    point_metrics,
    point_params,
    point_tags,
)
from pipeline.driver.preparation_log import PreparationLog
from pipeline.driver.rows import JobColumns, ModelFacts, RowContext, catalog_row, model_facts
from pipeline.driver.summary import RunSummary
from pipeline.driver.tasks import twins
from pipeline.events.log import EventLog
from pipeline.events.progress import Progress
from pipeline.messages import PointResult
from pipeline.plan.grid import CHECKPOINTS, GridPoint, ModelPlan
from pipeline.spec.job import JobSpec
from pipeline.stages.statistics import ModelStats
from pipeline.storage.store import Storage
from pipeline.tracking import aliases as registry_aliases
from pipeline.tracking import registry as model_registry
from pipeline.tracking.materialized import AliasWriter
from pipeline.tracking.runs import Tracker, default_tracking_uri


class Recorder:
    """A job's records: run directory, storage, catalog, events, MLflow, summary."""

    def __init__(
        self, spec: JobSpec, force: bool, progress: Progress, *, force_speed: bool = False
    ) -> None:
        self.spec, self.force, self.progress = spec, force, progress
        self.force_speed = force_speed
        self.run_dir = spec.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        uri = os.environ.get("MLFLOW_TRACKING_URI") or spec.tracking.mlflow_uri
        uri = uri or default_tracking_uri(self.run_dir)
        self.storage = Storage(spec.storage or self.run_dir)
        here = self.storage.local_path() == self.run_dir.resolve()
        mirror = None if here else self.storage
        self.run_id = run_identity(self.storage, spec.name)
        self.shared = SharedCatalog(spec.catalog) if spec.catalog else None
        self.publisher = self._publisher(spec.name, progress)
        self.catalog = Catalog(self.run_dir / Catalog.NAME, mirror, self.publisher, spec.name)
        self.events = EventLog(self.run_dir / EventLog.NAME, mirror)
        ckpts, elsewhere = self.storage.uri(CHECKPOINTS), None if here else self.storage.uri()
        self.summary = RunSummary(self.run_dir, self.catalog.path, uri, ckpts, storage=elsewhere)
        experiment = spec.tracking.experiment or spec.name
        self.tracker = Tracker(uri, experiment, self.storage.mlflow_uri("mlartifacts"))
        self.job = JobColumns(
            spec.name,
            self.run_id,
            self.tracker.display_uri,
            self.tracker.experiment_id,
            self.storage.uri(),
            spec.evaluation,
            spec.tracking.reference,
        )
        """What every row of the job says of it."""
        self.preparation = PreparationLog(self.events, progress, self.summary, self.storage)
        """What the model preparations say (called from their threads)."""
        self.facts: dict[str, ModelFacts] = {}
        self.parents: dict[str, str] = {}
        """model label -> its parent MLflow run."""
        self.run_ids: dict[str, str] = {}
        """grid key -> its point's MLflow run (this start)."""
        self.stopping = False
        self.writing_out = (
            None
            if spec.tracking.materialize == "none"
            else AliasWriter(uri, self.storage, self.events, progress.note, self.summary.failed)
        )

    def _publisher(self, job: str, progress: Progress) -> JobPublisher | None:
        """What publishes the job's rows to the shared catalog, where it has one."""
        if self.shared is None:
            return None
        where, rows = self.storage.uri(), lambda: self.catalog.rows  # as they are when published
        return JobPublisher(self.shared, job, where, self.run_id, rows, progress.note)

    # -- the job -----------------------------------------------------------------------

    def open(self) -> frozenset[str]:
        """Repair what a killed predecessor left (stale MLflow runs, partial checkpoints)
        and return the grid keys already done (none with `force`)."""
        if self.publisher is not None:
            self.publisher.open()
        self.catalog.compact()  # small files compacted, the rows published whole
        completed = {r["grid_key"]: r["mlflow_run_id"] for r in self.catalog.rows}
        closed = self.tracker.close_stale_runs(self.spec.name, completed)
        elsewhere = row_updates.stored_elsewhere(self.catalog.rows, self.storage.uri())
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
            storage=self.storage.uri(),
            run_id=self.run_id,
            catalog=self.shared.uri() if self.shared else None,
            redo_elsewhere=len(elsewhere),
        )
        self._warn_unjudged()
        for where, keys in sorted(row_updates.by_value(elsewhere).items()):
            self.progress.note(
                f"{len(keys)} row(s) of the working copy belong to storage {where}: "
                f"redone here, in {self.storage.uri()}"
            )
        if self.force:
            return frozenset()
        return frozenset(self.catalog.by_key()) - frozenset(elsewhere)

    def cluster(self, kind: str, slots: Mapping[str, float], models: int) -> None:
        self.events("cluster", kind=kind, slots=dict(slots), models=models)

    def memory_planned(self, plan: ModelPlan) -> None:
        """Whether each stage holds the model whole or streams it: an event (`lorp
        status`) and, for a streamed stage, a line."""
        if not plan.memory:
            return
        self.events("memory", model=plan.label, stages=plan.memory_record())
        for _, decision in plan.memory:
            if decision.mode == "streamed":
                self.progress.note(decision.line(plan.label))
        if plan.tensor_parallel > 1:
            self.progress.note(
                f"{plan.label}: evaluated by vLLM over {plan.tensor_parallel} GPUs per engine "
                "(tensor parallel: the model does not fit one)"
            )

    def fleet(self, models: int, points: int, driver_s: float) -> None:
        """The fleet's loop ended: how much of the driver's time recording took."""
        self.events(
            "fleet",
            models=models,
            points=points,
            driver_s=round(driver_s, 3),
            driver_ms_per_point=round(1000 * driver_s / max(points, 1), 3),
        )

    def stopped(self, signal: str) -> None:
        self.events("stopped", signal=signal, done=self.summary.done)
        self.stopping = True

    def close(self) -> None:
        """The job's end, however it ended: aliases written out, log lines closed, catalog
        parts folded."""
        self.catalog.compact()
        if self.publisher is not None:
            self.publisher.close(
                self.spec.catalog_retention_hours, self.spec.catalog_maintenance_hours
            )
        if self.writing_out is not None:
            self.writing_out.join(wait=not self.stopping)
        self.progress.close()

    def ended(self) -> RunSummary:
        s = self.summary
        self.events("end", done=s.done, skipped=s.skipped, failed=len(s.failed))
        return s

    # -- timeline ----------------------------------------------------------------------

    def begin(self, unit: str, stage: str, model: str, **labels: Any) -> None:
        self.events("begin", unit=unit, stage=stage, model=model, **labels)

    def finish(self, unit: str) -> None:
        self.events("finish", unit=unit)

    def spans(self, spans: Iterable[Mapping[str, Any]]) -> None:
        """Spans the workers reported (`pipeline.events.timeline`)."""
        for s in spans:
            self.events("span", **s)

    def waiting(
        self, stage: str, model: str, need: Mapping[str, float], why: str, every: float
    ) -> None:
        """A stage waits for resources no node offers: said in the log and the events,
        again every `every` seconds while it lasts (`lorp status` shows the latest)."""
        self.events("waiting", stage=stage, model=model, need=dict(need), reason=why, every=every)
        self.progress.note(f"waiting: {stage} of {model}: {why}")

    # -- a model -----------------------------------------------------------------------

    def model_prepared(
        self, plan: ModelPlan, ms: ModelStats, profile: Profile, model_key: str
    ) -> None:
        """A model's S and profile: its parent MLflow run (S, profile, heatmap), the
        facts its rows share, the capture counters."""
        self.summary.captured += ms.source == "computed"
        self.summary.cached += ms.source == "cache"
        parent = self.tracker.model_run(self.spec.name, model_key, plan.label)
        seconds = ms.seconds if ms.source == "computed" else None
        self.tracker.record_model(parent, plan.calibration, plan, ms.stats, profile, seconds)
        self.facts[plan.label] = model_facts(profile, ms.location, plan.path, plan.calibration)
        self.parents[plan.label] = parent

    def skipped(self, points: list[GridPoint]) -> None:
        """Points found in the catalog already: not run again."""
        self.summary.skipped += len(points)

    def model_ready(self, label: str, points: int, todo: int, skipped: int, left: int) -> None:
        """A model's preparation ended: `todo` of its `points` run (some have started)."""
        self.events("grid", model=label, points=points, todo=todo, skipped=skipped)
        self.progress.add_points(label, todo, skipped, left)

    def unmeasured(self, points: list[GridPoint]) -> list[GridPoint]:
        """The model's finished points that lack speed figures, or all of them with
        `force_speed` (never the repaired twins: they take their twin's)."""
        ev = self.spec.evaluation
        if not (ev.enabled and ev.speed):
            return []
        rows = self.catalog.by_key()
        cuts = [p for p in points if p.experts is not None and p.key in rows]
        if cuts:
            self._speed_skipped(cuts, row_updates.EXPERTS_UNTIMED)
        points = [p for p in points if p.experts is None]
        todo = row_updates.unmeasured(rows, points, twins(points), again=self.force_speed)
        if todo and todo[0].model.streamed("evaluate"):
            self._speed_skipped([p for p in points if p.key in rows])  # twins included
            return []
        return todo

    def _speed_skipped(
        self, points: list[GridPoint], reason: str = row_updates.STREAMED_UNTIMED
    ) -> None:
        """A model no worker holds whole has no speed pass: its forwards read every block
        from disk, so a timing would measure the disk; an expert cut has none either
        (`row_updates.EXPERTS_UNTIMED`). Said in every row it concerns."""
        for p in points:
            self._update(p.key, {"speed_skipped": reason}, tags={"speed_skipped": reason})
        self.progress.note(f"speed {points[0].model.label}: skipped, {reason}")

    def speed_done(self, label: str, figures: Mapping[str, Mapping[str, float]]) -> None:
        """A model's speed figures into its rows and runs."""
        for key, values in figures.items():
            self._update(key, dict(values), metrics=dict(values))
        self.events("speed", model=label, variants=len(figures))
        self.progress.note(f"speed {label}: {row_updates.speed_summary(figures)}")

    def speed_failed(self, label: str, exc: BaseException) -> None:
        """Speed is a figure, not the variant: recorded, the model goes on."""
        self.events("speed_failed", model=label, cause=first_line(exc))
        self.progress.note(f"speed failed for {label}: {first_line(exc)}")

    def model_closed(self, plan: ModelPlan, points: list[GridPoint], left: int) -> None:
        """A model's last records: twins' speed, the quality gate, its registry versions."""
        start = time.time()
        self._share_twin_speed(points)
        self._serving_speedups(points)
        self._quality_gate(points)
        self._reference_claim(points)
        if self.spec.tracking.register:
            self._register(plan, points)
        self.preparation.span("gate", plan.label, start, time.time())
        self.events("model_done", model=plan.label)
        self.progress.note(f"{plan.label} done ({len(points)} variants); {left} model(s) left")

    def model_failed(self, label: str, exc: BaseException) -> None:
        cause = first_line(exc)
        self.summary.failed.append(f"{label}: {cause}")
        trace = "".join(traceback.format_exception(exc))  # where: an assert has no message
        self.events("model_failed", model=label, cause=cause, error=trace[-4000:])
        self.progress.note(f"{label} FAILED: {cause}; the other models go on")

    # -- a point -----------------------------------------------------------------------

    def point_started(self, point: GridPoint) -> None:
        """The point's MLflow run (replacing its slot's old one) and its begin mark."""
        self._replace_old(point)
        run_id = self.tracker.start_point(
            self.spec.name, self.parents[point.model.label], point.key, point.name
        )
        self.tracker.log(run_id, params=point_params(point))
        self.run_ids[point.key] = run_id
        self.begin(point.key, "point", point.model.label, point=point.name)

    def point_done(self, point: GridPoint, result: PointResult, backend: str) -> None:
        backend = result.backend or backend  # a sub-layer variant may be judged in memory
        run_id = self.run_ids[point.key]
        ckpt = self.storage.uri(point.checkpoint) if point.checkpoint else None
        facts = self.facts[point.model.label]
        row = catalog_row(point, result, facts, self.job, RowContext(run_id, ckpt, backend))
        record = row.record()
        metrics, tags = point_metrics(point, result), point_tags(record, ckpt, backend)
        self.tracker.log(run_id, metrics=metrics, tags=tags)
        self.tracker.log_evaluation_inputs(run_id, self.spec.evaluation, result.zero_shot)
        self.catalog.put(record)  # the run holds the figures, then the row: module docstring
        self.tracker.finish(run_id)
        self.summary.done += 1
        self.events(
            "point",
            grid_key=point.key,
            model=point.model.label,
            method=point.label,
            budget=point.budget,
            seconds=round(result.seconds, 3),
            **point_memory(point, result),
        )
        name = f"{point.model.label} {point.name}"
        figure = headline(record, self.spec.evaluation.perplexity)
        self.progress.point(name, figure, result.seconds)
        self.finish(point.key)

    def point_failed(self, point: GridPoint, exc: BaseException) -> None:
        """A point that failed after its retries: recorded, the grid goes on."""
        self.tracker.finish(self.run_ids[point.key], "FAILED")
        cause = first_line(exc)
        self.summary.failed.append(f"{point.model.label}/{point.label}/{point.budget}: {cause}")
        self.events("point_failed", grid_key=point.key, error=str(exc)[-4000:], cause=cause)
        self.progress.point(f"{point.model.label} {point.name}", cause, 0.0, ok=False)
        self.finish(point.key)

    def killed(self, points: Iterable[GridPoint]) -> None:
        """Points cut short by a stop: their MLflow runs KILLED (what cannot be closed
        now, the next start closes)."""
        for point in points:
            run_id = self.run_ids.get(point.key)
            if run_id:
                with contextlib.suppress(Exception):
                    self.tracker.finish(run_id, "KILLED")

    # -- the one update path -----------------------------------------------------------

    def _update(
        self,
        key: str,
        values: Mapping[str, Any],
        metrics: Mapping[str, float] | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> None:
        """Figures a written row learns later: into its run, then into the catalog (a
        driver killed between leaves the row without them, and the next start redoes them)."""
        if metrics or tags:
            run_id = self.catalog.by_key()[key]["mlflow_run_id"]
            self.tracker.log(run_id, metrics=metrics, tags=tags)
        self.catalog.update(key, values)

    def _replace_old(self, point: GridPoint) -> None:
        """A point about to run replaces its slot's old row: the old MLflow run goes."""
        done = self.catalog.by_key()
        old = done.get(point.key)
        if old is None:
            slots = {slot(r): r for r in self.catalog.rows}
            old = slots.get((self.spec.name, point.model.label, point.label, point.budget))
        if old and old.get("mlflow_run_id"):
            self.tracker.delete(old["mlflow_run_id"])

    def _share_twin_speed(self, points: list[GridPoint]) -> None:
        pairs = twins(points)
        for key, values in row_updates.twin_speed(self.catalog.by_key(), pairs).items():
            self._update(key, values, metrics=values, tags={"speed_from": pairs[key]})

    def _serving_speedups(self, points: list[GridPoint]) -> None:
        """Each variant's serving speed-up over dense, from both rows' vLLM rounds."""
        half = self.spec.evaluation.speed_half_width
        for key, values in row_updates.serving_speedups(
            self.catalog.by_key(), points, half
        ).items():
            self._update(key, values, metrics=values)

    def _warn_unjudged(self) -> None:
        """One line when every perplexity corpus is a calibration corpus (the gate then
        judges variants on the kind of text they were fitted on), and one for each model
        judged on a domain it was not calibrated on (`JobSpec.warnings`)."""
        for line in self.spec.warnings():
            self.progress.note(line)

    def _quality_gate(self, points: list[GridPoint]) -> None:
        """Every row's judgement on held-out text (`row_updates.quality_gate`): its
        ratios to dense, `ppl_ratio`, `degraded` and `fits_calibration_only`."""
        names = {p.key: f"{p.model.label} {p.name}" for p in points}
        spec = self.spec
        calibration = {m.label: spec.calibration_for(m).corpora for m in spec.models}
        rows = self.catalog.by_key()
        ev = spec.evaluation
        for v in row_updates.quality_gate(rows, points, ev, calibration, spec.domains):
            if v.changed(rows[v.key]):
                self._update(v.key, v.values(), metrics=v.metrics(), tags=v.tags())
            if v.degraded:  # the domain it was judged by: the worst, or the one ranked on
                domain = ev.rank_domain or v.worst_domain
                self.summary.degraded.append(f"{names[v.key]}: {domain} x{v.ratio:,.1f}")

    def _reference_claim(self, points: list[GridPoint]) -> None:
        """Rows say whether their job claims the reference protocol
        (`tracking.reference`) as the spec says now: a rerun may take it over."""
        claim, keys = self.spec.tracking.reference, {p.key for p in points}
        for key, row in self.catalog.by_key().items():
            if key in keys and row.get("reference_claim") != claim:
                self._update(key, {"reference_claim": claim})

    def _register(self, plan: ModelPlan, points: list[GridPoint]) -> None:
        """The model's saved variants (and its dense version) as registry versions, each
        row's `model_uri`, then the aliases over every job's versions. A registry failure
        fails this model's registration only."""
        from mlflow.exceptions import MlflowException

        rows = self.catalog.by_key()
        parent = self.parents[plan.label]
        entries = model_registry.model_entries(self.spec.name, points, rows, parent)
        if not entries:
            return
        try:
            reg = model_registry.register_model(self.tracker.client, plan, entries)
            for key, uri in reg.uris.items():
                if rows[key].get("model_uri") != uri:
                    self._update(key, {"model_uri": uri})
            aliases, moves = registry_aliases.move_aliases(
                self.tracker.client,
                reg.name,
                self.spec.name,
                self.publisher.ranking_rows if self.publisher is not None else None,
            )
        except MlflowException as exc:
            cause = str(exc).splitlines()[0][:500]
            self.summary.failed.append(f"{plan.label}/registry: {cause}")
            self.events("register_failed", model=plan.label, cause=cause)
            return
        self._registered(plan.label, reg, aliases, moves)
        if self.writing_out is not None:  # beside the fleet: a checkpoint per budget
            self.writing_out.start(plan.label, reg.name, aliases)

    def _registered(self, label: str, reg: Any, aliases: dict[str, int], moves: list[Any]) -> None:
        """A model's registration said: each alias moved, the versions, one line."""
        for m in moves:
            self.events(
                "alias",
                model=label,
                name=reg.name,
                alias=m.alias,
                version=m.version,
                previous=m.previous,
                job=self.spec.name,
            )
        versions, created = len(reg.versions), reg.created
        self.events(
            "register",
            model=label,
            name=reg.name,
            versions=versions,
            created=created,
            aliases=aliases,
        )
        shown = ", ".join(f"{a}=v{v}" for a, v in sorted(aliases.items()))
        self.progress.note(
            f"registry {reg.name}: {versions} versions of this job ({created} new), "
            f"{len(moves)} alias move(s); {shown}"
        )
