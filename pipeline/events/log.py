"""The job's event log: append-only JSON lines in the run directory (`events.jsonl`), what
the job did and when, mirrored to its storage; and reading it back."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from pipeline.catalog.row import now
from pipeline.storage.store import Storage

NAME = "events.jsonl"
"""The log's file, in the run directory and in the job's storage."""


class EventLog:
    """Append-only JSON lines in the run directory: what this job did, and when.

    With a `mirror` (the job's storage, when it is not the run directory) the storage's
    log replaces the local one at the start and the whole file is copied back after each
    event, except the frequent `losses` batches, which travel with the next one."""

    NAME = NAME
    UNSYNCED = frozenset({"losses", "span", "begin", "finish"})

    def __init__(self, path: Path, mirror: Storage | None = None) -> None:
        self.path, self.mirror = path, mirror
        self.lock = threading.Lock()  # the fleet's model threads and the driver write here
        path.parent.mkdir(parents=True, exist_ok=True)
        if mirror is not None:
            mirror.get_file(self.NAME, path)

    def __call__(self, event: str, **data: Any) -> None:
        record = {"time": now(), "event": event, **data}
        line = json.dumps(record, default=str) + "\n"
        with self.lock:
            with open(self.path, "a") as fh:
                fh.write(line)
            if self.mirror is not None and event not in self.UNSYNCED:
                self.mirror.put_file(self.path, self.NAME)

    def read(self) -> list[dict[str, Any]]:
        return read_events(self.path)


def read_events(path: Path) -> list[dict[str, Any]]:
    return parse_events(path.read_text()) if path.is_file() else []


def parse_events(text: str) -> list[dict[str, Any]]:
    """The events of an event log's text (a line cut by a killed writer left out)."""
    events = []
    for line in text.splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events
