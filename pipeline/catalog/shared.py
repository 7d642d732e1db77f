"""The organisation's shared catalog (`catalog:` in a job spec): every job's rows in one
Delta Lake table at that location (its `_delta_log/` there), written by many jobs at once
and read by any tool that reads Delta (`pipeline.catalog.delta_table`).

A row's key is (`run_id`, `grid_key`): `run_id` is the job's identity, minted at its first
start and kept in its storage (`pipeline.catalog.run_identity`), so two jobs never write
each other's rows, whatever their names and paths. Every change is a MERGE on that key,
one transaction per batch of a job's changes, retried on a conflict with another job's
commit (optimistic concurrency, no lock on a filesystem, conditional writes on S3).

A job publishes from a background thread (`JobPublisher`): a point only hands its row
over and never waits on the catalog; the thread publishes what has changed since its
last commit, so changes reach the table within seconds however many jobs write. At the
job's start and end it publishes the job's rows whole (its own catalog is the truth: a
row the job no longer holds is deleted there). An unreachable catalog never stops a job:
the changes wait in the job's own catalog and go out once the catalog answers.

A catalog in the format before Delta (`jobs/*.parquet` + `parts/`,
`pipeline.catalog.legacy`) is migrated into the table by `lorp catalog migrate`,
or by the first job that writes there; its rows take the run id `legacy:<job>`, and that
job's first publish takes them over (same name, same storage). The old files are left
where they were (Delta reads only what its log names).

`open_catalog` reads any catalog by location: a catalog file, a job's run directory or
storage, or a shared catalog (optionally as of a version or a time).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa

from pipeline.catalog.delta_table import (
    DELTA_LOG,
    DeltaTable,
    check_commits_are_safe,
    rows_of,
    sql_text,
)
from pipeline.catalog.legacy import is_legacy, read_legacy
from pipeline.catalog.protocol import row_protocol
from pipeline.catalog.run_identity import LEGACY_PREFIX
from pipeline.catalog.table import (
    COMPACT_EVERY,
    DELETED,
    NAME,
    OLD_NAME,
    PARTS,
    apply_parts,
    parse_part,
    read_parquet_catalog,
    to_table,
)
from pipeline.storage.store import Storage, is_remote

KEY = ("run_id", "grid_key")
CHECK_RETRY_S = 30.0
"""The longest a publisher waits before trying an unreachable catalog again."""
CLOSE_WAIT_S = 30.0
"""How long a job's end waits for its last changes to be published."""
MAINTAIN_WAIT_S = 60.0
"""How long a job's end then waits for the table's maintenance, when it is due (what is
not done by then is left: a maintenance cut short commits nothing, and the next does it)."""
MAINTENANCE = "_lorp_maintenance.json"


class SharedCatalog:
    """One shared catalog location (layout and rules: the module docstring)."""

    def __init__(self, location: str | Storage) -> None:
        self.storage = location if isinstance(location, Storage) else Storage(location)
        self.table = DeltaTable(self.storage.location)

    def uri(self) -> str:
        return self.storage.uri()

    def is_shared(self) -> bool:
        """Whether the location holds a shared catalog, in either format."""
        return bool(self.storage.list(DELTA_LOG)) or is_legacy(self.storage)

    # -- reading -----------------------------------------------------------------------

    def read(self, as_of: int | str | datetime | None = None) -> list[dict[str, Any]]:
        """Every row, as of now or of a version or a time; a catalog not yet migrated is
        read in its old format (it keeps no versions)."""
        table = self.table.read(as_of)
        if table is not None:
            return rows_of(table)
        if as_of is not None:
            raise ValueError(f"--as-of: {self.uri()} is not a Delta table: it keeps no versions")
        return _legacy_rows(self.storage) if is_legacy(self.storage) else []

    def rows_of(self, job: str) -> list[dict[str, Any]]:
        return [r for r in self.read() if r.get("job") == job]

    # -- writing -----------------------------------------------------------------------

    def migrate(self) -> int:
        """Create the table from a catalog in the old format (the module docstring);
        the number of rows it took, 0 where there is a table already or nothing to take."""
        if self.table.exists() or not is_legacy(self.storage):
            return 0
        check_commits_are_safe(self.storage.location)
        rows = _legacy_rows(self.storage)
        # The table's first version holds them: of two jobs migrating at once one creates
        # it, the other finds it (a MERGE after a takeover would bring taken rows back).
        return len(rows) if self.table.create(to_table(rows), partition="run_id") else 0

    def publish(
        self,
        run_id: str,
        rows: Iterable[Mapping[str, Any]],
        deleted: Iterable[str] = (),
        *,
        whole: tuple[str, str] | None = None,
    ) -> dict[str, Any]:
        """One transaction: `rows` upserted under `run_id`, the `deleted` grid keys
        removed; with `whole` = (job, storage) the rows are all of the job's, so the
        job's other rows go, and then (a second transaction, needed once after a
        migration) that job's migrated rows (`legacy:<job>`) of that storage."""
        check_commits_are_safe(self.storage.location)
        if not self.table.exists():
            self.migrate()
        rows = [{**r, "run_id": run_id} for r in rows]
        deleted = list(deleted)
        if whole is not None:  # the keys of this run the job no longer holds
            held = {r["grid_key"] for r in rows}
            deleted += [k for k in self.table.keys("grid_key", "run_id", run_id) if k not in held]
        scope = f"t.run_id = {sql_text(run_id)}"  # its own partition: no other job conflicts
        report = self.table.merge(
            _source(rows, [(run_id, k) for k in deleted]),
            KEY,
            delete_flag=DELETED,
            partition="run_id",
            scope=scope,
        )
        if whole is not None:
            job, storage = whole
            self.table.delete_where(  # rows of a lorp that kept no storage are the job's
                f"run_id = {sql_text(LEGACY_PREFIX + job)} "
                f"AND (storage = {sql_text(storage)} OR storage IS NULL)"
            )
        return report

    def maintain(self, retention_hours: int, every_hours: float) -> dict[str, Any] | None:
        """Compaction, a log checkpoint and vacuum (`DeltaTable.maintain`), at most once
        every `every_hours` whoever asks; None when not due."""
        if time.time() - _maintained_at(self.storage.read_bytes(MAINTENANCE)) < every_hours * 3600:
            return None
        self.storage.write_bytes(MAINTENANCE, json.dumps({"at": time.time()}).encode())
        return self.table.maintain(retention_hours)


def _maintained_at(data: bytes | None) -> float:
    """When the table was last maintained (0 where never, or the marker is damaged)."""
    try:
        return float(json.loads(data)["at"]) if data else 0.0
    except (ValueError, KeyError, TypeError):
        return 0.0


def _source(rows: list[dict[str, Any]], deleted: list[tuple[str, str]]) -> pa.Table:
    tombstones = [{"run_id": r, "grid_key": k} for r, k in deleted]
    table = to_table([*rows, *tombstones])
    flag = pa.array([False] * len(rows) + [True] * len(tombstones), pa.bool_())
    return table.append_column(DELETED, flag)


def _legacy_rows(storage: Storage) -> list[dict[str, Any]]:
    return [
        {**r, "run_id": r.get("run_id") or LEGACY_PREFIX + r["job"]} for r in read_legacy(storage)
    ]


class JobPublisher:
    """The shared catalog as one job publishes to it (`Catalog(publish=...)`, and the
    module docstring): `changed` and `whole` hand changes over and return at once; a
    thread of its own publishes them, batching what came meanwhile; `close` waits up to
    `CLOSE_WAIT_S` for the last of them."""

    def __init__(
        self,
        shared: SharedCatalog,
        job: str,
        storage: str,
        run_id: str,
        rows: Callable[[], list[dict[str, Any]]],
        note: Callable[[str], None],
    ) -> None:
        self.shared, self.job, self.storage, self.run_id = shared, job, storage, run_id
        self.rows, self.note = rows, note
        self.state = "unreached"
        """unreached (nothing published yet, or the catalog stopped answering); live;
        refused (the table refuses this job's rows: a column's type changed)."""
        self._pending: dict[str, dict[str, Any] | None] = {}
        self._handed: dict[str, float] = {}
        """Pending key -> when its oldest unpublished change was handed over."""
        self.commit_seconds: list[float] = []
        """How long each commit took, conflicts retried included."""
        self.latencies: list[float] = []
        """Seconds from each change's hand-over to the commit that published it."""
        self._whole = False
        self._lock = threading.Lock()
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        self._said_unreachable = False
        self.published = 0
        """Commits this job made (the tests and the benchmark count them)."""

    def uri(self) -> str:
        return self.shared.uri()

    @property
    def reachable(self) -> bool:
        return self.state == "live"

    def open(self) -> None:
        """Start publishing (the job's rows whole first, once the start compacts)."""
        self._thread = threading.Thread(target=self._run, name="catalog-publisher", daemon=True)
        self._thread.start()

    def changed(self, row: Mapping[str, Any], removed: Iterable[str] = ()) -> None:
        """A row put or updated (its whole new value), and the keys it replaced."""
        now = time.monotonic()
        with self._lock:
            self._pending[row["grid_key"]] = dict(row)
            self._handed.setdefault(row["grid_key"], now)
            for key in removed:
                self._pending[key] = None
                self._handed.setdefault(key, now)
        self._wake.set()

    def whole(self) -> None:
        """All the job's rows go out next (its start and end: `Catalog.compact`)."""
        with self._lock:
            self._whole = True
        self._wake.set()

    def flush(self, timeout: float, *, while_unreached: bool = True) -> bool:
        """Wait until everything handed over is published; whether it was. Without
        `while_unreached`, stop waiting as soon as the catalog stops answering."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                idle = not self._pending and not self._whole and not self._busy
            if idle or self.state == "refused":
                return idle
            if not while_unreached and self.state != "live":
                return False
            self._wake.set()
            time.sleep(0.02)
        return False

    _busy = False

    def close(self, retention_hours: int = 168, maintenance_hours: float = 6.0) -> None:
        """The job's end: its last changes published and the thread stopped, within
        `CLOSE_WAIT_S` in all; then the table maintained when due, within
        `MAINTAIN_WAIT_S`. What could not go out is said in one line; the job's next
        start publishes it."""
        deadline = time.monotonic() + CLOSE_WAIT_S
        done = self.flush(CLOSE_WAIT_S)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if not done and self.state != "refused":
            self.note(
                f"shared catalog {self.uri()} not reachable at the job's end: this job's "
                "rows are in its own catalog and are published by its next start"
            )
        elif done:
            self._maintain(retention_hours, maintenance_hours)

    def _maintain(self, retention_hours: int, every_hours: float) -> None:
        """`SharedCatalog.maintain` on a thread of its own, waited for `MAINTAIN_WAIT_S`."""

        def run() -> None:
            try:
                report = self.shared.maintain(retention_hours, every_hours)
            except Exception as exc:  # noqa: BLE001 (never fatal: the next job does it)
                self.note(f"shared catalog {self.uri()} not maintained: {_one_line(exc)}")
            else:
                if report:
                    self.note(f"shared catalog {self.uri()} maintained: {report}")

        thread = threading.Thread(target=run, name="catalog-maintenance", daemon=True)
        thread.start()
        thread.join(MAINTAIN_WAIT_S)
        if thread.is_alive():
            self.note(
                f"shared catalog {self.uri()}: maintenance not finished in "
                f"{MAINTAIN_WAIT_S:.0f} s: left to a later job (nothing half done is kept)"
            )

    def _run(self) -> None:
        delay = 0.0
        while not self._stop.is_set():
            self._wake.wait(delay or None)
            self._wake.clear()
            delay = 0.0 if self._publish_once() else min(max(2 * delay, 0.5), CHECK_RETRY_S)

    def _publish_once(self) -> bool:
        """Publish what is pending; False when the catalog did not answer (kept)."""
        began = time.monotonic()
        with self._lock:
            batch, whole, handed = self._pending, self._whole, self._handed
            self._pending, self._whole, self._busy, self._handed = {}, False, True, {}
        todo = bool(batch or whole) and self.state != "refused"
        try:
            if todo:
                self._publish(batch, whole)
        except ValueError as exc:  # the table refuses the rows: said once, never retried
            self.state = "refused"
            self.note(f"{exc}: this job's rows are not published there")
        except Exception as exc:  # noqa: BLE001 (unreachable, or delta-rs failing: kept)
            with self._lock:
                for key, row in batch.items():
                    self._pending.setdefault(key, row)
                    self._handed[key] = min(handed[key], self._handed.get(key, handed[key]))
                self._whole = self._whole or whole
                self._busy = False
            self._unreachable(exc)
            return False
        else:
            if todo:
                self._published(began, handed)
        with self._lock:
            self._busy = False
        return True

    def _publish(self, batch: dict[str, dict[str, Any] | None], whole: bool) -> None:
        if whole:
            self.shared.publish(self.run_id, list(self.rows()), whole=(self.job, self.storage))
        else:
            rows = [r for r in batch.values() if r is not None]
            gone = [k for k, r in batch.items() if r is None]
            self.shared.publish(self.run_id, rows, gone)

    def _published(self, began: float, handed: dict[str, float]) -> None:
        self.published += 1
        if self.published % COMPACT_EVERY == 0:  # its own partition: no one else's conflicts
            with contextlib.suppress(Exception):  # published; compacting is the next's turn
                self.shared.table.compact_files(("run_id", self.run_id))
        done = time.monotonic()
        self.latencies.extend(done - t for t in handed.values())
        self.commit_seconds.append(done - began)
        if self.state != "live" and self._said_unreachable:
            self.note(f"shared catalog {self.uri()} reached: this job's rows published there")
        self.state, self._said_unreachable = "live", False

    def _unreachable(self, exc: BaseException) -> None:
        self.state = "unreached"
        if not self._said_unreachable:
            self._said_unreachable = True
            self.note(
                f"shared catalog {self.uri()} not reachable ({_one_line(exc)}): this job's "
                f"rows stay in its own catalog and are published once it is (tried again "
                f"within {CHECK_RETRY_S:.0f} s, and at the job's end)"
            )

    def ranking_rows(self) -> dict[tuple[str, str], dict[str, Any]]:
        """The shared catalog's rows by (grid key, run id), for the registry's ranking;
        none when it is not reachable or cannot be read (the aliases then rank by the
        versions' own tags), with a line saying so."""
        if self.reachable:  # this job's own rows first (not waiting on a store that fails)
            self.flush(CLOSE_WAIT_S, while_unreached=False)
        if not self.reachable:  # a read would wait on the store for nothing
            self.note(f"shared catalog {self.uri()} not read: not reachable")
            return {}
        try:
            rows = self.shared.read()
        except OSError as exc:
            self.note(f"shared catalog {self.uri()} not read: {_one_line(exc)}")
            return {}
        return {(r["grid_key"], r.get("mlflow_run_id") or ""): r for r in rows}


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# -- any catalog by location --------------------------------------------------------------


def open_catalog(location: str, as_of: str | None = None) -> list[dict[str, Any]]:
    """The rows of the catalog at `location`, every row with its `protocol`: a parquet
    catalog file, a job's table (`catalog/`), its run directory or storage, or a shared
    catalog; a table's rows can be read as of a version (`as_of` digits) or a time (ISO
    8601). One-line errors for anything else."""
    rows = _read_any(location, parse_as_of(as_of))
    for r in rows:
        r["protocol"] = row_protocol(r)
    return rows


def parse_as_of(text: str | None) -> int | datetime | None:
    if text is None:
        return None
    if text.strip().isdigit():
        return int(text)
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"--as-of: {text!r} is neither a table version (a number) nor a time "
            "(ISO 8601, e.g. 2026-12-05T06:00:00+00:00)"
        ) from None
    return when if when.tzinfo else when.astimezone()


def _read_any(location: str, as_of: int | datetime | None) -> list[dict[str, Any]]:
    if not is_remote(location):
        path = Path(location.removeprefix("file://"))
        if path.is_file():
            if as_of is not None:
                raise ValueError(
                    f"--as-of: {location!r} is a job's catalog file: it keeps no versions"
                )
            try:
                return read_parquet_catalog(path)
            except pa.ArrowInvalid as exc:
                raise ValueError(f"{location!r} is not a parquet catalog ({exc})") from None
        if not path.is_dir():
            raise FileNotFoundError(f"catalog not found: {location!r}")
    store = Storage(location)
    shared = SharedCatalog(store)
    if shared.is_shared():
        return shared.read(as_of)
    if any(n.startswith(f"{DELTA_LOG}/") for n in store.files(NAME)):  # a job's own table
        return rows_of(DeltaTable(store.sub(NAME).location).read(as_of))
    if store.read_bytes(OLD_NAME) is not None or store.list(PARTS):
        if as_of is not None:
            raise ValueError(f"--as-of: {store.uri()} is a job's catalog: it keeps no versions")
        return _read_old_job_storage(store)
    raise FileNotFoundError(
        f"no catalog at {store.uri()!r} (neither a job's {NAME}/ nor a shared catalog's "
        f"{DELTA_LOG}/)"
    )


def _read_old_job_storage(store: Storage) -> list[dict[str, Any]]:
    """A job's catalog in the format before Delta, in its storage."""
    import pyarrow.parquet as pq

    data = store.read_bytes(OLD_NAME)
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
