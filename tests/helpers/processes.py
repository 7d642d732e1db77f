"""Stop a process and everything it started, by process id: never by name and never
`ray stop`, which stops every Ray on the machine, another job's or a developer's too."""

from __future__ import annotations

import os
import signal
import time
from collections import defaultdict
from contextlib import suppress
from pathlib import Path


def _table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, session id) of every live (not zombie) process."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if fields[0] != "Z":  # state, ppid, pgrp, session
            out[int(entry.name)] = (int(fields[1]), int(fields[3]))
    return out


def started_by(leader: int) -> set[int]:
    """`leader` (started with `start_new_session=True`) and every live process it started:
    its descendants, and what is left in its session after a parent died (orphans are
    re-parented to init, but keep the session; Ray's daemons change group, not session)."""
    table = _table()
    children: dict[int, set[int]] = defaultdict(set)
    for pid, (ppid, _) in table.items():
        children[ppid].add(pid)
    found: set[int] = set()
    todo = [leader, *(pid for pid, (_, session) in table.items() if session == leader)]
    while todo:
        pid = todo.pop()
        if pid in table and pid not in found:
            found.add(pid)
            todo.extend(children[pid])
    return found - {os.getpid()}


def kill_started_by(leader: int, timeout: float = 30.0) -> None:
    """SIGKILL `leader` and everything it started, until none of them is left."""
    deadline = time.monotonic() + timeout
    while pids := started_by(leader):
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise AssertionError(f"still alive after SIGKILL: {sorted(pids)}")
        time.sleep(0.2)
