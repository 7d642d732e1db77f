"""Scheduling grid points on Ray: a bounded queue, `ray.wait`, retries and evaluator pools.

The scheduler knows nothing of MLflow or the catalog: it reports through callbacks
(`on_start`, `on_done`, `on_failed`), and the driver records. Retries are Ray's: a point
task is retried when its worker dies (`max_retries`), an evaluator actor is restarted and
its call retried (`max_restarts`, `max_task_retries`); a point that still fails is
reported once and the grid goes on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import ray

from pipeline.plan import GridPoint
from pipeline.records import PointResult
from pipeline.spec import Resources
from pipeline.workers import PointEvaluator, PointTask, SpeedTask, run_point, run_speed


class PointPool(Protocol):
    capacity: int

    def submit(self, task: PointTask) -> Any: ...

    def release(self, ref: Any) -> None: ...


class TaskPool:
    """Points as Ray tasks (transformers or no evaluation), `capacity` in flight."""

    def __init__(self, capacity: int, resources: Resources) -> None:
        self.capacity, self.resources = capacity, resources

    def submit(self, task: PointTask) -> Any:
        res = self.resources
        return run_point.options(num_cpus=res.num_cpus, num_gpus=res.num_gpus).remote(task)

    def release(self, ref: Any) -> None:
        pass


class EvaluatorPool:
    """Points on long-lived vLLM evaluator actors, one point per actor at a time."""

    def __init__(self, size: int, resources: Resources) -> None:
        self.idle = [
            PointEvaluator.options(
                num_cpus=resources.num_cpus,
                num_gpus=resources.num_gpus,
                max_restarts=2,
                max_task_retries=2,
            ).remote()
            for _ in range(size)
        ]
        self.capacity = size
        self.busy: dict[Any, Any] = {}

    def submit(self, task: PointTask) -> Any:
        actor = self.idle.pop()
        ref = actor.run.remote(task)
        self.busy[ref] = actor
        return ref

    def release(self, ref: Any) -> None:
        self.idle.append(self.busy.pop(ref))


def make_pool(backend: str, capacity: int, resources: Resources) -> PointPool:
    if backend == "vllm":
        return EvaluatorPool(capacity, resources)
    return TaskPool(capacity, resources)


def first_line(exc: BaseException) -> str:
    """The cause of a Ray task error, as one line."""
    text = str(exc).strip()
    return text.splitlines()[-1] if text else repr(exc)


def run_points(
    items: Sequence[tuple[GridPoint, PointTask]],
    pool: PointPool,
    on_start: Callable[[GridPoint], None],
    on_done: Callable[[GridPoint, PointResult], None],
    on_failed: Callable[[GridPoint, BaseException], None],
) -> None:
    """Run every point, at most `pool.capacity` at once, reporting each as it ends."""
    queue = deque(items)
    in_flight: dict[Any, GridPoint] = {}
    while queue or in_flight:
        while queue and len(in_flight) < pool.capacity:
            point, task = queue.popleft()
            on_start(point)
            in_flight[pool.submit(task)] = point
        ready, _ = ray.wait(list(in_flight), num_returns=1)
        point = in_flight.pop(ready[0])
        pool.release(ready[0])
        try:
            result = ray.get(ready[0])
        except Exception as exc:  # failed after its retries: report, go on
            on_failed(point, exc)
            continue
        on_done(point, result)


def whole_node(resources: Resources | None, gpus: float) -> Resources:
    """A speed task's request: the spec's, else every CPU of the largest node (and a GPU
    where the grid uses GPUs), so nothing else of the job shares its cores."""
    if resources is not None:
        return resources
    cpus = max((n["Resources"].get("CPU", 1) for n in ray.nodes() if n["Alive"]), default=1)
    return Resources(num_cpus=cpus, num_gpus=1 if gpus > 0 else 0)


def run_speed_pass(
    tasks: Sequence[SpeedTask],
    on_done: Callable[[SpeedTask, dict[str, dict[str, float]]], None],
    on_failed: Callable[[SpeedTask, BaseException], None],
) -> None:
    """One speed task per model, each on a whole node; Ray queues them node by node."""
    refs = {
        run_speed.options(num_cpus=t.resources.num_cpus, num_gpus=t.resources.num_gpus).remote(t): t
        for t in tasks
    }
    while refs:
        ready, _ = ray.wait(list(refs), num_returns=1)
        task = refs.pop(ready[0])
        try:
            result = ray.get(ready[0])
        except Exception as exc:  # speed is a figure, not the variant: record, go on
            on_failed(task, exc)
            continue
        on_done(task, result)
