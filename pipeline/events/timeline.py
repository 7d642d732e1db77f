"""The job's timeline: every unit of work, where it ran and for how long, and what that
says about how busy the cluster was.

Workers report *spans* (stage, model, point, node, worker pid, the slots they held, start
and end) to one small actor per Ray job (`SpanLog`, named after the Ray job id, so workers
on every node find it without a path of the driver); the driver drains it and writes each
span as a `span` event in `events.jsonl`. The driver's own stages (profile, selections in
the driver, the quality gate, registration) are spans of the worker `driver`, holding no
slot. Everything a reader needs is then in the event log: `lorp status`, the dashboard's
timeline page and `benchmarks/fleet.py` all read it through `summarise`.

Figures (`Utilisation`), over one attempt:
- slots: the cluster's slots of the kind the grid uses (GPUs when the grid asks for GPUs,
  else CPUs), from the `cluster` event;
- busy slot-seconds: each span's duration times the slots it held;
- makespan: first span start to last span end (Ray's own start-up is not the schedule's);
- lower bound: max(busy slot-seconds / slots, the longest single-model chain), where a
  model's chain adds, stage after stage, the longest span of each stage (a loss-guided
  selection's steps one after another): no schedule can finish that model sooner;
- utilisation: busy / (slots x makespan).
"""

from __future__ import annotations

import functools
import os
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import ray


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class SpanLog:
    """Collects spans from every worker until the driver drains them."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []

    def add(self, span: dict[str, Any]) -> None:
        self.spans.append(span)

    def drain(self) -> list[dict[str, Any]]:
        out, self.spans = self.spans, []
        return out


def _name() -> str:
    return f"lorp-spans-{ray.get_runtime_context().get_job_id()}"


def start_span_log() -> Any:
    """The driver's span collector for this Ray job (started once, reused)."""
    return SpanLog.options(name=_name(), get_if_exists=True, lifetime=None).remote()


@functools.cache
def _log_handle() -> Any:
    try:
        return ray.get_actor(_name())
    except ValueError:  # no job collects spans (a worker used outside `lorp run`)
        return None


def _held(resources: Mapping[str, float] | None = None) -> dict[str, float]:
    """The slots this worker holds: Ray's assignment for it, CPU and GPU only."""
    if resources is None:
        try:
            resources = ray.get_runtime_context().get_assigned_resources()
        except Exception:  # noqa: BLE001 - outside a worker: no slots
            resources = {}
    return {k: float(v) for k, v in resources.items() if k in ("CPU", "GPU") and v}


def report(stage: str, start: float, end: float, **labels: Any) -> None:
    """Send one finished span of this worker to the job's collector (fire and forget)."""
    handle = _log_handle() if ray.is_initialized() else None
    if handle is None:
        return
    span = {
        "stage": stage,
        "start": start,
        "end": end,
        "node": ray.get_runtime_context().get_node_id()[:8],
        "worker": f"pid {os.getpid()}",
        "slots": _held(),
        **labels,
    }
    handle.add.remote(span)


@contextmanager
def span(stage: str, **labels: Any) -> Iterator[dict[str, Any]]:
    """Time the block as one span of this worker; reported when the block ends, and
    when it fails (with `failed`), so a crash still shows where the time went. The block
    may add labels it learns on the way (a point's peak memory) to the dict it gets."""
    start, ok = time.time(), False
    more: dict[str, Any] = {}
    try:
        yield more
        ok = True
    finally:
        report(stage, start, time.time(), **labels, **more, **({} if ok else {"failed": True}))


def actor_start(submitted: float | None) -> float:
    """When an actor's slot started working for it: its process's start when Ray started
    one for this actor (Python, torch and the model's imports are the stage's cost), but
    never before the driver asked for the actor (a process started idle, earlier, was
    not yet this actor's)."""
    import psutil

    started = psutil.Process().create_time()
    return max(started, submitted) if submitted is not None else time.time()


def drain(log: Any) -> list[dict[str, Any]]:
    """The spans reported since the last drain (none when the collector is gone)."""
    try:
        return ray.get(log.drain.remote(), timeout=30)
    except Exception:  # noqa: BLE001 - a lost collector loses spans, never the job
        return []


def cluster_slots() -> dict[str, float]:
    """Slots of the cluster right now (CPU, GPU)."""
    total = ray.cluster_resources()
    return {k: float(total.get(k, 0.0)) for k in ("CPU", "GPU")}


# -- reading a timeline -------------------------------------------------------------------


@dataclass
class Utilisation:
    kind: str
    """The slot kind counted: CPU or GPU."""
    slots: float
    makespan: float
    busy: float
    """Busy slot-seconds."""
    chain: float
    """The longest single-model chain (s)."""
    chain_model: str
    per_worker: dict[str, float] = field(default_factory=dict)
    """worker (node/pid) -> busy seconds."""
    running: list[dict[str, Any]] = field(default_factory=list)
    """Units of work started and not ended (from `begin` marks without their span)."""

    @property
    def lower_bound(self) -> float:
        return max(self.busy / self.slots if self.slots else 0.0, self.chain)

    @property
    def makespan_ratio(self) -> float:
        return self.makespan / self.lower_bound if self.lower_bound else float("nan")

    @property
    def utilisation(self) -> float:
        denom = self.slots * self.makespan
        return self.busy / denom if denom else float("nan")


def attempt(events: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The events of the latest attempt (from its `start`)."""
    starts = [i for i, e in enumerate(events) if e.get("event") == "start"]
    return list(events[starts[-1] :]) if starts else []


def spans_of(events: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The span events with both times (a span without them is left out)."""
    return [
        dict(e)
        for e in events
        if e.get("event") == "span"
        and isinstance(e.get("start"), int | float)
        and isinstance(e.get("end"), int | float)
    ]


def summarise(events: Sequence[Mapping[str, Any]]) -> Utilisation | None:
    """How busy the latest attempt kept its slots; None before its first span."""
    events = attempt(events)
    spans = spans_of(events)
    if not spans:
        return None
    cluster = next((e for e in events if e.get("event") == "cluster"), {})
    kind = str(cluster.get("kind", "CPU"))
    slots = float((cluster.get("slots") or {}).get(kind, 0.0)) or _guess_slots(spans, kind)
    start = min(s["start"] for s in spans)
    end = max(s["end"] for s in spans)
    busy, per_worker = 0.0, defaultdict(float)
    for s in spans:
        held = float((s.get("slots") or {}).get(kind, 0.0))
        if held:
            busy += held * (s["end"] - s["start"])
            per_worker[f"{s.get('node', '?')}/{s.get('worker', '?')}"] += s["end"] - s["start"]
    chain, chain_model = _longest_chain(spans)
    util = Utilisation(kind, slots, end - start, busy, chain, chain_model, dict(per_worker))
    util.running = running_now(events)
    return util


def running_now(events: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Units of work the driver started (`begin`) and has not seen end (`finish`)."""
    ended = {e.get("unit") for e in events if e.get("event") == "finish"}
    return [dict(e) for e in events if e.get("event") == "begin" and e.get("unit") not in ended]


def _guess_slots(spans: Sequence[Mapping[str, Any]], kind: str) -> float:
    held = {(s.get("node"), s.get("worker")) for s in spans if s.get("slots", {}).get(kind)}
    return float(len(held))


def _longest_chain(spans: Sequence[Mapping[str, Any]]) -> tuple[float, str]:
    """Per model: the longest span of each stage (a selection's scoring steps each count,
    one after another), added up; the largest over models."""
    longest: dict[str, dict[tuple[str, Any], float]] = defaultdict(dict)
    for s in spans:
        model = s.get("model")
        if not model or not s.get("slots"):
            continue
        # one key per stage; a selection's scoring steps, and each worker kind's model
        # load, follow each other, so each is a stage of its own
        key = (s["stage"], s.get("of"), s.get("selection"), s.get("step"))
        longest[model][key] = max(longest[model].get(key, 0.0), s["end"] - s["start"])
    if not longest:
        return 0.0, ""
    totals = {m: sum(stages.values()) for m, stages in longest.items()}
    model = max(totals, key=lambda m: totals[m])
    return totals[model], model
