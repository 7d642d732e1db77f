"""Where grid points run on Ray: as tasks (transformers, no evaluation) or on vLLM
evaluator actors. The fleet (`pipeline.driver.fleet`) decides when.

Retries are Ray's: a point task is retried when its worker dies (`max_retries`), an
evaluator actor is restarted and its call retried (`max_restarts`, `max_task_retries`); a
point that still fails is reported once and the grid goes on.
"""

from __future__ import annotations

from typing import Any, Protocol

import ray

from pipeline.messages import PointTask
from pipeline.spec.resources import Resources
from pipeline.stages.points import PointEvaluator, run_point


class PointPool(Protocol):
    capacity: int

    def submit(self, task: PointTask) -> Any: ...

    def release(self, ref: Any) -> None: ...

    def shrink(self) -> None: ...


class TaskPool:
    """Points as Ray tasks (transformers or no evaluation), `capacity` in flight."""

    def __init__(self, capacity: int, resources: Resources) -> None:
        self.capacity, self.resources = capacity, resources

    def submit(self, task: PointTask) -> Any:
        res = self.resources
        return run_point.options(num_cpus=res.num_cpus, num_gpus=res.num_gpus).remote(task)

    def release(self, ref: Any) -> None:
        pass

    def shrink(self) -> None:
        pass


class EvaluatorPool:
    """Points on long-lived vLLM evaluator actors, one point per actor at a time. Actors
    start as points need them and idle ones go when no point is queued (`shrink`), so
    a GPU an evaluator would hold idle serves another model's capture or selection. An
    actor has the GPUs of the points it runs (a model's tensor parallel size): a point
    reuses an idle actor of its size, and idle actors of another size go before one of
    its size starts, so they never hold the GPUs it waits for."""

    def __init__(self, size: int, resources: Resources) -> None:
        self.capacity, self.resources = size, resources
        self.idle: list[tuple[Any, tuple[float, float]]] = []
        self.busy: dict[Any, tuple[Any, tuple[float, float]]] = {}

    def submit(self, task: PointTask) -> Any:
        actor = self.actor_for(task.resources)
        ref = actor.run.remote(task)
        self.busy[ref] = (actor, _shape(task.resources))
        return ref

    def actor_for(self, res: Resources) -> Any:
        """An idle actor with `res`'s CPUs and GPUs, else a new one, started once every
        idle actor (of other sizes) is gone."""
        shape = _shape(res)
        match = next((i for i, (_, s) in enumerate(self.idle) if s == shape), None)
        if match is not None:
            return self.idle.pop(match)[0]
        self.shrink()
        return PointEvaluator.options(
            num_cpus=res.num_cpus, num_gpus=res.num_gpus, max_restarts=2, max_task_retries=2
        ).remote()

    def release(self, ref: Any) -> None:
        self.idle.append(self.busy.pop(ref))

    def shrink(self) -> None:
        for actor, _ in self.idle:
            ray.kill(actor)
        self.idle.clear()


def _shape(res: Resources) -> tuple[float, float]:
    return (res.num_cpus, res.num_gpus)


def make_pool(backend: str, capacity: int, resources: Resources) -> PointPool:
    if backend == "vllm":
        return EvaluatorPool(capacity, resources)
    return TaskPool(capacity, resources)
