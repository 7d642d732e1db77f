"""Distributed capture of S (and of the repair sums) over calibration shards, and the tree
reduction of the partials. Pitfalls, where they bite:

- A capture worker is an actor so the model loads once and serves many shards; each shard
  returns its own partial statistics (nothing accumulates in the actor), so when Ray
  restarts a dead actor and retries a shard, that shard still contributes exactly once.
- Shards go to capture workers as they start, not round-robin up front: a worker still
  waiting for a node (an autoscaler bringing one up, or a cluster too small for the
  spec's count) takes no shard, so nothing waits on it; once every shard is handed out,
  idle and unstarted workers are killed, so a worker Ray restarts after a crash gets
  their resources back instead of waiting behind them.
- Partials merge pairwise in a tree of small tasks, so the driver never holds all of them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np
import ray

from lorp.locality.similarity_stats import SimilarityStats
from lorp.repair.stats import RepairStats
from pipeline.cluster.faults import maybe_fail
from pipeline.cluster.model_source import load_checked
from pipeline.events import timeline
from pipeline.events.timeline import span
from pipeline.messages import CaptureTask, Shard
from pipeline.stages.worker_setup import device_for, pin_threads


@ray.remote
class CaptureWorker:
    """Holds one loaded model; turns calibration shards into partial statistics."""

    def __init__(self, task: CaptureTask, submitted: float | None = None) -> None:
        start = timeline.actor_start(submitted)
        pin_threads(task.resources.num_cpus)
        # The decoder stack is all a capture runs: a streamed model's head stays unread.
        self.model = load_checked(task.model, device_for(task.resources), head=False).model
        self.task = task
        self._mode = "streamed" if task.model.streamed else "memory"
        timeline.report("load", start, time.time(), model=task.model.label, of="capture")

    def ready(self) -> bool:
        """Answers once the model is loaded: the worker can take shards."""
        return True

    def capture(
        self, windows: np.ndarray, name: str, calibration: tuple[str, int] | None = None
    ) -> SimilarityStats:
        """The partial S of one shard; `calibration` (fingerprint, skip_prefix) comes with
        the shard where the worker started before the shards were cut (its task's is
        then empty), and with every shard, so a restarted worker still has it."""
        from lorp.locality.capture import capture_stats

        fingerprint, skip = calibration or (self.task.calibration, self.task.skip_prefix)
        maybe_fail("capture", name)
        with span("capture", model=self.task.model.label, shard=name, mode=self._mode):
            return capture_stats(
                self.model,
                self._batches(windows),
                model_fingerprint=self.task.model.fingerprint,
                calibration_fingerprint=fingerprint,
                skip_prefix=skip,
                progress=False,
                sublayers=self.task.sublayers,
                experts=self.task.experts,
            )

    def repair(
        self, windows: np.ndarray, name: str, runs: list[tuple[int, int]], units: bool = False
    ) -> RepairStats:
        """The partial repair sums of `runs` over one shard (dense inputs, one pass); runs
        of sub-layer units where `units` (`lorp.repair.sublayer_repair`)."""
        from lorp.repair.capture import capture_repair_stats

        maybe_fail("repair", name)
        label = self.task.model.label
        with span("repair_sums", model=label, shard=name, runs=len(runs), mode=self._mode):
            if units:
                return self._unit_sums(windows, runs)
            return capture_repair_stats(
                self.model,
                self._batches(windows),
                runs,
                skip_prefix=self.task.skip_prefix,
                model_fingerprint=self.task.model.fingerprint,
                calibration_fingerprint=self.task.calibration,
                progress=False,
            )

    def _unit_sums(self, windows: np.ndarray, runs: list[tuple[int, int]]) -> RepairStats:
        from lorp.repair.sublayer_repair import capture_unit_stats

        stats = capture_unit_stats(
            self.model, self._batches(windows), runs, skip_prefix=self.task.skip_prefix
        )
        stats.model_fingerprint = self.task.model.fingerprint
        stats.calibration_fingerprint = self.task.calibration
        return stats

    def _batches(self, windows: np.ndarray) -> list[Any]:
        import torch

        ids = torch.from_numpy(np.asarray(windows, dtype=np.int64))
        size = self.task.batch_size
        return [ids[i : i + size] for i in range(0, len(ids), size)]


@ray.remote(num_cpus=0)
def merge_pair(a: Any, b: Any) -> Any:
    """Two partials of the same statistics (`SimilarityStats` or `RepairStats`) merged."""
    return a.merge(b)


def tree_reduce(refs: list[Any]) -> Any:
    """Merge partial statistics pairwise in Ray; the driver fetches only the result."""
    if not refs:
        raise ValueError("no partial statistics to merge")
    while len(refs) > 1:
        merged = [merge_pair.remote(refs[i], refs[i + 1]) for i in range(0, len(refs) - 1, 2)]
        refs = merged + ([refs[-1]] if len(refs) % 2 else [])
    return ray.get(refs[0])


def capture_workers(n_shards: int, workers: int | None) -> int:
    """How many capture workers: the spec's count, else one per shard; never more than
    shards. Decided from the spec alone, so an autoscaler sees the demand."""
    return max(1, min(n_shards, workers or n_shards))


def start_capture_workers(task: CaptureTask, n_shards: int, workers: int | None) -> list[Any]:
    """The capture workers of `task`'s model, started now so that the model loads while
    the driver cuts the calibration shards; `task`'s calibration comes with the shards
    (`distributed_capture(..., actors=)`). `stop_workers` ends them unused."""
    return _start_workers(task, capture_workers(n_shards, workers))


def stop_workers(actors: list[Any]) -> None:
    for actor in actors:
        ray.kill(actor)


def _start_workers(task: CaptureTask, n: int) -> list[Any]:
    return [
        CaptureWorker.options(
            num_cpus=task.resources.num_cpus,
            num_gpus=task.resources.num_gpus,
            max_restarts=3,
            max_task_retries=3,
            scheduling_strategy="SPREAD",
        ).remote(task, time.time())
        for _ in range(n)
    ]


def distributed_capture(
    task: CaptureTask,
    shards: list[Shard],
    workers: int | None = None,
    actors: list[Any] | None = None,
) -> SimilarityStats:
    """S over all shards, spread over capture workers (SPREAD: across nodes where it can);
    `actors`: workers started earlier (`start_capture_workers`); each shard carries the
    calibration."""
    if actors is None:
        actors = _start_workers(task, capture_workers(len(shards), workers))
    calibration = (task.calibration, task.skip_prefix)
    try:
        jobs = [("capture", (ref, s.name, calibration)) for ref, s in _put(shards)]
        return tree_reduce(_dispatch(actors, jobs))
    finally:
        for actor in actors:
            ray.kill(actor)


def distributed_repair_capture(
    task: CaptureTask,
    shards: list[Shard],
    passes: list[list[tuple[int, int]]],
    workers: int | None = None,
    held: Mapping[str, Shard] | None = None,
    units: bool = False,
) -> RepairStats:
    """The repair sums of every run in `passes` over all shards: each worker loads the
    model once and makes one pass per group of runs over each shard it takes (a group's
    sums fit the worker's memory budget, `lorp.repair.stats.repair_passes`); each group's
    partials merge in their own tree, and the groups join into one object. `held`: domain
    -> its held-out windows, each summed apart by the same workers into the result's
    held-out sums of that domain (`RepairStats.held_domains`). `units`: the runs are of
    sub-layer units."""
    actors = _start_workers(task, capture_workers(len(shards), workers))
    domains = list(held or {})
    try:
        put = _put(shards + [held[d] for d in domains] if held else shards)
        jobs = [("repair", (ref, s.name, runs, units)) for runs in passes for ref, s in put]
        partials = _dispatch(actors, jobs)
        n, k = len(shards), len(put)
        groups = [tree_reduce(partials[i * k : i * k + n]) for i in range(len(passes))]
        held_groups = {
            d: ray.get([partials[i * k + n + j] for i in range(len(passes))])
            for j, d in enumerate(domains)
        }
    finally:
        for actor in actors:
            ray.kill(actor)
    stats = RepairStats.join(groups)
    if held_groups:
        stats.held_domains = {d: RepairStats.join(g) for d, g in held_groups.items()}
    return stats


def _put(shards: list[Shard]) -> list[tuple[Any, Shard]]:
    """Every shard's windows in the object store once, however many passes read them."""
    return [(ray.put(s.windows), s) for s in shards]


def _dispatch(actors: list[Any], jobs: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
    """Each job (a worker method and its arguments) to the next free worker that has
    started; the results' refs, in job order. Once all jobs are handed out, each worker
    that falls idle goes at once, and so do those still starting: their CPUs let a
    restarted worker (retrying the job it died on) come back, and an autoscaler stops
    asking for nodes nobody needs."""
    queue = deque(enumerate(jobs))
    starting = {actor.ready.remote(): actor for actor in actors}
    busy: dict[Any, tuple[Any, int]] = {}
    results: list[Any] = [None] * len(jobs)
    while queue or busy:
        ref = ray.wait([*starting, *busy], num_returns=1)[0][0]
        if ref in starting:
            actor = starting.pop(ref)
            ray.get(ref)  # a worker that cannot load the model fails the capture here
        else:
            actor, i = busy.pop(ref)
            results[i] = ref
        if queue:
            i, (method, args) = queue.popleft()
            busy[getattr(actor, method).remote(*args)] = (actor, i)
            continue
        for idle in [actor, *starting.values()]:
            ray.kill(idle)  # its partial stays in the object store: the driver owns it
        starting.clear()
    return results
