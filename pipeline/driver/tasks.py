"""What the job's workers receive, built on the driver from plain values: a grid point's
task (with its repair and its provenance), a model's speed task. The fleet
(`pipeline.driver.fleet`) submits them; the workers (`pipeline.stages.points`,
`.speed_pass`) run them.

Nothing here reads the catalog or MLflow: a task is the job's settings, the point (its
checkpoint location decided when it was planned), the job's storage location and, for a
repaired point, the object-store references of its runs' sums.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from lorp.provenance import provenance
from pipeline.cluster.nodes import whole_node
from pipeline.messages import PointTask, RepairTask, SpeedTask
from pipeline.plan.grid import GridPoint
from pipeline.spec.evaluation import EvaluationSpec
from pipeline.spec.job import JobSpec
from pipeline.spec.repair import RepairSettings
from pipeline.spec.resources import Resources, ResourcesSpec

RepairRefs = Mapping[tuple[str, Any], Any]
"""(model label, run) -> ObjectRef of that run's one-run `RepairStats`; (model label,
FOLLOWERS) -> ObjectRef of the model's `FollowerWindows`: what followers and distillation
fit on, and the held-out windows every repaired point's gate judges it on."""
FOLLOWERS = "follower windows"
UNITS = "units"
"""(model label, (UNITS, run)) -> a sub-layer point's unit run's sums."""


@dataclass(frozen=True)
class TaskMaker:
    """Builds the tasks of one job, from its settings read once."""

    job: str
    """The job's name (each checkpoint's provenance names it)."""
    storage: str
    """The job's storage location (`Storage.location`), where every task writes."""
    checkpoints: str
    """How the job stores its variants: manifest, full or none."""
    evaluation: EvaluationSpec
    resources: ResourcesSpec
    repair: RepairSettings
    backend: str
    """none, transformers or vllm: decided once for the job."""

    @classmethod
    def for_job(cls, spec: JobSpec, storage: str, backend: str) -> TaskMaker:
        return cls(
            spec.name,
            storage,
            spec.checkpoints,
            spec.evaluation,
            spec.resources,
            spec.repair_settings,
            backend,
        )

    def point(self, point: GridPoint, refs: RepairRefs) -> PointTask:
        """What the point's Ray task receives: the model's reference, the storage location
        and, repaired, its runs' sums."""
        return PointTask(
            grid_key=point.key,
            model=point.model.source(),
            layers=point.layers,
            units=point.units,
            storage=self.storage,
            checkpoint=point.checkpoint,
            checkpoint_format=self.checkpoints,
            provenance=self.provenance(point),
            evaluation=point_evaluation(self.evaluation, point),
            resources=point_resources(self.resources.grid, point, self.backend),
            backend=self.backend,
            repair=self._repair(point, refs),
            name=point.name,
            experts=expert_cut(point),
        )

    def provenance(self, point: GridPoint) -> dict[str, Any]:
        """The `lorp_pruning.json` record of the point's checkpoint (the worker adds each
        run's fit: `lorp.provenance.with_repair_runs`)."""
        r = self.repair
        return provenance(
            source_model=point.model.spec.ref,
            source_fingerprint=point.model.fingerprint,
            method=point.method_name,
            options=point.options,
            budget=point.budget,
            n_blocks=point.model.n_blocks,
            pruned=point.layers,
            details=dict(point.selection.details) if point.selection else None,
            grid_key=point.key,
            job=self.job,
            calibration=asdict(point.model.calibration),
            repair=repair_record(
                point, r.rounds, r.ridge, (r.distill_epochs(point.method), float(r.distill_lr))
            ),
            experts=expert_record(point),
        )

    def _repair(self, point: GridPoint, refs: RepairRefs) -> RepairTask | None:
        if point.repair == "none":
            return None
        if point.method is not None and point.method.peer is not None:
            return peer_task(point, refs)
        r, runs, label = self.repair, tuple(point.runs), point.model.label
        stats = tuple(refs[(label, (UNITS, run) if point.sublayer else run)] for run in runs)
        return RepairTask(
            runs,
            stats,
            r.ridge_value,
            r.rounds,
            0 if point.sublayer else r.followers,  # unit runs take no followers
            refs.get((label, FOLLOWERS)),
            r.distill_epochs(point.method),
            float(r.distill_lr),
            r.gate,
            units=point.sublayer,
        )

    def speed(self, points: list[GridPoint]) -> SpeedTask:
        """What the speed task of one model's `points` receives (a whole node unless the
        spec sizes it: nothing else of the job shares its cores)."""
        plan, ev, res = points[0].model, self.evaluation, self.resources
        return SpeedTask(
            model=plan.source(),
            storage=self.storage,
            variants=tuple((p.key, timed_layers(p), p.checkpoint) for p in points),
            seq_len=ev.seq_len,
            min_rounds=ev.speed_repeats,
            budget_s=float(ev.speed_budget_s),
            half_width=float(ev.speed_half_width),
            resources=whole_node(res.speed, res.grid.num_gpus),
            n_blocks=plan.n_blocks,
            units={p.key: p.units for p in points if p.sublayer},
        )


def timed_layers(point: GridPoint) -> tuple[int, ...]:
    """The blocks `point`'s variant no longer runs: its removed blocks, less the block
    that carries LLM-Streamline's replacement FFN (`lorp.peers.streamline_layer`)."""
    from lorp.peers import streamline_layer

    if point.method is not None and point.method.peer == streamline_layer.REPAIR:
        return streamline_layer.skipped_blocks(point.layers)
    return tuple(point.layers)


def peer_task(point: GridPoint, refs: RepairRefs) -> RepairTask:
    """A peer recipe's repair: its name, its options, Prune&Comp's steps, and the model's
    calibration and held-out windows it fits on (`lorp.peers.recipes.repair_peer`)."""
    from lorp.peers.recipes import PeerRepair

    assert point.method is not None and point.selection is not None
    steps = tuple(point.selection.details.get("steps", ()))
    peer = PeerRepair(point.repair, dict(point.method.repair_options), steps)
    windows = refs.get((point.model.label, FOLLOWERS))
    return RepairTask((), (), None, windows=windows, gate=False, peer=peer)


def point_evaluation(evaluation: EvaluationSpec, point: GridPoint) -> EvaluationSpec:
    """The evaluation a point runs: the spec's, with a streamed model's larger batch (a
    batch never changes a figure, only how often the files are read) and the model's
    tensor parallel size (`ModelPlan.tensor_parallel`)."""
    batch = point.model.batch("evaluate", evaluation.batch_size)
    tp = point.model.tensor_parallel
    if (batch, tp) == (evaluation.batch_size, evaluation.tensor_parallel_size):
        return evaluation
    return dataclasses.replace(evaluation, batch_size=batch, tensor_parallel_size=tp)


def point_resources(grid: Resources, point: GridPoint, backend: str) -> Resources:
    """The grid's resources, with as many GPUs as the model's vLLM engine spans."""
    tp = point.model.tensor_parallel
    if backend != "vllm" or grid.num_gpus <= 0 or grid.num_gpus >= tp:
        return grid
    return dataclasses.replace(grid, num_gpus=tp)


def repair_record(
    point: GridPoint,
    rounds: int = 100,
    ridge: float | str = "auto",
    distill: tuple[int, float] = (0, 0.0),
) -> dict[str, Any] | None:
    """How a repaired point's maps are fitted (the task adds each run's fit)."""
    if point.repair == "none":
        return None
    if point.method is not None and point.method.peer is not None:
        return {
            "method": point.repair,
            "options": dict(point.method.repair_options),
            "recipe": "the peer's own repair, fitted on the calibration windows (lorp.peers)",
        }
    from lorp.repair.maps import RIDGES

    out: dict[str, Any] = {
        "method": point.repair,
        "ridge": ridge,
        "ridges": list(RIDGES) if ridge == "auto" else [ridge],
        "lambda": "ridge x tr(A_s) / d per run, pulling each map towards the unrepaired one",
        "validation": "each run's ridge chosen, and its map kept only where it beats the "
        "unrepaired map, on the held-out calibration windows (seed + 1, never fitted on)",
        "fit": "one pass of calibration statistics on dense inputs (pipeline capture workers)",
        "rounds": rounds,
    }
    if distill[0]:
        out["distill"] = {
            "epochs": distill[0],
            "lr": distill[1],
            "objective": "KL(dense || pruned) of the next token at every position of the "
            "calibration windows, every map trained together (lorp.repair.distill)",
            "validation": "the best epoch's maps on the held-out calibration windows' KL, "
            "the least-squares maps where none beats them",
        }
    return out


def twins(points: list[GridPoint]) -> dict[str, str]:
    """repaired point's key -> its unrepaired twin's key, where the job has both. A
    repair changes weights, never shapes: the twin's timing is the repaired variant's."""
    plain = {(p.model.label, p.label, p.budget): p.key for p in points if p.repair == "none"}
    out = {}
    for p in points:
        if p.repair != "none" and p.method is not None:  # its label less `+<repair>`
            twin = plain.get((p.model.label, p.label.rpartition("+")[0], p.budget))
            if twin is not None:
                out[p.key] = twin
    return out


def expert_cut(point: GridPoint) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """The point's expert cut as `PointTask.experts`: (block, removed experts) pairs."""
    return tuple(sorted(point.experts.removed.items())) if point.experts else ()


def expert_record(point: GridPoint) -> dict[str, Any] | None:
    """The expert cut in the checkpoint's `lorp_pruning.json` (None: no expert removed)."""
    if point.experts is None:
        return None
    cut = point.experts
    return {
        "method": cut.method,
        "removed_per_layer": cut.per_layer,
        "experts_per_layer": cut.kept,
        "removed": cut.as_dict(),
    }
