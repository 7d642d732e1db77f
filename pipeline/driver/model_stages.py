"""A model's preparation: its chain of stages up to its grid points. Calibration shards,
S (cached or captured on Ray, `pipeline.stages.statistics`), the profile (RLS, K,
clusters), a selection per (method, budget) (loss-guided ones on Ray actors,
`pipeline.stages.loss_evaluators`), and the repair sums of every run the repaired points remove.

It returns plain values (`PreparedModel`) and hands the fleet what is ready on the way
(`Emit`): the prepared model once S and its profile are there (its records), then points
as soon as they can start: the dense point once S is there, each unrepaired point once
its selection is made, the repaired ones once their runs' sums are in the object store
(with those references). It never reads the catalog (what is done comes in as grid keys)
and never touches MLflow: what it has to say goes to `PrepareRecords` (the recorder)
as events and log lines.

Each model's preparation runs in a driver thread of its own (`pipeline.driver.fleet`), which
mostly waits on Ray.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from lorp import Selection, get_method
from lorp import profile as lorp_profile
from lorp.locality.profile import Profile
from lorp.repair.stats import RepairStats
from pipeline.driver.tasks import FOLLOWERS, UNITS, RepairRefs
from pipeline.plan.grid import GridPoint, ModelPlan, evaluation_key
from pipeline.plan.points import ModelGrid, on_loss_actors, selection_order
from pipeline.plan.selectors import repair_selector, similarity_selector, unit_selector
from pipeline.spec.job import JobSpec
from pipeline.spec.models import MethodSpec
from pipeline.spec.resources import Resources
from pipeline.stages.calibration import CalibrationShards
from pipeline.stages.loss_evaluators import LossSelector, repaired_window_losses
from pipeline.stages.settings import StageSettings, stats_store
from pipeline.stages.statistics import (
    ModelRepairStats,
    ModelStats,
    follower_windows,
    model_statistics,
    repair_statistics,
)


class PrepareRecords(Protocol):
    """What a preparation has to say (`pipeline.driver.recorder.Recorder` says it)."""

    def captured(self, plan: ModelPlan, ms: ModelStats) -> None: ...

    def repair_scored(self, plan: ModelPlan, rs: ModelRepairStats, runs: int) -> None: ...

    def repair_refused(self, point: GridPoint, why: str) -> None: ...

    def repair_captured(
        self, label: str, rs: ModelRepairStats, runs: list[tuple[int, int]], variants: int
    ) -> None: ...

    def repair_failed(self, label: str, points: list[GridPoint], exc: BaseException) -> None: ...

    def losses(self, candidates: int, evaluated: int, spans: list[dict[str, Any]]) -> None: ...

    def span(self, stage: str, model: str, start: float, end: float) -> None: ...

    def store_base(self, plan: ModelPlan) -> None: ...


@dataclass(frozen=True)
class PreparedModel:
    """A model ready for its grid points: S, profile, every point, those still to do."""

    plan: ModelPlan
    stats: ModelStats
    profile: Profile
    key: str
    """The model key (weights, calibration, dtype): its parent run's identity."""
    points: list[GridPoint]
    pending: list[GridPoint]
    """The points this start runs (handed to the fleet on the way)."""
    skipped: int
    """Points already done."""


@dataclass(frozen=True)
class Stage:
    """The stage a preparation is in, and what it asks of the cluster."""

    name: str
    need: Resources | None
    """None: it runs on the driver."""


Emit = Callable[[str, Any], None]
"""(kind, what): ("prepared", PreparedModel so far), ("stage", Stage),
("points", (points, RepairRefs)): points that can start, with their runs' sums, or
("done", points): points already in the catalog (skipped)."""


class Stopping(Exception):
    """The job is stopping: a preparation ends between two stages."""


class Preparer:
    """Prepares the job's models, each on the thread that calls `prepare`."""

    def __init__(
        self,
        spec: JobSpec,
        force: bool,
        done: frozenset[str],
        records: PrepareRecords,
        note: Callable[[str], None],
    ) -> None:
        """`done`: grid keys already in the catalog (skipped); `note`: a log line."""
        self.spec, self.force, self.done = spec, force, done
        self.stage = StageSettings(
            spec.run_dir,
            stats_store(spec.cache_dir, spec.storage),
            spec.resources,
            spec.evaluation,
            spec.repair_settings,
            spec.domains,
            spec.sublayers,
            spec.experts.enabled,
            force,
        )
        """The job as the stages read it."""
        self.records, self.note = records, note
        self.stopping = threading.Event()
        """Set by the fleet on a stop: preparations end at their next stage."""

    def prepare(
        self,
        plan: ModelPlan,
        backend: str,
        emit: Emit,
        cancel: threading.Event | None = None,
    ) -> PreparedModel:
        """S, the profile, every selection and the repair sums of one model; `cancel`
        (this model's failure elsewhere) ends it at its next stage, as a stop does."""
        return _Preparation(self, plan, backend, emit, cancel or threading.Event()).run()


class _Preparation:
    """One model's preparation: what it has handed to the fleet, what it has skipped."""

    def __init__(
        self, job: Preparer, plan: ModelPlan, backend: str, emit: Emit, cancel: threading.Event
    ) -> None:
        self.job, self.spec, self.stages, self.plan = job, job.spec, job.stage, plan
        self.backend, self.emit, self.cancel = backend, emit, cancel
        self.emitted: set[str] = set()
        """Keys of points handed to the fleet, or found done."""
        self.handed: list[GridPoint] = []
        self.skipped = 0
        self.repair_known: dict[tuple[int, int], Path] = {}
        """run -> the local file of its sums, captured to rank windows (`window`)."""
        self.selecting = Stage("selection", None)

    def run(self) -> PreparedModel:
        start, label = time.time(), self.plan.label
        self._stage("capture", self.spec.resources.capture)
        ms = model_statistics(self.stages, self.plan)
        self.job.records.captured(self.plan, ms)
        prof = lorp_profile(ms.stats.matrix())
        key = self.plan.model_key(ms.stats.calibration_fingerprint)
        self.emit("prepared", PreparedModel(self.plan, ms, prof, key, [], [], 0))
        if self.spec.checkpoints == "manifest":  # before a point's manifest names the copy
            self.job.records.store_base(self.plan)
        points = self._select(ms, prof, key)
        todo = self._pending([p for p in points if p.key not in self.emitted])
        rest, refs = self._repairs(ms.shards, todo)
        if rest:
            self.emit("points", (rest, refs))
        self.job.records.span("prepare", label, start, time.time())
        pending = self.handed + rest  # every point this start runs
        return PreparedModel(self.plan, ms, prof, key, points, pending, self.skipped)

    def _stage(self, name: str, need: Resources | None) -> None:
        if self.job.stopping.is_set() or self.cancel.is_set():
            raise Stopping(f"{self.plan.label}: stopped before {name}")
        self.emit("stage", Stage(name, need))

    def _pending(self, points: list[GridPoint]) -> list[GridPoint]:
        """Points not yet done (`done` is empty under `force`: all of them); the rest
        count as skipped, and go to the fleet as ("done", points): a model that fails
        later still gates and registers them with what this start adds."""
        todo = [p for p in points if p.key not in self.job.done]
        done = [p for p in points if p.key in self.job.done]
        self.skipped += len(done)
        if done:
            self.emit("done", done)
        return todo

    def _ready(self, points: list[GridPoint]) -> None:
        """Points whose selection is made: to the fleet at once (no repair sums needed)."""
        todo = self._pending(points)
        self.emitted.update(p.key for p in points)
        self.handed.extend(todo)
        if todo:
            self.emit("points", (todo, {}))

    # -- selections --------------------------------------------------------------------

    def _select(self, ms: ModelStats, prof: Profile, key: str) -> list[GridPoint]:
        """Every point of the model, each selection made once for all its repairs. The
        dense point goes to the fleet at once, each unrepaired point as soon as its
        selection is made, so its grid point can start while slower selections
        (loss-guided ones, minutes to hours) go on; a repaired point whose runs cannot
        fold is left out, with the reason."""
        loss_guided = any(_runs_models(m) for m in self.spec.methods)
        self.selecting = Stage("selection", self.spec.resources.grid if loss_guided else None)
        self._stage(self.selecting.name, self.selecting.need)
        grid = self._grid(key)
        dense = grid.dense()
        points = [dense] if dense is not None else []
        self._ready(points)
        select, close = self._selector(ms, prof)
        try:
            for g, m in selection_order(self.spec.granularity, self.spec.methods):
                for budget in self.plan.budgets_for(g):
                    made, refused = grid.points(m, *select(m, budget, g), g)
                    for point, why in refused:
                        self.job.records.repair_refused(point, why)
                    points += made
                    self._ready([p for p in made if p.repair == "none"])
        finally:
            close()
        return points + self._expert_points(ms, grid, points)

    def _expert_points(
        self, ms: ModelStats, grid: ModelGrid, depth: list[GridPoint]
    ) -> list[GridPoint]:
        """Each expert cut of the job (`experts`), chosen from the experts' sums captured
        with S, alone and (`combine`) with each unrepaired depth point; to the fleet at
        once. None for a model without experts."""
        from lorp.experts.selection import select_experts

        cuts, plan = self.spec.experts, self.plan
        if not plan.expert_budgets:
            return []
        if ms.stats.experts is None:
            raise ValueError(f"{plan.label}: its S was captured without the experts' sums")
        made = []
        for method in cuts.methods:
            for count in plan.expert_budgets:
                cut = select_experts(
                    ms.stats.experts, count, method, seed=cuts.seed, groups=plan.expert_groups
                )
                points = grid.expert_points(cut, cuts.seed, depth if cuts.combine else [])
                made += points
                self._ready(points)
        return made

    def _grid(self, key: str) -> ModelGrid:
        ev = self.spec.evaluation
        evaluation = evaluation_key(ev, self.backend) if ev.enabled else None
        settings = self.spec.repair_settings
        return ModelGrid(self.plan, key, evaluation, settings, self.spec.saves_checkpoints)

    def _selector(
        self, ms: ModelStats, prof: Profile
    ) -> tuple[Callable[[MethodSpec, int, str], tuple[Selection, float]], Callable[[], None]]:
        """How each (method, budget, granularity) is selected, and what closes the loss
        actors after the last selection: from the block S, by repair scores, from the
        sub-layer S, or on the loss actors."""
        losses = LossSelector(
            self.stages,
            self.plan,
            ms.stats,
            ms.file.stem,
            prof,
            self.job.records.losses,
            self.job.note,
            ms.units,
        )
        plain = similarity_selector(ms.stats, prof)
        by_repair = repair_selector(ms.stats, prof, self._repair_scorer(ms.shards))
        by_unit = unit_selector(ms.units, scores=self._repair_scorer(ms.shards, units=True))

        def select(m: MethodSpec, budget: int, granularity: str) -> tuple[Selection, float]:
            if granularity != "block":
                scored = on_loss_actors(m.name, granularity)  # SLEB, PPL, FinerCut
                return (losses.units if scored else by_unit)(m, budget, granularity)
            method = get_method(m.name)
            if method.needs_repair:
                return by_repair(m, budget)
            if method.needs_model:
                return self._on_model(ms, prof, m, budget)
            return (losses if method.needs_evaluator else plain)(m, budget)

        return select, losses.close

    def _on_model(
        self, ms: ModelStats, prof: Profile, m: MethodSpec, budget: int
    ) -> tuple[Selection, float]:
        """A selection made on the model itself (Prune&Comp), by one task on the grid's
        resources over the calibration windows (`pipeline.stages.peer_selection`)."""
        from pipeline.stages.peer_selection import select_on_model

        assert ms.shards is not None
        self._stage("selection on the model", self.spec.resources.grid)
        windows = follower_windows(self.stages, self.plan, ms.shards)
        start = time.perf_counter()
        selection = select_on_model(self.stages, self.plan, ms.stats, prof, m, budget, windows)
        self.emit("stage", self.selecting)
        return selection, time.perf_counter() - start

    def _repair_scorer(
        self, shards: CalibrationShards | None, units: bool = False
    ) -> Callable[[list[tuple[int, int]], str], list[float]]:
        """`repair_scores` for the repair-aware methods: the candidate runs' sums from
        the capture workers (one pass per call, cached), ranked on the driver by the
        residual their maps leave, or (`score: loss`) by the held-out loss of each
        repaired variant, scored on the grid's resources; block runs' sums are kept for
        the repaired points that will need them. `units`: the runs are of sub-layer
        units (`window` at mixed granularity)."""
        from lorp.scoring.window_scores import window_scores

        def scores(runs: list[tuple[int, int]], score: str = "residual") -> list[float]:
            assert shards is not None
            self._stage("repair scores", self.spec.resources.capture)
            rs = repair_statistics(self.stages, self.plan, shards, runs, units)
            self.job.records.repair_scored(self.plan, rs, len(runs))
            for run in () if units else rs.stats.runs:
                self.repair_known[run] = rs.file
            loss = score == "loss"
            ranked = self._repaired_losses(rs, runs, units) if loss else window_scores(rs.stats)
            self.emit("stage", self.selecting)  # back to the selection's own needs
            return [ranked[(int(s), int(e))] for s, e in runs]

        return scores

    def _repaired_losses(
        self, rs: ModelRepairStats, runs: list[tuple[int, int]], units: bool
    ) -> dict[tuple[int, int], float]:
        """The held-out loss of each run's repaired variant (`score: loss`), scored on
        the grid's resources; one log line when any was scored now."""
        from pipeline.events.progress import duration

        self._stage("repair losses", self.spec.resources.grid)
        start = time.perf_counter()
        losses, scored = repaired_window_losses(
            self.stages, self.plan, rs.stats, rs.file.stem, runs, units
        )
        if scored:
            self.job.note(
                f"{self.plan.label}: {scored} repaired windows scored on held-out loss "
                f"in {duration(time.perf_counter() - start)}"
            )
        return losses

    # -- repair sums -------------------------------------------------------------------

    def _repairs(
        self, shards: CalibrationShards | None, todo: list[GridPoint]
    ) -> tuple[list[GridPoint], RepairRefs]:
        """The sums of every run the repaired points to do need, each run's sums put in
        the object store once. When they cannot be had, the repaired points fail with
        the reason; the rest of `todo` goes on."""
        repaired = [p for p in todo if p.repair != "none"]
        if not repaired:
            return todo, {}
        linear = [p for p in repaired if p.repair == "linear"]  # a peer fits on the windows
        runs = sorted({r for p in linear if not p.sublayer for r in p.runs})
        unit_runs = sorted({r for p in linear if p.sublayer for r in p.runs})
        try:
            refs = self._repair_refs(shards, runs, len(repaired)) if runs else {}
            if unit_runs:
                refs = {**refs, **self._unit_refs(shards, unit_runs, len(repaired))}
            if shards is not None:  # every repaired point is judged on the held-out windows
                windows = follower_windows(self.stages, self.plan, shards)
                refs = {**refs, (self.plan.label, FOLLOWERS): ray_put(windows)}
        except Stopping:
            raise
        except Exception as exc:  # noqa: BLE001 - the job goes on without these repairs
            self.job.records.repair_failed(self.plan.label, repaired, exc)
            failed = {p.key for p in repaired}
            return [p for p in todo if p.key not in failed], {}
        return todo, refs

    def _repair_refs(
        self, shards: CalibrationShards | None, runs: list[tuple[int, int]], variants: int
    ) -> RepairRefs:
        import ray

        label = self.plan.label
        known = {r: self.repair_known[r] for r in runs if r in self.repair_known}
        refs = {(label, r): ray.put(RepairStats.from_file(f, [r])) for r, f in known.items()}
        missing = [r for r in runs if r not in known]
        if missing:
            assert shards is not None
            self._stage("repair capture", self.spec.resources.capture)
            rs = repair_statistics(self.stages, self.plan, shards, missing)
            refs |= {(label, r): ray.put(rs.stats.subset([r])) for r in missing}
            self.job.records.repair_captured(label, rs, missing, variants)
        return refs

    def _unit_refs(
        self, shards: CalibrationShards | None, runs: list[tuple[int, int]], variants: int
    ) -> RepairRefs:
        """The sums of the sub-layer points' unit runs, keyed (label, (UNITS, run))."""
        assert shards is not None
        label = self.plan.label
        self._stage("repair capture", self.spec.resources.capture)
        rs = repair_statistics(self.stages, self.plan, shards, runs, units=True)
        self.job.records.repair_captured(label, rs, runs, variants)
        return {(label, (UNITS, r)): ray_put(rs.stats.subset([r])) for r in runs}


def ray_put(value: Any) -> Any:
    import ray

    return ray.put(value)


def _runs_models(m: MethodSpec) -> bool:
    """Whether selecting with `m` runs the model (on the grid's resources): the
    loss-guided methods, and a repair-aware one scored by the repaired variants' loss."""
    method = get_method(m.name)
    scored = method.needs_repair and m.options.get("score") == "loss"
    return method.needs_evaluator or method.needs_model or scored
