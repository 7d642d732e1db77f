"""The job driver: (models x budgets x methods) -> pruned, recorded, catalogued variants.

Per model: calibration shards once, S once (cached by content key), the model's profile
(RLS, K, clusters) once; then per (budget, method) a selection in the driver
(milliseconds); the linear repair's sums for every run those selections remove, once per
model on the capture workers (cached); and per (budget, method, repair) a Ray task for
repair fit and fold, surgery, saving and evaluation; then a speed pass that
times every variant against its dense model on a whole node. Points already in the catalog
are skipped, so a rerun resumes; `force` redoes them. A point's catalog row is written
before its MLflow run is closed, so a driver killed at any moment leaves a state the next
start repairs exactly.

Where things live: planning and keys in `plan`, the run's context in `job`, S in
`statistics`, the grid stages in `grid`, Ray queues in `scheduler`, rows and provenance
in `records`, log lines in `progress`, joining or starting Ray in `connect`.
"""

from __future__ import annotations

import importlib.util

from pipeline.connect import init_ray
from pipeline.grid import run_grid, run_quality_gate, run_speed
from pipeline.job import JobRun
from pipeline.model_registry import register_variants
from pipeline.plan import plan_models, resolve_backend
from pipeline.progress import Progress
from pipeline.records import RunSummary
from pipeline.spec import JobSpec


def run_job(spec: JobSpec, *, force: bool = False, progress: Progress | None = None) -> RunSummary:
    """Run a job spec end to end; returns what was done, skipped and failed."""
    plans = plan_models(spec)  # every input error surfaces here, before any file
    backend = resolve_backend(spec, importlib.util.find_spec("vllm") is not None)
    job = JobRun(spec, force, progress or Progress(bar=False))
    job.open()
    init_ray(spec)
    points = [p for plan in plans for p in job.prepare_model(plan, backend)]
    todo = job.todo(points)
    job.events("grid", points=len(points), todo=len(todo), skipped=job.summary.skipped)
    job.progress.grid(len(todo), job.summary.skipped)
    try:
        todo = job.prepare_repairs(todo)  # once per model, after its selections
        run_grid(job, todo, backend)
        run_speed(job, points)
        run_quality_gate(job, points)
        if spec.tracking.register:
            register_variants(job, points)
    finally:
        job.progress.close()
    s = job.summary
    job.events("end", done=s.done, skipped=s.skipped, failed=len(s.failed))
    return s


__all__ = ["init_ray", "run_job"]
