"""The shared catalog's format before Delta Lake, read for migration only
(`SharedCatalog.migrate`, `lorp catalog migrate`):

    jobs/<job>.parquet                 a job's rows, folded (replaced whole)
    parts/<job>~<time>-<pid>-<n>.json  its changes since (one `put` or `update` each)

Nothing writes it any more. A reader folds each job's snapshot and parts, and reads the
snapshots again after the parts: one that changed meanwhile (an older lorp compacting
under it) starts the read over.
"""

from __future__ import annotations

import time
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.catalog.table import apply_parts, parse_part
from pipeline.storage.store import Storage

JOBS, PARTS = "jobs", "parts"
SEP = "~"
READ_TIMEOUT_S = 60.0


def is_legacy(storage: Storage) -> bool:
    """Whether `storage` holds a catalog in the format before Delta."""
    return bool(storage.list(JOBS) or storage.list(PARTS))


def read_legacy(storage: Storage) -> list[dict[str, Any]]:
    """Every job's rows, folded (see the module docstring)."""
    deadline = time.monotonic() + READ_TIMEOUT_S
    while True:
        before = _snapshots(storage)
        parts = _parts(storage)
        if _snapshots(storage) == before:
            return _fold(before, parts)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{storage.uri()}: the catalog kept changing while it was read")
        time.sleep(0.1)


def _snapshots(storage: Storage) -> dict[str, bytes]:
    out = {}
    for name in storage.list(JOBS):
        if name.endswith(".parquet"):
            data = storage.read_bytes(f"{JOBS}/{name}")
            if data is not None:
                out[name.removesuffix(".parquet")] = data
    return out


def _parts(storage: Storage) -> dict[str, list[dict[str, Any]]]:
    parts: dict[str, list[dict[str, Any]]] = {}
    for name in sorted(n for n in storage.list(PARTS) if n.endswith(".json")):
        data = storage.read_bytes(f"{PARTS}/{name}")
        part = None if data is None else parse_part(data, storage.uri(f"{PARTS}/{name}"))
        if part is not None:
            parts.setdefault(name.split(SEP, 1)[0], []).append(part)
    return parts


def _fold(
    snapshots: dict[str, bytes], parts: dict[str, list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for job in sorted(set(snapshots) | set(parts)):
        data = snapshots.get(job)
        base = pq.read_table(pa.BufferReader(data)).to_pylist() if data is not None else []
        rows.extend(apply_parts(base, parts.get(job, [])))
    return rows
