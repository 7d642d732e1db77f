"""`lorp status RUN_DIR`: how far a job is, from its catalog and events, while it runs or
after it ended. Reads files only: no Ray, no MLflow connection."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.catalog.table import NAME, read_catalog
from pipeline.events.log import read_events


@dataclass
class RunStatus:
    job: str = "?"
    state: str = "not started"
    """running, finished, or interrupted (a start with no end and nothing newer)."""
    planned: int = 0
    done: int = 0
    failed: list[str] = field(default_factory=list)
    rows: int = 0
    speed_pending: int = 0
    """Rows that want speed figures and have not been timed yet."""
    speed_unresolved: int = 0
    """Rows timed whose speed-up was not resolved (`speed_resolved` 0): no figure."""
    per_model: dict[str, int] = field(default_factory=dict)
    repaired: int = 0
    """Catalog rows that are repaired twins (`repair` linear)."""
    pruned: int = 0
    """Catalog rows that are pruned and not repaired."""
    refused: list[str] = field(default_factory=list)
    """Repaired twins planning left out this attempt, with the reason."""
    predicted: str = ""
    """The pruned rows' predicted speed-ups (from the config, not timed), one line."""
    measured: str = ""
    """The pruned rows' resolved prefill speed-ups, and how many resolved, one line."""
    serving: str = ""
    """The pruned rows' vLLM serving speed-ups (output tokens/s over dense), one line."""
    protocols: str = ""
    """The rows' evaluation protocols (and calibration ids), one line: the ids their
    figures are compared under (`pipeline.catalog.protocol`)."""
    places: list[str] = field(default_factory=list)
    """Where the attempt writes: its storage, and the shared catalog it publishes to."""
    last_event: str = ""
    busy: str = ""
    """How busy the attempt kept its slots (`pipeline.events.timeline`), one line."""
    now: list[str] = field(default_factory=list)
    """What runs now: units the driver started and has not seen end."""
    memory: list[str] = field(default_factory=list)
    """Models a stage streams a module at a time (too large for its workers), one line each."""
    waiting: list[str] = field(default_factory=list)
    """Stages waiting for resources no node offers (the driver's `waiting` events that
    nothing of their model has followed yet)."""

    @property
    def left(self) -> int:
        return max(self.planned - self.done - len(self.failed), 0)


def run_status(run_dir: Path) -> RunStatus:
    """Summarise the latest attempt in `run_dir` (an attempt starts at a `start` event)."""
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory not found: {str(run_dir)!r}")
    events = read_events(run_dir / "events.jsonl")
    rows = read_catalog(run_dir / NAME)
    st = RunStatus(rows=len(rows), per_model=dict(Counter(r["model"] for r in rows)))
    pruned = [r for r in rows if r.get("method") != "dense"]
    st.repaired = sum(1 for r in pruned if (r.get("repair") or "none") != "none")
    st.pruned = len(pruned) - st.repaired
    st.predicted = _predicted(pruned)
    st.measured = _measured(pruned)
    st.serving = _serving(pruned)
    st.protocols = _protocols(rows)
    starts = [i for i, e in enumerate(events) if e["event"] == "start"]
    if not starts:
        return st
    attempt = events[starts[-1] :]
    _read_attempt(st, attempt)
    _read_timeline(st, attempt)
    st.speed_pending = sum(1 for r in rows if _no_speed(r))
    st.speed_unresolved = sum(1 for r in rows if _unresolved_speed(r))
    return st


def _read_attempt(st: RunStatus, attempt: list[dict[str, Any]]) -> None:
    st.job = attempt[0].get("job", "?")
    for key, what in (("storage", "storage"), ("catalog", "shared catalog")):
        if attempt[0].get(key):
            st.places.append(f"{what} {attempt[0][key]}")
    st.last_event = f"{attempt[-1]['event']} at {attempt[-1]['time']}"
    for e in attempt:
        if e["event"] == "grid":  # one per model as it is ready
            st.planned += int(e["todo"])
        elif e["event"] == "point":
            st.done += 1
        elif e["event"] == "point_failed":
            st.failed.append(e.get("cause", "?"))
        elif e["event"] == "model_failed":
            st.failed.append(f"{e.get('model', '?')}: {e.get('cause', '?')}")
        elif e["event"] == "memory":
            streamed = {k: v for k, v in (e.get("stages") or {}).items() if v["mode"] == "streamed"}
            if streamed:
                how = ", ".join(
                    f"{k} streamed ({v['batch']} windows per pass)" for k, v in streamed.items()
                )
                st.memory.append(f"{e.get('model', '?')}: {how}")
        elif e["event"] == "repair_refused":
            st.refused.append(
                f"{e.get('model', '?')} {e.get('point', '?')}: {e.get('reason', '?')}"
            )
    # a model that failed while preparing never says how many points it planned: what
    # it ran counts as planned
    points_failed = sum(e["event"] == "point_failed" for e in attempt)
    st.planned = max(st.planned, st.done + points_failed)
    st.state = attempt_state(attempt)


def attempt_state(events: list[dict[str, Any]]) -> str:
    """The state of the latest attempt in a job's `events`: not started, finished,
    running, interrupted, or `running or interrupted` (its driver runs on another host,
    where this one cannot look)."""
    starts = [i for i, e in enumerate(events) if e["event"] == "start"]
    if not starts:
        return "not started"
    attempt = events[starts[-1] :]
    if attempt[-1]["event"] == "end":
        return "finished"
    alive = _driver_alive(attempt[0].get("pid"), attempt[0].get("host"))
    return {True: "running", False: "interrupted", None: "running or interrupted"}[alive]


def _read_timeline(st: RunStatus, attempt: list[dict[str, Any]]) -> None:
    import time

    from pipeline.events.progress import duration
    from pipeline.events.timeline import running_now, summarise

    u = summarise(attempt)
    if u is not None:
        st.busy = (
            f"{u.utilisation:.0%} of {u.slots:g} {u.kind} slot(s) over {duration(u.makespan)}"
            f" ({u.busy / 3600:.2f} busy slot-hours; makespan {u.makespan_ratio:.2f}x its"
            f" lower bound)"
        )
    if st.state not in ("running", "running or interrupted"):
        return
    st.waiting = _still_waiting(attempt)
    for e in running_now(attempt):
        since = _age(e.get("time"), time.time())
        what = " ".join(str(e[k]) for k in ("model", "point") if e.get(k))
        st.now.append(f"{e.get('stage', '?'):8s} {what} (for {duration(since)})")


def _still_waiting(attempt: list[dict[str, Any]]) -> list[str]:
    """The latest `waiting` line of each (stage, model) that no later event of that
    model (a worker's span, a capture, a point, a stage's end) has overtaken, and that
    is not older than twice the interval the driver repeats it at."""
    import time

    waiting: dict[tuple[str, str], str] = {}
    for e in attempt:
        if e["event"] == "waiting" and _age(e.get("time"), time.time()) > 2 * e.get("every", 60):
            continue
        model = e.get("model") or str(e.get("unit", "")).rpartition(":")[2]
        if e["event"] == "waiting":
            waiting[(e.get("stage", "?"), model)] = (
                f"{e.get('stage')} of {model}: {e.get('reason')}"
            )
        elif model:
            waiting = {k: v for k, v in waiting.items() if k[1] != model}
    return list(waiting.values())


def _age(stamp: str | None, now: float) -> float:
    from datetime import datetime

    try:
        return max(now - datetime.fromisoformat(str(stamp)).timestamp(), 0.0)
    except ValueError:
        return 0.0


def _driver_alive(pid: int | None, host: str | None) -> bool | None:
    """Whether the attempt's driver still runs (known only on the driver's own host)."""
    import os
    import socket

    if pid is None or host != socket.gethostname():
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _protocols(rows: list[dict[str, Any]]) -> str:
    """`<protocol> (calibration <id>): n rows` for each protocol among the rows."""
    from pipeline.catalog.protocol import row_protocol

    counts = Counter((row_protocol(r), r.get("calibration_id") or "?") for r in rows)
    return "; ".join(f"{p} (calibration {c}): {n} rows" for (p, c), n in sorted(counts.items()))


def _predicted(pruned: list[dict[str, Any]]) -> str:
    """The range of the pruned rows' predicted speed-ups, prefill and decode."""
    parts = []
    for what in ("prefill", "decode"):
        values = [r[c] for r in pruned if not _missing(r.get(c := f"predicted_{what}_speedup"))]
        if values:
            parts.append(f"{what} {min(values):.2f}-{max(values):.2f}x")
    if not parts:
        return ""
    return (
        f"{', '.join(parts)} over {len(pruned)} variant(s) (predicted from the config, not timed)"
    )


def _measured(pruned: list[dict[str, Any]]) -> str:
    """The range of the pruned rows' resolved prefill speed-ups, and how many resolved."""
    return _resolved_range(pruned, "speedup", "prefill", "timed")


def _serving(pruned: list[dict[str, Any]]) -> str:
    """The range of the pruned rows' resolved serving speed-ups, and how many resolved."""
    return _resolved_range(pruned, "serve_speedup", "output tokens/s", "vLLM")


def _resolved_range(pruned: list[dict[str, Any]], column: str, what: str, how: str) -> str:
    """`what` lo-hi x over dense; r of m resolved (`how`): the rows that measured `column`
    (`<column>_measured`) and those of them that published it; "" when none measured."""
    measured = [r for r in pruned if not _missing(r.get(f"{column}_measured"))]
    if not measured:
        return ""
    values = [r[column] for r in measured if not _missing(r.get(column))]
    span = f"{min(values):.2f}-{max(values):.2f}x" if values else "none resolved"
    return f"{what} {span} over dense; {len(values)} of {len(measured)} resolved ({how})"


def _missing(value: Any) -> bool:
    return value is None or value != value  # None or NaN


def _no_speed(row: dict[str, Any]) -> bool:
    """Awaiting the speed pass: speed wanted, and neither a speed-up nor a latency. A row
    with a latency was timed (its speed-up may be NaN: not resolved)."""
    evaluation = row.get("evaluation") or ""
    wants = '"speed": true' in evaluation and '"enabled": true' in evaluation
    if not wants or row.get("speed_skipped"):  # a streamed model is never timed
        return False
    return _missing(row.get("speedup")) and _missing(row.get("latency_ms"))


def _unresolved_speed(row: dict[str, Any]) -> bool:
    return row.get("speed_resolved") == 0.0


def format_status(st: RunStatus) -> list[str]:
    models = ", ".join(f"{m}: {n}" for m, n in sorted(st.per_model.items()))
    lines = [
        f"job          {st.job} ({st.state}; last: {st.last_event or 'no events'})",
        f"this attempt {st.done} done, {len(st.failed)} failed, {st.left} left "
        f"of {st.planned} to run",
        f"catalog      {st.rows} rows" + (f" ({models})" if st.rows else ""),
    ]
    if st.protocols:
        lines.append(f"protocol     {st.protocols}")
    lines += [f"writes to    {where}" for where in st.places]
    if st.repaired or st.refused:
        lines.append(
            f"repair       {st.repaired} repaired variant(s) beside {st.pruned} pruned"
            + (f"; {len(st.refused)} not repaired" if st.refused else "")
        )
    lines += [f"not repaired {why}" for why in st.refused]
    lines += [f"memory       {what}" for what in st.memory]
    if st.predicted:
        lines.append(f"predicted    {st.predicted}")
    if st.measured:
        lines.append(f"measured     {st.measured}")
    if st.serving:
        lines.append(f"serving      {st.serving}")
    if st.speed_pending:
        lines.append(f"speed        {st.speed_pending} rows await the speed pass")
    if st.speed_unresolved:
        lines.append(f"speed        {st.speed_unresolved} figure(s) not resolved")
    if st.busy:
        lines.append(f"busy         {st.busy}")
    lines += [f"waiting      {what}" for what in st.waiting]
    lines += [f"now          {what}" for what in st.now[:12]]
    if len(st.now) > 12:
        lines.append(f"now          ... and {len(st.now) - 12} more")
    lines += [f"failed       {cause}" for cause in st.failed]
    return lines
