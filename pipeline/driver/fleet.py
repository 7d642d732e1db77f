"""The fleet scheduler: every model's stages in flight at once, on one driver loop.

A model is a chain of stages: calibration shards -> capture and reduce (S) -> profile ->
selections (loss-guided ones on evaluator actors) -> repair sums -> grid points -> speed
-> quality gate -> registry. The driver runs up to `resources.max_models_in_flight`
chains at once (default: all of them):

- a model's preparation (everything up to its grid points, `pipeline.driver.model_stages`) runs in a
  driver thread of its own, which mostly waits on Ray; it hands over what is ready
  through the model's inbox;
- the driver's loop owns every grid point and speed task as a Ray future: it submits a
  prepared model's points as slots allow (`max_concurrent_points` in flight, earlier
  models first, and a few more queued in Ray where the slots bind, so a freed slot
  starts the next point without waiting for the driver), has each point recorded as
  it ends, starts a model's speed task the moment its last point ends, then has that
  model gated and registered, so model A's
  registry, model B's points and model C's capture overlap;
- a model whose preparation fails (bad checkpoint, a stage out of retries) is recorded
  with its reason; the points it had handed over still run, and the model still gets
  its speed, gate and registry for what finished; the other models go on;
- Ray queues what the cluster cannot yet hold. Nothing holds a slot while it waits for
  another model's work: capture and loss workers take shards and candidates only once
  started, and idle vLLM evaluators go whenever no point is queued. A stage that waits
  for resources no node offers is said once a minute (`WAITING_NOTE_S`).

Every record goes through the recorder (`pipeline.driver.recorder`); this module only schedules.
`max_models_in_flight: 1` runs one model's chain after the other: the serial baseline
`benchmarks/fleet.py` compares against. A stop (SIGTERM, Ctrl-C) ends the points in
flight as KILLED and leaves what a rerun resumes.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

import ray

from pipeline.cluster.nodes import alive_nodes, request, unmet
from pipeline.driver.model_stages import PreparedModel, Preparer, Stage
from pipeline.driver.recorder import Recorder
from pipeline.driver.tasks import TaskMaker
from pipeline.events import timeline
from pipeline.plan.grid import GridPoint, ModelPlan
from pipeline.stages.pools import make_pool
from pipeline.stages.speed_pass import run_speed

POLL_S = 0.25
"""How long the loop waits on Ray before it looks at the model threads again."""
SLOTS_REFRESH_S = 5.0
"""How often the loop reads the cluster's slots again (`Fleet._queued_ahead`)."""
WAITING_NOTE_S = float(os.environ.get("LORP_WAITING_NOTE_S", "60"))
"""How often a stage waiting for resources no node offers is said."""


class Stopped(Exception):
    """The driver was told to stop (SIGTERM, SIGINT): raised on its thread."""

    def __init__(self, signum: int) -> None:
        import signal

        self.signum = signum
        self.name = signal.Signals(signum).name
        self.summary = ""
        """What the stopped job had done, in one line (`Fleet.status_line`)."""
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
    """What the model's thread made ready, in order (`pipeline.driver.model_stages.Emit`)."""
    prepared: bool = False
    """Its records are made (parent run, facts): its points can be recorded."""
    points: list[GridPoint] = field(default_factory=list)
    """Every point of the model: those handed over, then all of them once prepared."""
    running: int = 0
    """Its points in flight or queued."""
    stage: Stage | None = None
    """The stage its preparation (or its speed task) is in, with what it asks for."""
    cancel: threading.Event = field(default_factory=threading.Event)
    """Set when the model fails: its preparation ends at its next stage."""
    failed: bool = False
    state: str = "waiting"
    """waiting, preparing, points, speed, done."""


def _in_thread(fn: Callable[[], Any], future: Future[Any], name: str) -> None:
    def target() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - delivered to the driver's loop
            future.set_exception(exc)

    threading.Thread(target=target, name=name, daemon=True).start()


class Fleet:
    """Runs every model's chain of the job; `run()` returns when all have ended."""

    def __init__(
        self, tasks: TaskMaker, preparer: Preparer, recorder: Recorder, plans: list[ModelPlan]
    ) -> None:
        """`tasks`: the job's settings every task is built from (its storage location,
        which every task writes to, its resources and evaluation, its backend)."""
        self.tasks, self.backend = tasks, tasks.backend
        self.preparer, self.recorder = preparer, recorder
        res = tasks.resources
        self.max_models = res.max_models_in_flight or len(plans)
        self.capacity = max(1, res.max_concurrent_points)
        self.chains = [ModelChain(i, p) for i, p in enumerate(plans)]
        self.queue: list[tuple[int, int, GridPoint]] = []
        self.seq = 0
        self.pool = make_pool(self.backend, self.capacity, res.grid)
        self.repair_refs: dict[tuple[str, Any], Any] = {}
        self.in_flight: dict[Any, tuple[GridPoint, ModelChain]] = {}
        self.speeds: dict[Any, ModelChain] = {}
        self.spans = timeline.start_span_log()
        self.driver_s = 0.0
        """The driver's own time recording points (MLflow, catalog, events)."""
        self.recorded = 0
        self.cut_short = 0
        """Points in flight when the driver was stopped."""
        self.stop_requested = 0
        """The signal that asked the driver to stop (set by `pipeline.driver.run.stop_signals`)."""
        self.last_waiting_note = time.monotonic()
        self.slots: tuple[float, float] | None = None
        """(read at, the cluster's slots of the grid's kind): `_queued_ahead`."""

    # -- the loop ----------------------------------------------------------------------

    def run(self) -> None:
        self.recorder.progress.fleet(len(self.chains), self.max_models, self.capacity)
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
                    self._say_waiting()
                    last_drain = time.monotonic()
        except (Stopped, KeyboardInterrupt):
            self._stop()
            raise
        finally:
            self._drain()
        self.recorder.fleet(len(self.chains), self.recorded, self.driver_s)

    def _pending(self) -> bool:
        """Work left: a model not ended, or points still queued or running."""
        ended = all(c.state == "done" for c in self.chains)
        return not ended or bool(self.queue or self.in_flight or self.speeds)

    def _start_models(self) -> None:
        active = sum(c.state in ("preparing", "points", "speed") for c in self.chains)
        for chain in self.chains:
            if active >= self.max_models:
                return
            if chain.state != "waiting":
                continue
            chain.state, active = "preparing", active + 1
            label = chain.plan.label
            self.recorder.begin(f"prepare:{label}", "prepare", label)
            _in_thread(
                lambda c=chain: self.preparer.prepare(
                    c.plan, self.backend, lambda kind, what: c.inbox.put((kind, what)), c.cancel
                ),
                chain.future,
                f"lorp-prepare-{label}",
            )

    def _harvest(self) -> None:
        """What the model threads have made ready: a model's records, then its points
        into the queue as they come (a point starts while its model's slower selections
        go on); a model whose preparation ended is ready for its last stages."""
        for chain in self.chains:
            if chain.state != "preparing":
                continue
            self._read_inbox(chain)
            if chain.state != "preparing" or not chain.future.done():
                continue
            if not chain.inbox.empty():
                continue  # the thread's last words first
            self._prepared(chain)

    def _read_inbox(self, chain: ModelChain) -> None:
        while not chain.inbox.empty():
            kind, what = chain.inbox.get()
            if kind == "stage":
                chain.stage = what
            elif kind == "prepared":
                try:
                    prep: PreparedModel = what
                    self.recorder.model_prepared(prep.plan, prep.stats, prep.profile, prep.key)
                except Exception as exc:  # noqa: BLE001 - this model fails, the fleet goes on
                    self._model_failed(chain, exc)
                    return
                chain.prepared = True
            elif kind == "done":
                chain.points.extend(what)  # in the catalog already: gated, registered
                self.recorder.skipped(what)
            else:
                points, refs = what
                self.repair_refs.update(refs)
                self._enqueue(chain, points)

    def _prepared(self, chain: ModelChain) -> None:
        """The model's preparation ended: its points are all known, or it failed."""
        label = chain.plan.label
        self.recorder.finish(f"prepare:{label}")
        chain.stage = None
        try:
            prep = chain.future.result()
        except Exception as exc:  # noqa: BLE001 - this model fails, the fleet goes on
            self._model_failed(chain, exc)
            return
        chain.points, chain.state = prep.points, "points"
        left = sum(c.state in ("waiting", "preparing") for c in self.chains)
        self.recorder.model_ready(label, len(prep.points), len(prep.pending), prep.skipped, left)

    def _enqueue(self, chain: ModelChain, points: list[GridPoint]) -> None:
        for p in points:
            heapq.heappush(self.queue, (chain.index, self.seq, p))
            self.seq += 1
        chain.points.extend(points)
        chain.running += len(points)
        self.recorder.progress.grow(len(points))

    def _submit(self) -> None:
        window = self.capacity + self._queued_ahead()
        while self.queue and len(self.in_flight) < window:
            index, _, point = heapq.heappop(self.queue)
            chain = self.chains[index]
            start = time.perf_counter()
            self.recorder.point_started(point)
            task = self.tasks.point(point, self.repair_refs)
            self.in_flight[self.pool.submit(task)] = (point, chain)
            self.driver_s += time.perf_counter() - start
        if not self.queue:
            self.pool.shrink()  # idle evaluators give their slots to other models' stages

    def _queued_ahead(self) -> int:
        """Points Ray may hold queued beyond those it can run (half `max_concurrent_points`),
        where the cluster's slots, not `max_concurrent_points`, bound how many run: a slot
        that frees starts the next point at once, not after the driver has seen the last
        one end and recorded it (a second on a busy driver, longer than a small point).
        None on vLLM evaluators (each point there starts an actor) or where the cap binds
        (more in flight would run more at once than the spec allows)."""
        if self.backend == "vllm":
            return 0
        grid = self.tasks.resources.grid
        kind, per_point = ("GPU", grid.num_gpus) if grid.num_gpus > 0 else ("CPU", grid.num_cpus)
        now = time.monotonic()
        if self.slots is None or now - self.slots[0] > SLOTS_REFRESH_S:
            self.slots = (now, timeline.cluster_slots()[kind])  # an autoscaler changes them
        slots = self.slots[1]
        if per_point <= 0 or self.capacity * per_point < slots:
            return 0
        return max(1, self.capacity // 2)

    def _wait(self) -> None:
        refs = [*self.in_flight, *self.speeds]
        if not refs:
            preparing = [c.future for c in self.chains if c.state == "preparing"]
            if preparing:
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
        point, chain = self.in_flight.pop(ref)
        self.pool.release(ref)
        chain.running -= 1
        start = time.perf_counter()
        try:
            result = ray.get(ref)
        except Exception as exc:  # failed after its retries: recorded, the grid goes on
            self.recorder.point_failed(point, exc)
        else:
            self.recorder.point_done(point, result, self.backend)
            self.recorded += 1
        self.driver_s += time.perf_counter() - start

    # -- a model's last stages ---------------------------------------------------------

    def _finish_models(self) -> None:
        """Models whose points have all ended: speed task, else gate and registry."""
        ev = self.tasks.evaluation
        whole_node = ev.enabled and ev.speed and self.tasks.resources.speed is None
        for chain in self.chains:
            if chain.state != "points" or chain.running:
                continue
            if whole_node and self.queue:
                # A whole-node request queued in Ray holds back the slots it waits for:
                # on a small cluster the points left would run one at a time. It goes
                # once no point waits for a slot.
                continue
            timed = self.recorder.unmeasured(chain.points) if chain.prepared else []
            if timed:
                self._start_speed(chain, timed)
            else:
                self._close_model(chain)

    def _start_speed(self, chain: ModelChain, points: list[GridPoint]) -> None:
        task = self.tasks.speed(points)
        res = task.resources
        ref = run_speed.options(num_cpus=res.num_cpus, num_gpus=res.num_gpus).remote(task)
        self.speeds[ref] = chain
        chain.state, chain.stage = "speed", Stage("speed", res)
        label = chain.plan.label
        self.recorder.begin(f"speed:{label}", "speed", label)
        self.recorder.progress.note(f"speed {label}: {len(task.variants)} variants queued")

    def _speed_ended(self, ref: Any) -> None:
        chain = self.speeds.pop(ref)
        label = chain.plan.label
        self.recorder.finish(f"speed:{label}")
        try:
            figures = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - speed is a figure, not the variant
            self.recorder.speed_failed(label, exc)
        else:
            self.recorder.speed_done(label, figures)
        self._close_model(chain)

    def _close_model(self, chain: ModelChain) -> None:
        """The model's last records on the driver: twins' speed, gate, registry (for a
        failed model, over the points that finished)."""
        chain.state, chain.stage = "done", None
        if not chain.prepared or (chain.failed and not chain.points):
            return  # nothing of it was recorded, or nothing to gate
        left = sum(c.state != "done" for c in self.chains)
        self.recorder.model_closed(chain.plan, chain.points, left)

    def _model_failed(self, chain: ModelChain, exc: BaseException) -> None:
        """Its preparation, or recording what it made ready, failed: recorded, the
        preparation told to end; the points it handed over go on, and the model closes
        like any other once they have ended."""
        chain.cancel.set()
        chain.failed, chain.stage, chain.state = True, None, "points"
        self.recorder.model_failed(chain.plan.label, exc)

    # -- what the driver says ----------------------------------------------------------

    def _drain(self) -> None:
        self.recorder.spans(timeline.drain(self.spans))

    def _say_waiting(self) -> None:
        """Once a minute: every stage in flight that asks for resources no node of the
        cluster offers (an autoscaler may still bring one; until then nothing moves)."""
        if time.monotonic() - self.last_waiting_note < WAITING_NOTE_S:
            return
        self.last_waiting_note = time.monotonic()
        try:
            nodes = alive_nodes()
        except Exception:  # noqa: BLE001 - a word about waiting never stops the job
            return
        for stage, model in self._stages_in_flight():
            need = request(stage.need) if stage.need is not None else {}
            why = unmet(need, nodes) if need else None
            if why is not None:
                self.recorder.waiting(stage.name, model, need, why, WAITING_NOTE_S)

    def _stages_in_flight(self) -> list[tuple[Stage, str]]:
        """(stage, model) of every preparation and speed task, and the points in flight."""
        out = [
            (c.stage, c.plan.label)
            for c in self.chains
            if c.state in ("preparing", "speed") and c.stage is not None
        ]
        models = dict.fromkeys(chain.plan.label for _, chain in self.in_flight.values())
        return out + [(Stage("points", self.tasks.resources.grid), m) for m in models]

    # -- stopping ----------------------------------------------------------------------

    def _stop(self) -> None:
        """End what is in flight: its MLflow runs KILLED, its tasks cancelled, the
        preparations told to end at their next stage."""
        self.preparer.stopping.set()
        for chain in self.chains:
            chain.cancel.set()
        self.cut_short = len(self.in_flight)
        self.recorder.killed(point for point, _ in self.in_flight.values())
        for ref in list(self.in_flight):
            with contextlib.suppress(Exception):  # an actor's call cannot be force-cancelled
                ray.cancel(ref, force=True)
        self.in_flight.clear()
        self.pool.shrink()

    def status_line(self) -> str:
        """What a stopped job had done, in one line."""
        s = self.recorder.summary
        left = len(self.queue) + self.cut_short
        waiting = sum(c.state in ("waiting", "preparing") for c in self.chains)
        parts = [f"{s.done} point(s) done this attempt", f"{len(s.failed)} failed"]
        parts.append(f"{left} point(s) stopped or queued")
        if waiting:
            parts.append(f"{waiting} model(s) not yet prepared")
        return ", ".join(parts)
