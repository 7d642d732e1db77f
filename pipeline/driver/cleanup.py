"""`lorp gc`: the variant directories of a job's storage that no catalog row references,
found (a dry run, the default) or removed.

A variant directory is `checkpoints/<model>/<point>` below the storage (a manifest or a
full copy), or a copy its writer never finished (a `.partial` directory, or on an object
store a prefix without its completion marker). One is referenced when a row of the job's
own catalog, or of any shared catalog named, holds it as its `checkpoint`: the rows of
every job that wrote there, whatever its name. Registered versions point at what rows
reference, so they keep their files too. A variant written out for serving
(`materialized/<model>/best-<budget>`, `tracking.materialize`) is kept while the variant
it was written from is referenced (or lies in another storage, which this one cannot
judge); one without its marker is a copy its writer never finished. A complete stored
base (`bases/`, `pipeline.storage.bases`) is never removed: any variant, of any storage, may
name one; a copy a killed job never finished is.

Nothing of a job that may be running is removed: its storage's event log says whether its
latest attempt ended; a driver on another host, which this one cannot look at, counts as
running. A storage without a catalog, or a shared catalog that cannot be read, stops the
collection: what is in use there is unknown, so nothing goes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.catalog.shared import SharedCatalog, open_catalog
from pipeline.events.log import NAME as EVENTS
from pipeline.events.log import parse_events
from pipeline.events.status import attempt_state
from pipeline.plan.grid import CHECKPOINTS
from pipeline.storage.bases import BASES
from pipeline.storage.store import Storage
from pipeline.tracking.materialized import MATERIALIZED, materialized_source


@dataclass
class Garbage:
    """What `find_garbage` found in one storage."""

    storage: Storage
    referenced: int = 0
    """Variant directories a catalog row references (kept)."""
    unreferenced: list[tuple[str, int]] = field(default_factory=list)
    """(directory below the storage, bytes) of each one no row references."""
    running: str | None = None
    """Why nothing may go: a job that may be running writes there."""

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.unreferenced)


def find_garbage(location: str, catalogs: Sequence[str] = ()) -> Garbage:
    """The variant directories of the storage at `location` that neither its own catalog
    nor any of `catalogs` (shared catalogs) references. Reads only."""
    storage = Storage(location)
    found = Garbage(storage)
    state = _job_state(storage)
    if state in ("running", "running or interrupted"):
        found.running = state
        return found
    models = storage.subdirs(CHECKPOINTS)
    written_out = storage.subdirs(MATERIALIZED)
    for base in storage.subdirs(BASES):  # a copy a killed job left unfinished; never a whole one
        rel = f"{BASES}/{base}"
        if base.startswith(".") or not storage.complete(rel):
            found.unreferenced.append((rel, storage.tree_bytes(rel)))
    if not (models or written_out):
        return found
    keep = _referenced(storage, catalogs)
    for model in models:
        for point in storage.subdirs(f"{CHECKPOINTS}/{model}"):
            rel = f"{CHECKPOINTS}/{model}/{point}"
            if rel in keep and not point.startswith("."):
                found.referenced += 1
            else:
                found.unreferenced.append((rel, storage.tree_bytes(rel)))
    for model in written_out:  # `tracking.materialize`: kept while their variant is
        for alias in storage.subdirs(f"{MATERIALIZED}/{model}"):
            rel = f"{MATERIALIZED}/{model}/{alias}"
            whole = not alias.startswith(".") and storage.complete(rel)
            source = materialized_source(storage, rel) if whole else None
            origin = storage.rel_of(source) if source is not None else ""
            if source is not None and (origin is None or origin in keep):  # None: elsewhere
                found.referenced += 1
            else:
                found.unreferenced.append((rel, storage.tree_bytes(rel)))
    return found


def remove(found: Garbage) -> int:
    """Remove what `find_garbage` found; the bytes freed."""
    if found.running:
        return 0
    for rel, _ in found.unreferenced:
        found.storage.delete_dir(rel)
    return found.bytes


def _job_state(storage: Storage) -> str:
    data = storage.read_bytes(EVENTS)
    return attempt_state(parse_events(data.decode())) if data is not None else "not started"


def _referenced(storage: Storage, catalogs: Sequence[str]) -> set[str]:
    """Every directory below `storage` a row of its own catalog or of `catalogs` names."""
    try:
        rows: list[dict[str, Any]] = open_catalog(storage.location)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no catalog at {storage.uri()!r}: nothing says which of its variants are in "
            "use, so none is removed (give a job's storage, where its catalog is)"
        ) from None
    for location in catalogs:
        rows += SharedCatalog(location).read()  # unreadable: an error, nothing removed
    return {rel for r in rows if r.get("checkpoint") and (rel := storage.rel_of(r["checkpoint"]))}
