"""What the fleet (`pipeline.fleet`) records for a model's stages: each point as it ends,
its speed figures, its quality gate; and the tasks those stages send to Ray.

Recording order for a point: catalog row first, then the MLflow run is closed, so a killed
driver never leaves a FINISHED run without its row (the next start closes the rest).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from pipeline.cluster.model_source import model_source
from pipeline.cluster.scheduler import first_line, whole_node
from pipeline.evaluation.metrics import metric_name
from pipeline.plan import GridPoint
from pipeline.records.rows import PointResult, RowContext, catalog_row, headline
from pipeline.records.rows import provenance as point_provenance
from pipeline.stages.workers import PointTask, RepairTask, SpeedTask

if TYPE_CHECKING:
    from pipeline.job import JobRun

SPEED_COLUMNS = (
    "latency_ms",
    "latency_dense_ms",
    "speedup",
    "speedup_std",
    "speedup_measured",
    "speed_runs",
    "speed_resolved",
    "peak_mem_gib",
)


def point_task(job: JobRun, point: GridPoint, backend: str) -> PointTask:
    """What the point's Ray task receives: the model's reference and storage locations."""
    return PointTask(
        grid_key=point.key,
        model=model_source(point.model),
        layers=point.layers,
        storage=job.storage.location,
        checkpoint=job.checkpoint(point),
        provenance=point_provenance(job.spec, point),
        evaluation=job.spec.evaluation,
        resources=job.spec.resources.grid,
        backend=backend,
        repair=repair_task(job, point),
        name=point.name,
    )


def repair_task(job: JobRun, point: GridPoint) -> RepairTask | None:
    if point.repair == "none":
        return None
    from lorp.repair import DEFAULT_RIDGE

    runs = tuple(point.runs)
    refs = tuple(job.repair_refs[(point.model.label, r)] for r in runs)
    return RepairTask(runs, refs, DEFAULT_RIDGE, job.spec.repair_rounds)


def record_point(job: JobRun, point: GridPoint, result: PointResult, backend: str) -> None:
    run_id = job.run_ids[point.key]
    ckpt = job.checkpoint_uri(point)
    ctx = RowContext(job.tracker.display_uri, job.tracker.experiment_id, run_id, ckpt, backend)
    row = catalog_row(job.spec, point, job.facts[point.model.label], result, ctx)
    job.catalog.put(row)  # before FINISHED: see the module docstring
    metrics = {
        **result.metrics,
        "params": result.params,
        "seconds": result.seconds,
        "n_evals": point.n_evals,
        "select_s": point.select_s,
    }
    job.tracker.log(
        run_id, metrics=metrics, tags={"checkpoint": ckpt or "", "eval_backend": backend}
    )
    job.tracker.log_evaluation_inputs(run_id, job.spec.evaluation, result.zero_shot)
    job.tracker.finish(run_id)
    job.summary.done += 1
    job.events(
        "point",
        grid_key=point.key,
        model=point.model.label,
        method=point.label,
        budget=point.budget,
        seconds=round(result.seconds, 3),
    )
    name = f"{point.model.label} {point.name}"
    job.progress.point(name, headline(row, job.spec.evaluation.perplexity), result.seconds)


def record_failure(job: JobRun, point: GridPoint, exc: BaseException) -> None:
    job.tracker.finish(job.run_ids[point.key], "FAILED")
    cause = first_line(exc)
    job.summary.failed.append(f"{point.model.label}/{point.label}/{point.budget}: {cause}")
    job.events("point_failed", grid_key=point.key, error=str(exc)[-4000:], cause=cause)
    job.progress.point(f"{point.model.label} {point.name}", cause, 0.0, ok=False)


# -- speed -------------------------------------------------------------------------------


def _missing(row: dict[str, Any], column: str) -> bool:
    value = row.get(column)
    return value is None or (isinstance(value, float) and math.isnan(value))


def speed_task(job: JobRun, points: list[GridPoint]) -> SpeedTask:
    """What the speed task of one model's `points` receives."""
    ev, plan = job.spec.evaluation, points[0].model
    return SpeedTask(
        model=model_source(plan),
        storage=job.storage.location,
        variants=tuple((p.key, p.layers, job.checkpoint(p)) for p in points),
        seq_len=ev.seq_len,
        pairs=ev.speed_repeats,
        resources=whole_node(job.spec.resources.speed, job.spec.resources.grid.num_gpus),
        n_blocks=plan.n_blocks,
    )


def twins(points: list[GridPoint]) -> dict[str, str]:
    """repaired point's key -> its unrepaired twin's key, where the job has both. A
    repair changes weights, never shapes: the twin's timing is the repaired variant's."""
    plain = {(p.model.label, p.label, p.budget): p.key for p in points if p.repair == "none"}
    out = {}
    for p in points:
        if p.repair != "none" and p.method is not None:
            twin = plain.get((p.model.label, p.method.key, p.budget))
            if twin is not None:
                out[p.key] = twin
    return out


def speed_tasks(job: JobRun, points: list[GridPoint]) -> list[SpeedTask]:
    """One task per model whose finished variants lack speed figures (a repaired variant
    with an unrepaired twin in the job is not timed: it takes the twin's figures)."""
    ev, rows = job.spec.evaluation, job.catalog.by_key()
    if not (ev.enabled and ev.speed):
        return []
    shared = twins(points)
    pending: dict[str, list[GridPoint]] = defaultdict(list)
    for p in points:
        if p.key in rows and p.key not in shared and _missing(rows[p.key], "latency_ms"):
            pending[p.model.label].append(p)
    return [speed_task(job, ps) for ps in pending.values()]


def share_twin_speed(job: JobRun, points: list[GridPoint]) -> None:
    """Copy each timed twin's speed figures (latency, speed-up, spread) to its repaired
    variant; peak memory too, the checkpoint being the same size."""
    rows = job.catalog.by_key()
    for key, twin in twins(points).items():
        row, base = rows.get(key), rows.get(twin)
        if row is None or base is None or _missing(base, "latency_ms"):
            continue
        values = {c: base[c] for c in SPEED_COLUMNS if c in base}
        if any(not _same(row.get(c), v) for c, v in values.items()):
            job.catalog.update(key, values)
            job.tracker.log(row["mlflow_run_id"], metrics=values, tags={"speed_from": twin})


def record_speed(job: JobRun, model: str, figures: dict[str, dict[str, float]]) -> None:
    """A model's speed figures into its rows and runs."""
    for key, values in figures.items():
        row = job.catalog.update(key, values)
        job.tracker.log(row["mlflow_run_id"], metrics=values)
    job.events("speed", model=model, variants=len(figures))
    resolved = [v["speedup"] for v in figures.values() if _finite(v.get("speedup"))]
    unresolved = len(figures) - len(resolved)
    top = f"top speed-up {max(resolved):.2f}x" if resolved else "no speed-up resolved"
    job.progress.note(
        f"speed {model}: {len(figures)} variants timed ({top}"
        + (f"; {unresolved} not resolved" if unresolved else "")
        + ")"
    )


def _same(a: Any, b: Any) -> bool:
    """Equal, NaN equal to NaN (an unresolved speed-up stays NaN)."""
    nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    return nan or a == b


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


# -- quality gate ------------------------------------------------------------------------


def run_quality_gate(job: JobRun, points: list[GridPoint]) -> None:
    """`ppl_ratio` (variant / dense on the first corpus) and `degraded` on every row."""
    ev = job.spec.evaluation
    if not (ev.enabled and ev.perplexity):
        return
    column, rows = metric_name(ev.perplexity[0]), job.catalog.by_key()
    dense = {p.model.label: rows.get(p.key) for p in points if p.is_dense}
    for p in points:
        row, base = rows.get(p.key), dense.get(p.model.label)
        if row is None or base is None or _missing(row, column) or _missing(base, column):
            continue
        ratio = float(row[column]) / float(base[column])
        degraded = ratio > ev.degraded_ratio
        if row.get("ppl_ratio") != ratio or row.get("degraded") != degraded:
            job.catalog.update(p.key, {"ppl_ratio": ratio, "degraded": degraded})
            job.tracker.log(
                row["mlflow_run_id"],
                metrics={"ppl_ratio": ratio},
                tags={"degraded": str(degraded).lower()},
            )
        if degraded:
            job.summary.degraded.append(f"{p.model.label} {p.name}: {column} x{ratio:,.1f}")
