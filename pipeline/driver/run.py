"""The job driver: (models x budgets x methods x repairs) -> pruned, recorded, catalogued
variants, for a fleet of models at once.

Per model, a chain of stages (`pipeline.driver.fleet`): calibration shards once, S once (cached
by content key), the model's profile (RLS, K, clusters) once; per (budget, method) a
selection (milliseconds in the driver; loss-guided ones on Ray actors, cached); the linear
repair's sums for every run those selections remove, once per model (cached); per (budget,
method, repair) a Ray task for repair fit and fold, surgery, saving and evaluation; then
the model's speed task on a whole node, its quality gate and its registry versions. Every
model's chain is in flight at once, each waiting only for slots.

Points already in the catalog are skipped, so a rerun resumes; `force` redoes them. A
point's catalog row is written before its MLflow run is closed, so a driver killed at any
moment leaves a state the next start repairs exactly. A stopped driver (SIGTERM, Ctrl-C)
ends its points in flight as KILLED and says what a rerun will do.

Where things live: planning and keys in `pipeline.plan`, a model's stages up to its
points in `model_stages`, the tasks they submit in `tasks`, the schedule in `fleet`,
every record (catalog, MLflow, events, summary) in `recorder`, the stages' code in
`pipeline.stages`, the tables in `pipeline.catalog`, MLflow and the registry in
`pipeline.tracking`, Ray plumbing in `pipeline.cluster`, evaluation in
`pipeline.evaluation`; docs/architecture.md says what may import what.
"""

from __future__ import annotations

import importlib.util
import signal
from collections.abc import Iterator
from contextlib import contextmanager

from pipeline.cluster.connect import init_ray
from pipeline.driver.fleet import Fleet, Stopped
from pipeline.driver.model_stages import Preparer
from pipeline.driver.recorder import Recorder
from pipeline.driver.summary import RunSummary
from pipeline.driver.tasks import TaskMaker
from pipeline.events import timeline
from pipeline.events.progress import Progress
from pipeline.plan.memory import plan_memory
from pipeline.plan.models import plan_models, resolve_backend, unwritable_locations
from pipeline.spec.checks import SpecError
from pipeline.spec.job import JobSpec


def run_job(
    spec: JobSpec,
    *,
    force: bool = False,
    force_speed: bool = False,
    progress: Progress | None = None,
) -> RunSummary:
    """Run a job spec end to end; returns what was done, skipped and failed. A stop
    signal raises `Stopped` once the points in flight are closed as KILLED. `force`
    redoes every point; `force_speed` times every variant again (the speed pass)."""
    for problem in unwritable_locations(spec):  # before any file
        raise SpecError(problem)
    plans = plan_models(spec)  # every input error surfaces here, before any file
    backend = resolve_backend(spec, importlib.util.find_spec("vllm") is not None)
    recorder = Recorder(spec, force, progress or Progress(bar=False), force_speed=force_speed)
    done = recorder.open()
    for line in (
        w for p in plans for w in p.warnings(spec.repair, spec.sublayers, spec.experts.enabled)
    ):
        recorder.progress.note(f"warning: {line}")
    init_ray(spec.ray)
    plans = [plan_memory(spec, p, backend) for p in plans]  # needs the cluster's memory
    for p in plans:
        recorder.memory_planned(p)
    kind = "GPU" if spec.resources.grid.num_gpus > 0 else "CPU"
    recorder.cluster(kind, timeline.cluster_slots(), len(plans))
    # transformers' lazy module is not safe to import from two threads at once, and each
    # model's preparation runs in a thread of its own: a plan whose reads came from the
    # cache has not imported it yet ("cannot import name 'AutoTokenizer'" in one thread)
    import transformers  # noqa: F401

    preparer = Preparer(spec, force, done, recorder.preparation, recorder.progress.note)
    tasks = TaskMaker.for_job(spec, recorder.storage.location, backend)
    fleet = Fleet(tasks, preparer, recorder, plans)
    try:
        with stop_signals(fleet):
            fleet.run()
    except (Stopped, KeyboardInterrupt) as exc:
        stop = exc if isinstance(exc, Stopped) else Stopped(signal.SIGINT)
        stop.summary = fleet.status_line()
        recorder.stopped(stop.name)
        raise stop from None
    finally:
        recorder.close()
    return recorder.ended()


@contextmanager
def stop_signals(fleet: Fleet) -> Iterator[None]:
    """SIGTERM and SIGINT ask the fleet to stop (`Fleet.stop_requested`); its loop raises
    `Stopped` where nothing is half-recorded. Ray's own handler would print a C++ stack
    trace and abort. A second signal changes nothing; the old handlers come back after."""

    def handler(signum: int, frame: object) -> None:
        fleet.stop_requested = fleet.stop_requested or signum

    import threading

    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only (a driver embedded in a thread)
        return
    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


__all__ = ["Stopped", "init_ray", "run_job"]
