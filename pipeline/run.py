"""The job driver: (models x budgets x methods) -> pruned, recorded, catalogued variants.

Per model: calibration shards once, S once (cached by content key), the model's profile
(RLS, K, clusters) once; then per (budget, method) a selection in the driver
(milliseconds) and a Ray task for surgery, saving and evaluation; then a speed pass that
times every variant against its dense model on a whole node. Points already in the catalog
are skipped, so a rerun resumes; `force` redoes them. A point's catalog row is written
before its MLflow run is closed, so a driver killed at any moment leaves a state the next
start repairs exactly.

Where things live: planning and keys in `plan`, the run's context in `job`, S in
`statistics`, the grid stages in `grid`, Ray queues in `scheduler`, rows and provenance
in `records`, log lines in `progress`.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import ray

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


def init_ray(spec: JobSpec) -> None:
    """Join the cluster named by RAY_ADDRESS or the spec; otherwise start a fresh local Ray
    (`address="local"`), whatever other cluster this machine knows of."""
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS") or spec.ray.address
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
        return
    # Embedded local Ray; its dashboard (when installed) binds to loopback only. Worker
    # output (library warnings, progress bars) stays in Ray's session logs unless lorp
    # runs verbose: the driver's own lines are the job's voice, errors come back raised.
    ray.init(
        address="local",
        num_cpus=spec.ray.num_cpus,
        include_dashboard=False,
        dashboard_host="127.0.0.1",
        logging_level=logging.WARNING,
        log_to_driver=logging.getLogger().isEnabledFor(logging.INFO),
    )
