"""The organisation's shared catalog: every job's rows in one place (`catalog:` in a job
spec), written by many jobs at once, read folded.

Layout, in any storage (`pipeline.storage`: a directory, a shared mount, `s3://...`):

    jobs/<job>.parquet               the job's rows, folded (replaced whole, atomically)
    parts/<job>~<time>-<pid>-<n>.json the job's changes since (one `put` or `update` each)

Each job writes only its own names, so jobs never contend: no lock, no row lost, none
doubled. A job publishes every change of its own catalog as a part at once
(`pipeline.records.catalog.Catalog`), and at its start and end replaces its snapshot
with all its rows and then deletes the parts the snapshot holds: a rerun replaces that
job's rows and no one else's. A reader folds each job's snapshot and parts; it reads
every snapshot again after the parts, and starts over when one changed meanwhile (a
job compacted under it), so it never misses the parts a compaction folded away.

Rows are identified by (job, grid key); two jobs that measured the same point both keep
their row (each with its checkpoint and run). The job name is a job's identity here, as
it is in MLflow's experiments.

`open_catalog` reads any catalog by location: a catalog file, a job's run directory or
storage, or a shared catalog.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.records.catalog import (
    NAME,
    PARTS,
    apply_parts,
    parse_part,
    read_catalog,
    to_table,
)
from pipeline.records.protocol import row_protocol
from pipeline.storage import Storage, is_remote

JOBS, SHARED_PARTS = "jobs", "parts"
SEP = "~"
"""Between a part's job name and its own name; job names cannot hold it."""
READ_TIMEOUT_S = 60.0
"""How long a read keeps trying while compactions overtake it (jobs compact at their
start and end, so a real catalog settles in far less)."""
ERROR_RETRY_S = 3.0
"""How long a read keeps trying after the store's first error (pyarrow has retried each
call already: an unreachable S3 endpoint takes about 6 s a call to refuse)."""
CHECK_RETRY_S = 30.0
"""How often a job whose shared catalog was unreachable checks it again (`JobPublisher`)."""


class SharedCatalog:
    """One shared catalog location (layout and rules: the module docstring)."""

    def __init__(self, location: str | Storage) -> None:
        self.storage = location if isinstance(location, Storage) else Storage(location)

    def uri(self) -> str:
        return self.storage.uri()

    # -- one job's writes --------------------------------------------------------------

    def put_part(self, job: str, name: str, data: bytes) -> None:
        """One change of `job`'s rows (a part of its own catalog, same bytes)."""
        self.storage.write_bytes(f"{SHARED_PARTS}/{job}{SEP}{name}", data)

    def replace_rows(self, job: str, rows: Iterable[Mapping[str, Any]]) -> int:
        """`job`'s rows, whole: its snapshot replaced, then the parts it folds deleted
        (only the ones listed before the snapshot was written). Returns the row count."""
        mine = [dict(r) for r in rows if r.get("job") == job]
        done = self._part_names(job)
        with self.storage.writer(f"{JOBS}/{job}.parquet") as fh:
            pq.write_table(to_table(mine), fh)
        for name in done:
            self.storage.delete(f"{SHARED_PARTS}/{name}")
        return len(mine)

    def _part_names(self, job: str | None = None) -> list[str]:
        names = [n for n in self.storage.list(SHARED_PARTS) if n.endswith(".json")]
        return [n for n in names if job is None or n.split(SEP, 1)[0] == job]

    # -- reading -----------------------------------------------------------------------

    def _snapshots(self) -> dict[str, bytes]:
        out = {}
        for name in self.storage.list(JOBS):
            if name.endswith(".parquet"):
                data = self.storage.read_bytes(f"{JOBS}/{name}")
                if data is not None:
                    out[name.removesuffix(".parquet")] = data
        return out

    def read(self) -> list[dict[str, Any]]:
        """Every job's rows, folded (see the module docstring). A read that a compaction
        overtook is tried again for up to `READ_TIMEOUT_S`; one that failed (an object
        store's transient error) for up to `ERROR_RETRY_S`, then its error is raised."""
        deadline = time.monotonic() + READ_TIMEOUT_S
        attempt, error, first_error = 0, None, None
        while True:
            try:
                before, parts = self._snapshots(), self._parts()
                if self._snapshots() == before:
                    return self._fold(before, parts)
                error = None
            except OSError as exc:
                error, first_error = exc, first_error or time.monotonic()
            now = time.monotonic()
            if now > deadline or (error is not None and now > first_error + ERROR_RETRY_S):
                break
            attempt += 1
            time.sleep(min(0.05 * attempt, 0.5))
        if error is not None:
            raise error
        raise RuntimeError(f"{self.uri()}: the catalog kept changing while it was read")

    def _parts(self) -> dict[str, list[dict[str, Any]]]:
        """job -> its parts, in order."""
        parts: dict[str, list[dict[str, Any]]] = {}
        for name in sorted(self._part_names()):
            try:
                data = self.storage.read_bytes(f"{SHARED_PARTS}/{name}")
            except OSError:  # an object store cut the read of a part deleted under it
                if name in self._part_names():
                    raise
                data = None
            if data is None:  # folded away meanwhile: the snapshot check sees it
                continue
            part = parse_part(data, self.storage.uri(f"{SHARED_PARTS}/{name}"))
            if part is not None:
                parts.setdefault(name.split(SEP, 1)[0], []).append(part)
        return parts

    @staticmethod
    def _fold(
        snapshots: dict[str, bytes], parts: dict[str, list[dict[str, Any]]]
    ) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for job in sorted(set(snapshots) | set(parts)):
            data = snapshots.get(job)
            base = pq.read_table(pa.BufferReader(data)).to_pylist() if data is not None else []
            rows.extend(apply_parts(base, parts.get(job, [])))
        return rows

    def rows_of(self, job: str) -> list[dict[str, Any]]:
        """`job`'s rows in the shared catalog, folded."""
        return [r for r in self.read() if r.get("job") == job]

    def check_owner(self, job: str, storage: str, own: Iterable[Mapping[str, Any]]) -> None:
        """Refuse (one line) to publish as `job` when the shared catalog holds rows of a
        job of that name that this job does not know: another team's job of the same
        name, writing to another storage, whose rows this job would replace. A job that
        moved its storage still holds its old rows in its working copy: not refused."""
        mine = {(r["grid_key"], r.get("mlflow_run_id")) for r in own}
        foreign = [
            r
            for r in self.rows_of(job)
            if r.get("storage") not in (None, storage)
            and (r["grid_key"], r.get("mlflow_run_id")) not in mine
        ]
        if foreign:
            where = sorted({str(r["storage"]) for r in foreign})[0]
            raise ValueError(
                f"catalog: {self.uri()} already holds {len(foreign)} row(s) of another job "
                f"named {job!r} (storage {where}); give this job another name, or remove "
                f"those rows there first"
            )

    def is_shared(self) -> bool:
        """Whether the location holds a shared catalog (or is empty)."""
        return bool(self.storage.list(JOBS) or self.storage.list(SHARED_PARTS))


class JobPublisher:
    """The shared catalog as one job publishes to it (`Catalog(publish=...)`): nothing is
    published as the job until its name is checked there (`SharedCatalog.check_owner`).

    `open` checks at the job's start: another job's rows under this name refuse the job
    (ValueError, one line); an unreachable catalog does not stop it. The job records on
    in its own catalog, a background thread checks again every `CHECK_RETRY_S`, and once
    the name is checked the next change (or the job's end) publishes all its rows. A
    foreign job found only then stops the publishing, never the job. Once checked, a
    failed write is the caller's to report (`catalog._unpublished`), as before."""

    def __init__(
        self,
        shared: SharedCatalog,
        job: str,
        storage: str,
        rows: Callable[[], list[dict[str, Any]]],
        note: Callable[[str], None],
    ) -> None:
        self.shared, self.job, self.storage, self.rows, self.note = (
            shared, job, storage, rows, note)  # fmt: skip
        self.state = "unchecked"
        """unchecked; late (checked after an outage: all rows go out next); live
        (publishing as the job); refused (another job owns the name: nothing goes out)."""
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def uri(self) -> str:
        return self.shared.uri()

    @property
    def reachable(self) -> bool:
        return self.state == "live"

    def open(self) -> None:
        """The start's check (see the class docstring)."""
        try:
            self.shared.check_owner(self.job, self.storage, self.rows())
        except OSError as exc:
            self.note(
                f"shared catalog {self.uri()} not reachable ({_one_line(exc)}): this job's "
                f"rows stay in its own catalog and are published once it is (checked every "
                f"{CHECK_RETRY_S:.0f} s, and at the job's end)"
            )
            threading.Thread(target=self._check_until_done, daemon=True).start()
            return
        self.state = "live"

    def close(self) -> None:
        """The job ends: the background checks stop; its last compaction checks once more."""
        self._stop.set()

    def _check_until_done(self) -> None:
        while not self._stop.wait(CHECK_RETRY_S) and self.state == "unchecked":
            self.check_again()

    def check_again(self) -> None:
        """One more check of the job's name; any outcome but an unreachable catalog is final."""
        try:
            self.shared.check_owner(self.job, self.storage, self.rows())
        except OSError:
            return
        except ValueError as exc:
            outcome = "refused"
            self.note(f"{exc}: this job's rows are not published there")
        else:
            outcome = "late"
        with self._lock:
            if self.state == "unchecked":
                self.state = outcome

    def _went_live(self) -> None:
        with self._lock:
            late, self.state = self.state == "late", "live"
        if late:
            self.note(f"shared catalog {self.uri()} reached: this job's rows published there")

    def ranking_rows(self) -> dict[tuple[str, str], dict[str, Any]]:
        """The shared catalog's rows by (grid key, run id), for the registry's ranking;
        none when it is not reachable or cannot be read (the aliases then rank by the
        versions' own tags), with a line saying so."""
        if not self.reachable:  # a read would wait on the store for nothing
            self.note(f"shared catalog {self.uri()} not read: not reachable")
            return {}
        try:
            rows = self.shared.read()
        except OSError as exc:
            line = (str(exc).splitlines() or [type(exc).__name__])[0]
            self.note(f"shared catalog {self.uri()} not read: {line}")
            return {}
        return {(r["grid_key"], r.get("mlflow_run_id") or ""): r for r in rows}

    def put_part(self, job: str, name: str, data: bytes) -> None:
        if self.state == "late":  # everything so far, this change with it
            self.shared.replace_rows(job, self.rows())
            self._went_live()
        elif self.state == "live":
            self.shared.put_part(job, name, data)

    def replace_rows(self, job: str, rows: Iterable[Mapping[str, Any]]) -> int:
        """The job's rows whole (its compactions); at its end, one last check first."""
        if self.state == "unchecked" and self._stop.is_set():
            self.check_again()
            if self.state == "unchecked":
                self.note(
                    f"shared catalog {self.uri()} still not reachable: this job's rows are "
                    "published by its next start"
                )
        if self.state not in ("late", "live"):
            return 0
        n = self.shared.replace_rows(job, rows)
        self._went_live()
        return n


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# -- any catalog by location --------------------------------------------------------------


def open_catalog(location: str) -> list[dict[str, Any]]:
    """The rows of the catalog at `location`, folded, every row with its `protocol`:
    a catalog file (`catalog.parquet`), a job's run directory or storage, or a shared
    catalog. One-line errors for anything else."""
    rows = _read_any(location)
    for r in rows:
        r["protocol"] = row_protocol(r)
    return rows


def _read_any(location: str) -> list[dict[str, Any]]:
    if not is_remote(location):
        path = Path(location)
        if path.is_file():
            try:
                return read_catalog(path)
            except pa.ArrowInvalid as exc:
                raise ValueError(f"{location!r} is not a parquet catalog ({exc})") from None
        if not path.is_dir():
            raise FileNotFoundError(f"catalog not found: {location!r}")
    store = Storage(location)
    shared = SharedCatalog(store)
    if shared.is_shared():
        return shared.read()
    if store.read_bytes(NAME) is not None or store.list(PARTS):
        return _read_job_storage(store)
    raise FileNotFoundError(
        f"no catalog at {store.uri()!r} (neither {NAME} nor a shared catalog's {JOBS}/)"
    )


def _read_job_storage(store: Storage) -> list[dict[str, Any]]:
    data = store.read_bytes(NAME)
    rows = pq.read_table(pa.BufferReader(data)).to_pylist() if data is not None else []
    parts = []
    for name in store.list(PARTS):
        raw = store.read_bytes(f"{PARTS}/{name}")
        part = None if raw is None else parse_part(raw, store.uri(f"{PARTS}/{name}"))
        if part is not None:
            parts.append(part)
    return apply_parts(rows, parts)


FILTERS = ("model", "family", "method", "budget", "repair", "protocol", "job")


def matches(row: Mapping[str, Any], **want: Any) -> bool:
    """Whether a row passes `lorp catalog ls`'s filters: each given one must equal the
    row's value (`method` matches the method or its catalog label; `repair` none
    matches unrepaired rows; `degraded` a bool)."""
    for key, value in want.items():
        if value is None:
            continue
        if key == "method":
            if value not in (row.get("method"), row.get("method_label")):
                return False
        elif key == "repair":
            if (row.get("repair") or "none") != value:
                return False
        elif key == "degraded":
            if bool(row.get("degraded")) != value:
                return False
        elif key == "budget":
            if int(row.get("budget") or 0) != int(value):
                return False
        elif row.get(key) != value:
            return False
    return True
