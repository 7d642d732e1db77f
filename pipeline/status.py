"""`lorp status RUN_DIR`: how far a job is, from its catalog and events, while it runs or
after it ended. Reads files only: no Ray, no MLflow connection."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.catalog import read_catalog
from pipeline.records import read_events


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
    per_model: dict[str, int] = field(default_factory=dict)
    repaired: int = 0
    """Catalog rows that are repaired twins (`repair` linear)."""
    pruned: int = 0
    """Catalog rows that are pruned and not repaired."""
    refused: list[str] = field(default_factory=list)
    """Repaired twins planning left out this attempt, with the reason."""
    last_event: str = ""

    @property
    def left(self) -> int:
        return max(self.planned - self.done - len(self.failed), 0)


def run_status(run_dir: Path) -> RunStatus:
    """Summarise the latest attempt in `run_dir` (an attempt starts at a `start` event)."""
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory not found: {str(run_dir)!r}")
    events = read_events(run_dir / "events.jsonl")
    rows = read_catalog(run_dir / "catalog.parquet")
    st = RunStatus(rows=len(rows), per_model=dict(Counter(r["model"] for r in rows)))
    pruned = [r for r in rows if r.get("method") != "dense"]
    st.repaired = sum(1 for r in pruned if (r.get("repair") or "none") != "none")
    st.pruned = len(pruned) - st.repaired
    starts = [i for i, e in enumerate(events) if e["event"] == "start"]
    if not starts:
        return st
    attempt = events[starts[-1] :]
    _read_attempt(st, attempt)
    st.speed_pending = sum(1 for r in rows if _no_speed(r))
    return st


def _read_attempt(st: RunStatus, attempt: list[dict[str, Any]]) -> None:
    st.job = attempt[0].get("job", "?")
    st.last_event = f"{attempt[-1]['event']} at {attempt[-1]['time']}"
    for e in attempt:
        if e["event"] == "grid":
            st.planned = int(e["todo"])
        elif e["event"] == "point":
            st.done += 1
        elif e["event"] == "point_failed":
            st.failed.append(e.get("cause", "?"))
        elif e["event"] == "repair_refused":
            st.refused.append(
                f"{e.get('model', '?')} {e.get('point', '?')}: {e.get('reason', '?')}"
            )
    if attempt[-1]["event"] == "end":
        st.state = "finished"
    else:
        alive = _driver_alive(attempt[0].get("pid"), attempt[0].get("host"))
        st.state = {True: "running", False: "interrupted", None: "running or interrupted"}[alive]


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


def _no_speed(row: dict[str, Any]) -> bool:
    value = row.get("speedup")
    evaluation = row.get("evaluation") or ""
    wants = '"speed": true' in evaluation and '"enabled": true' in evaluation
    return wants and (value is None or value != value)


def format_status(st: RunStatus) -> list[str]:
    models = ", ".join(f"{m}: {n}" for m, n in sorted(st.per_model.items()))
    lines = [
        f"job          {st.job} ({st.state}; last: {st.last_event or 'no events'})",
        f"this attempt {st.done} done, {len(st.failed)} failed, {st.left} left "
        f"of {st.planned} to run",
        f"catalog      {st.rows} rows" + (f" ({models})" if st.rows else ""),
    ]
    if st.repaired or st.refused:
        lines.append(
            f"repair       {st.repaired} repaired variant(s) beside {st.pruned} pruned"
            + (f"; {len(st.refused)} not repaired" if st.refused else "")
        )
    lines += [f"not repaired {why}" for why in st.refused]
    if st.speed_pending:
        lines.append(f"speed        {st.speed_pending} rows await the speed pass")
    lines += [f"failed       {cause}" for cause in st.failed]
    return lines
