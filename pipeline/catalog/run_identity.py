"""A job's identity in the shared catalog: its name, its storage and a run id minted at its
first start and kept in that storage (`lorp_run.json`), so that a rerun, a resume on
another machine or a move of the driver keeps it, and nothing else ever has it.

A path alone never identifies a job: two containers whose jobs write to the same default
path on disks of their own mint two ids, and two teams' jobs of one name are two jobs.
Their rows live side by side in the shared catalog, each under its own run id.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from pipeline.storage import s3_conditional
from pipeline.storage.store import Storage

RUN_FILE = "lorp_run.json"
LEGACY_PREFIX = "legacy:"
"""The run id of rows migrated from the catalog format before Delta (`legacy:<job>`): the
first publish of that job (same name, same storage) takes them over."""


def run_identity(storage: Storage, job: str) -> str:
    """The run id kept in `storage`, minted on the first start (uuid4). Two drivers that
    start on one storage at once agree on the first one written: it is created only
    where absent, by a link on a filesystem and a conditional PUT on S3 (on GCS and Azure
    the last written wins, and a driver that read the other's id before it was replaced
    would publish under it: start one driver per storage there)."""
    found = _read(storage)
    if found is not None:
        return found
    record = {"run_id": uuid.uuid4().hex, "job": job, "created_at": time.time()}
    data = json.dumps(record, indent=1).encode()
    local = storage.local_path(RUN_FILE)
    if local is not None:
        _create_exclusive(local, data)
    elif s3_conditional.is_s3(storage.location):
        s3_conditional.put_if_absent(storage.location, RUN_FILE, data)
    else:  # gs://, az://: the last written wins; both drivers read it back below
        storage.write_bytes(RUN_FILE, data)
    found = _read(storage)
    if found is None:  # noqa: S101 (written just now; a store that loses it is broken)
        raise OSError(f"{storage.uri(RUN_FILE)}: written, then not found")
    return found


def _read(storage: Storage) -> str | None:
    data = storage.read_bytes(RUN_FILE)
    if data is None:
        return None
    try:
        record: dict[str, Any] = json.loads(data)
        return str(record["run_id"])
    except (ValueError, KeyError, TypeError):
        raise ValueError(
            f"{storage.uri(RUN_FILE)} is not a lorp run record (a run id minted at the "
            "job's first start); restore it, or remove it to give this storage a new identity"
        ) from None


def _create_exclusive(path: Path, data: bytes) -> None:
    """`data` at `path` unless a file is there already: written aside, then linked (a
    link never replaces), so a reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    tmp.write_bytes(data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
