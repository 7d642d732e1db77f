"""What each stage sends to Ray, built from plain arguments: a grid point's task (with its
repair), a model's speed task. The fleet (`pipeline.fleet`) submits them; the workers
(`pipeline.stages.capture`, `.points`, `.speed_pass`) run them.

Nothing here reads the catalog or MLflow: a task is the spec's settings, the point, the
job's storage location and, for a repaired point, the object-store references of its
runs' sums.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pipeline.cluster.model_source import model_source
from pipeline.cluster.nodes import whole_node
from pipeline.messages import PointTask, RepairTask, SpeedTask
from pipeline.plan import GridPoint, checkpoint_rel
from pipeline.records.rows import provenance
from pipeline.spec.evaluation import EvaluationSpec
from pipeline.spec.job import JobSpec
from pipeline.spec.resources import Resources, ResourcesSpec

RepairRefs = Mapping[tuple[str, Any], Any]
"""(model label, run) -> ObjectRef of that run's one-run `RepairStats`; (model label,
FOLLOWERS) -> ObjectRef of the model's `FollowerWindows`: what followers and distillation
fit on, and the held-out windows every repaired point's gate judges it on."""
FOLLOWERS = "follower windows"
UNITS = "units"
"""(model label, (UNITS, run)) -> a sub-layer point's unit run's sums."""


def checkpoint(save_checkpoints: bool, point: GridPoint) -> str | None:
    """The point's checkpoint below the storage; None when it is not saved."""
    if not (save_checkpoints and point.pruned) or (point.sublayer and not point.servable):
        return None
    return checkpoint_rel(point)


def point_task(
    spec: JobSpec, storage: str, point: GridPoint, backend: str, refs: RepairRefs
) -> PointTask:
    """What the point's Ray task receives: the model's reference, the storage location
    (`Storage.location`) and, repaired, its runs' sums."""
    return PointTask(
        grid_key=point.key,
        model=model_source(point.model),
        layers=point.layers,
        units=point.units,
        storage=storage,
        checkpoint=checkpoint(spec.saves_checkpoints, point),
        checkpoint_format=spec.checkpoints,
        provenance=provenance(spec, point),
        evaluation=point_evaluation(spec.evaluation, point),
        resources=point_resources(spec.resources.grid, point, backend),
        backend=backend,
        repair=repair_task(spec, point, refs),
        name=point.name,
    )


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


def repair_task(spec: JobSpec, point: GridPoint, refs: RepairRefs) -> RepairTask | None:
    if point.repair == "none":
        return None
    runs = tuple(point.runs)
    label = point.model.label
    stats = tuple(refs[(label, (UNITS, r) if point.sublayer else r)] for r in runs)
    followers, distill = spec.repair_followers, spec.distill_epochs(point.method)
    followers = 0 if point.sublayer else followers  # unit runs take no followers
    windows = refs.get((label, FOLLOWERS))
    return RepairTask(
        runs, stats, spec.ridge_value, spec.repair_rounds, followers, windows, distill,
        float(spec.repair_distill_lr), spec.repair_gate, units=point.sublayer,
    )  # fmt: skip


def speed_task(
    ev: EvaluationSpec,
    resources: ResourcesSpec,
    storage: str,
    points: list[GridPoint],
    *,
    save_checkpoints: bool,
) -> SpeedTask:
    """What the speed task of one model's `points` receives (a whole node unless the
    spec sizes it: nothing else of the job shares its cores)."""
    plan = points[0].model
    return SpeedTask(
        model=model_source(plan),
        storage=storage,
        variants=tuple((p.key, p.layers, checkpoint(save_checkpoints, p)) for p in points),
        seq_len=ev.seq_len,
        min_rounds=ev.speed_repeats,
        budget_s=float(ev.speed_budget_s),
        half_width=float(ev.speed_half_width),
        resources=whole_node(resources.speed, resources.grid.num_gpus),
        n_blocks=plan.n_blocks,
        units={p.key: p.units for p in points if p.sublayer},
    )


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
