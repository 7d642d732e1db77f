"""The fleet scheduler: every model's stages in flight at once, on one driver loop.

A model is a chain of stages: calibration shards -> capture and reduce (S) -> profile ->
selections (loss-guided ones on evaluator actors) -> repair sums -> grid points -> speed
-> quality gate -> registry. The driver runs up to `resources.max_models_in_flight`
chains at once (default: all of them):

- a model's preparation (everything up to its grid points) runs in a driver thread of
  its own, which mostly waits on Ray (capture workers, loss workers, repair sums); it
  writes events and log lines, never MLflow or the catalog;
- the driver's loop owns every grid point and speed task as a Ray future: it submits a
  prepared model's points as slots allow (`max_concurrent_points` in flight, earlier
  models first), records each point as it ends (catalog row, then the MLflow run closes),
  starts a model's speed task the moment its last point ends, then gates and registers
  that model, so model A's registry, model B's points and model C's capture overlap;
- a model that fails (bad checkpoint, a stage out of retries) is recorded with its
  reason; the others go on;
- Ray queues what the cluster cannot yet hold. Nothing holds a slot while it waits for
  another model's work: capture and loss workers take shards and candidates only once
  started, and idle vLLM evaluators go whenever no point is queued.

`max_models_in_flight: 1` runs one model's chain after the other: the serial baseline
`benchmarks/fleet.py` compares against. A stop (SIGTERM, Ctrl-C) ends the points in
flight as KILLED and leaves what a rerun resumes.
"""

from __future__ import annotations

import contextlib
import heapq
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray

from pipeline.cluster.scheduler import first_line, make_pool
from pipeline.plan import GridPoint, ModelPlan
from pipeline.records import timeline
from pipeline.stages.grid import (
    point_task,
    record_failure,
    record_point,
    record_speed,
    run_quality_gate,
    share_twin_speed,
    speed_tasks,
)
from pipeline.stages.workers import run_speed

if TYPE_CHECKING:
    from pipeline.job import JobRun, PreparedModel

POLL_S = 0.25
"""How long the loop waits on Ray before it looks at the model threads again."""


class Stopped(Exception):
    """The driver was told to stop (SIGTERM, SIGINT): raised on its thread."""

    def __init__(self, signum: int) -> None:
        import signal

        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"stopped by {self.name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@dataclass
class ModelChain:
    """One model's way through the fleet."""

    index: int
    plan: ModelPlan
    future: Future[PreparedModel] = field(default_factory=Future)
    inbox: queue.Queue[tuple[str, Any]] = field(default_factory=queue.Queue)
    """What the model's thread made ready, in order (`JobRun.prepare_model`'s `emit`)."""
    adopted: bool = False
    prepared: PreparedModel | None = None
    running: int = 0
    """Its points in flight or queued."""
    speed: Any = None
    """Its speed task's ref while it runs."""
    state: str = "waiting"
    """waiting, preparing, points, speed, done, failed."""


def _in_thread(fn: Callable[[], Any], future: Future[Any], name: str) -> None:
    def target() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - delivered to the driver's loop
            future.set_exception(exc)

    threading.Thread(target=target, name=name, daemon=True).start()


class Fleet:
    """Runs every model's chain of the job; `run()` returns when all have ended."""

    def __init__(self, job: JobRun, plans: list[ModelPlan], backend: str) -> None:
        self.job, self.backend = job, backend
        res = job.spec.resources
        self.max_models = res.max_models_in_flight or len(plans)
        self.capacity = max(1, res.max_concurrent_points)
        self.chains = [ModelChain(i, p) for i, p in enumerate(plans)]
        self.queue: list[tuple[int, int, GridPoint]] = []
        self.seq = 0
        self.pool = make_pool(backend, self.capacity, res.grid)
        self.in_flight: dict[Any, tuple[GridPoint, ModelChain]] = {}
        self.speeds: dict[Any, ModelChain] = {}
        self.spans = timeline.start_span_log()
        self.driver_s = 0.0
        """The driver's own time recording points (MLflow, catalog, events)."""
        self.recorded = 0
        self.cut_short = 0
        self.stop_requested = 0
        """The signal that asked the driver to stop (set by `pipeline.run.stop_signals`)."""
        """Points in flight when the driver was stopped."""

    # -- the loop ----------------------------------------------------------------------

    def run(self) -> None:
        job = self.job
        job.progress.fleet(len(self.chains), self.max_models, self.capacity)
        last_drain = 0.0
        try:
            while self._pending():
                if self.stop_requested:
                    raise Stopped(self.stop_requested)
                self._start_models()
                self._harvest()
                self._submit()
                self._finish_models()
                self._wait()
                if time.monotonic() - last_drain > 1.0:
                    self._drain()
                    last_drain = time.monotonic()
        except (Stopped, KeyboardInterrupt):
            self._stop()
            raise
        finally:
            self._drain()
        job.events(
            "fleet",
            models=len(self.chains),
            points=self.recorded,
            driver_s=round(self.driver_s, 3),
            driver_ms_per_point=round(1000 * self.driver_s / max(self.recorded, 1), 3),
        )

    def _pending(self) -> bool:
        """Work left: a model not ended, or points of a failed model still queued or
        running (they are recorded like any other)."""
        ended = all(c.state in ("done", "failed") for c in self.chains)
        return not ended or bool(self.queue or self.in_flight or self.speeds)

    def _start_models(self) -> None:
        active = sum(c.state in ("preparing", "points", "speed") for c in self.chains)
        for chain in self.chains:
            if active >= self.max_models:
                return
            if chain.state != "waiting":
                continue
            chain.state, active = "preparing", active + 1
            self._begin(f"prepare:{chain.plan.label}", "prepare", chain.plan.label)
            _in_thread(
                lambda c=chain: self.job.prepare_model(
                    c.plan, self.backend, lambda kind, what: c.inbox.put((kind, what))
                ),
                chain.future,
                f"lorp-prepare-{chain.plan.label}",
            )

    def _harvest(self) -> None:
        """What the model threads have made ready: a model's records, then its points
        into the queue as they come (a point starts while its model's slower selections
        go on); a model whose preparation ended is ready for its last stages."""
        job = self.job
        for chain in self.chains:
            if chain.state != "preparing":
                continue
            label = chain.plan.label
            while not chain.inbox.empty():
                kind, what = chain.inbox.get()
                if kind == "adopt":
                    try:
                        job.adopt(what)
                    except Exception as exc:  # noqa: BLE001 - this model fails, the fleet goes on
                        self._model_failed(chain, exc)
                        break
                    chain.adopted = True
                else:
                    self._enqueue(chain, what)
            if chain.state != "preparing" or not chain.future.done():
                continue
            if not chain.inbox.empty():
                continue  # the thread's last words first
            job.events("finish", unit=f"prepare:{label}")
            try:
                prep = chain.future.result()
            except Exception as exc:  # noqa: BLE001 - this model fails, the fleet goes on
                self._model_failed(chain, exc)
                continue
            chain.prepared, chain.state = prep, "points"
            job.summary.skipped += prep.skipped
            left = sum(c.state in ("waiting", "preparing") for c in self.chains)
            job.events(
                "grid",
                model=label,
                points=len(prep.points),
                todo=len(prep.pending),
                skipped=prep.skipped,
            )
            job.progress.add_points(label, len(prep.pending), prep.skipped, left)

    def _enqueue(self, chain: ModelChain, points: list[GridPoint]) -> None:
        for p in points:
            heapq.heappush(self.queue, (chain.index, self.seq, p))
            self.seq += 1
        chain.running += len(points)
        self.job.progress.grow(len(points))

    def _submit(self) -> None:
        job = self.job
        while self.queue and len(self.in_flight) < self.capacity:
            index, _, point = heapq.heappop(self.queue)
            chain = self.chains[index]
            start = time.perf_counter()
            job.replace_old(point)
            run_id = job.tracker.start_point(
                job.spec.name, job.parents[point.model.label], point.key, point.name
            )
            from pipeline.records.rows import point_params

            job.tracker.log(run_id, params=point_params(point))
            job.run_ids[point.key] = run_id
            task = point_task(job, point, self.backend)
            self.in_flight[self.pool.submit(task)] = (point, chain)
            self._begin(point.key, "point", point.model.label, point=point.name)
            self.driver_s += time.perf_counter() - start
        if not self.queue:
            self.pool.shrink()  # idle evaluators give their slots to other models' stages

    def _wait(self) -> None:
        refs = [*self.in_flight, *self.speeds]
        if not refs:
            preparing = [c.future for c in self.chains if c.state == "preparing"]
            if preparing:
                from concurrent.futures import FIRST_COMPLETED, wait

                wait(preparing, timeout=POLL_S, return_when=FIRST_COMPLETED)
            return
        ready, _ = ray.wait(refs, num_returns=1, timeout=POLL_S)
        if ready:  # everything else that has ended too, in one go
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in ready:
            if ref in self.in_flight:
                self._point_ended(ref)
            else:
                self._speed_ended(ref)

    def _point_ended(self, ref: Any) -> None:
        job = self.job
        point, chain = self.in_flight.pop(ref)
        self.pool.release(ref)
        chain.running -= 1
        start = time.perf_counter()
        try:
            result = ray.get(ref)
        except Exception as exc:  # failed after its retries: recorded, the grid goes on
            record_failure(job, point, exc)
        else:
            record_point(job, point, result, self.backend)
            self.recorded += 1
        job.events("finish", unit=point.key)
        self.driver_s += time.perf_counter() - start

    def _finish_models(self) -> None:
        """Models whose points have all ended: speed task, else gate and registry."""
        ev = self.job.spec.evaluation
        whole_node = ev.enabled and ev.speed and self.job.spec.resources.speed is None
        for chain in self.chains:
            if chain.state != "points" or chain.running:
                continue
            if whole_node and self.queue:
                # A whole-node request queued in Ray holds back the slots it waits for:
                # on a small cluster the points left would run one at a time. It goes
                # once no point waits for a slot.
                continue
            assert chain.prepared is not None
            tasks = speed_tasks(self.job, chain.prepared.points)
            if tasks:
                (task,) = tasks
                res = task.resources
                ref = run_speed.options(num_cpus=res.num_cpus, num_gpus=res.num_gpus).remote(task)
                self.speeds[ref] = chain
                chain.speed, chain.state = ref, "speed"
                self._begin(f"speed:{chain.plan.label}", "speed", chain.plan.label)
                n = len(task.variants)
                self.job.progress.note(f"speed {chain.plan.label}: {n} variants queued")
                continue
            self._close_model(chain)

    def _speed_ended(self, ref: Any) -> None:
        chain = self.speeds.pop(ref)
        label = chain.plan.label
        self.job.events("finish", unit=f"speed:{label}")
        try:
            figures = ray.get(ref)
        except Exception as exc:  # speed is a figure, not the variant: record, go on
            self.job.events("speed_failed", model=label, cause=first_line(exc))
            self.job.progress.note(f"speed failed for {label}: {first_line(exc)}")
        else:
            record_speed(self.job, label, figures)
        self._close_model(chain)

    def _close_model(self, chain: ModelChain) -> None:
        """The model's last stages on the driver: twins' speed, gate, registry."""
        from pipeline.records.model_registry import register_variants

        job, label = self.job, chain.plan.label
        assert chain.prepared is not None
        points = chain.prepared.points
        start = time.time()
        share_twin_speed(job, points)
        run_quality_gate(job, points)
        if job.spec.tracking.register:
            register_variants(job, points)
        end = time.time()
        job.events(
            "span",
            stage="gate",
            model=label,
            start=start,
            end=end,
            node="driver",
            worker="driver",
            slots={},
        )
        chain.state = "done"
        left = sum(c.state not in ("done", "failed") for c in self.chains)
        job.events("model_done", model=label)
        job.progress.note(f"{label} done ({len(points)} variants); {left} model(s) left")

    def _model_failed(self, chain: ModelChain, exc: BaseException) -> None:
        job, label = self.job, chain.plan.label
        cause = first_line(exc)
        chain.state = "failed"
        job.summary.failed.append(f"{label}: {cause}")
        job.events("model_failed", model=label, cause=cause, error=str(exc)[-4000:])
        job.progress.note(f"{label} FAILED: {cause}; the other models go on")

    # -- timeline ----------------------------------------------------------------------

    def _begin(self, unit: str, stage: str, model: str, **labels: Any) -> None:
        self.job.events("begin", unit=unit, stage=stage, model=model, **labels)

    def _drain(self) -> None:
        for s in timeline.drain(self.spans):
            self.job.events("span", **s)

    # -- stopping ----------------------------------------------------------------------

    def _stop(self) -> None:
        """End what is in flight: its MLflow runs KILLED, its tasks cancelled."""
        job = self.job
        self.cut_short = len(self.in_flight)
        for ref, (point, _) in list(self.in_flight.items()):
            run_id = job.run_ids.get(point.key)
            if run_id:  # what cannot be closed now, the next start closes
                with contextlib.suppress(Exception):
                    job.tracker.finish(run_id, "KILLED")
            with contextlib.suppress(Exception):  # an actor's call cannot be force-cancelled
                ray.cancel(ref, force=True)
        self.in_flight.clear()
        self.pool.shrink()

    def status_line(self) -> str:
        """What a stopped job had done, in one line."""
        s = self.job.summary
        left = len(self.queue) + self.cut_short
        waiting = sum(c.state in ("waiting", "preparing") for c in self.chains)
        parts = [f"{s.done} point(s) done this attempt", f"{len(s.failed)} failed"]
        parts.append(f"{left} point(s) stopped or queued")
        if waiting:
            parts.append(f"{waiting} model(s) not yet prepared")
        return ", ".join(parts)
