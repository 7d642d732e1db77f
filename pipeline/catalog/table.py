"""A job's catalog: one row per grid point, a Delta Lake table in the run directory
(`catalog/`, its `_delta_log/` there), committed as every point ends. Any Delta reader
reads it (`docs/guides/catalog.md`); `read_catalog` is lorp's reader.

Each change (a row put, figures added to a row) is one MERGE on the row's grid key,
carrying the row's whole new value: atomic, so a job killed at any moment leaves the
table as of its last commit, and a resume starts from exactly what was recorded.
`Catalog.compact` compacts the table's small files, checkpoints its log and vacuums
what no version of the last hour reads, at the start and the end of a job. With a job
storage elsewhere the table is copied there commit by commit
(`pipeline.catalog.table_mirror`).

A catalog in the format before Delta (`catalog.parquet` plus JSON parts in
`catalog.parts/`) is read as it is and becomes a table at the job's next start.

Core columns are typed (`pipeline.catalog.row.CatalogRow`'s fields give `CORE_SCHEMA`);
figures (`ppl_<corpus>`, `acc_<task>`, `latency_ms`, ...) are float64 and appear as
evaluations add them. `merge_catalogs`
combines many jobs' catalogs into the organisation-wide one, one row per grid key (the
newest wins); `write_catalog` writes rows as one parquet file (`lorp catalog merge`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from lorp.atomic import atomic_file
from pipeline.catalog.delta_table import DELTA_LOG, DeltaTable, rows_of
from pipeline.catalog.row import CORE, CORE_SCHEMA
from pipeline.catalog.table_mirror import TableMirror

if TYPE_CHECKING:
    from pipeline.storage.store import Storage


class Publisher(Protocol):
    """Where a job's changes are published besides its own catalog: the shared catalog
    (`pipeline.catalog.shared.JobPublisher`). Both calls return at once."""

    def changed(self, row: Mapping[str, Any], removed: Iterable[str] = ()) -> None: ...

    def whole(self) -> None: ...


NAME = "catalog"
"""The job's catalog table, a directory in the run directory and in its storage."""
OLD_NAME, PARTS = "catalog.parquet", "catalog.parts"
"""The format before Delta: a parquet snapshot and the JSON parts applied after it."""
DELETED = "_lorp_deleted"
"""A source column of a MERGE only: the row deletes its key."""
COMPACT_EVERY = 25
"""Commits between two compactions of the table's small files (a MERGE reads every file:
measured, 0.067 s of CPU a commit uncompacted, 0.046 s compacted every 10)."""
RETENTION_HOURS = 1
"""What a job's table keeps of its past versions' files (for a reader racing a compaction;
a job's table keeps no time-travel window: the shared catalog does)."""


def read_catalog(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rows of a catalog: a table (`catalog/`), or a parquet file with its parts
    applied (a file `lorp catalog merge` wrote, or the format before Delta: asked for
    `catalog/`, a run directory of an older lorp is read from `catalog.parquet`); [] when
    there is none, or its directory is there and its first commit not yet (`lorp status`
    reads a run's table while the run creates it)."""
    path = Path(path)
    if path.is_dir():  # a table; before its first commit, none yet
        committed = any((path / DELTA_LOG).glob("*.json"))
        return rows_of(DeltaTable(str(path)).read()) if committed else []
    if path.name == NAME and not path.exists():
        path = path.with_name(OLD_NAME)
    return read_parquet_catalog(path)


def read_parquet_catalog(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """A parquet catalog file's rows, the parts beside it applied; [] when there is none.

    The bytes are read in one go: a writer replaces the file by rename at any moment, and
    pyarrow reading by path takes the size from one look and the pages from another, so
    a reader racing a write failed with "Page was smaller"."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        rows = []
    else:
        rows = pq.read_table(pa.BufferReader(data)).to_pylist()
    return apply_parts(rows, _read_parts(path.parent / PARTS))


def _read_parts(directory: Path) -> list[dict[str, Any]]:
    if not directory.is_dir():
        return []
    parts = []
    for f in sorted(directory.glob("*.json")):
        try:
            data = f.read_bytes()
        except FileNotFoundError:  # compacted away meanwhile
            continue
        part = parse_part(data, str(f))
        if part is not None:
            parts.append(part)
    return parts


def parse_part(data: bytes, where: str) -> dict[str, Any] | None:
    """One part of the format before Delta (a change of a job's rows), or None with a
    warning naming `where` when it is not a whole one (a writer killed mid-write on a
    store without atomic rename, or a full disk): one such file never stops a reader."""
    import logging

    try:
        part = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        reason = str(exc)
    else:
        if isinstance(part, dict) and isinstance(part.get("op"), str):
            return part
        reason = "not a change (no 'op')"
    logging.getLogger("pipeline").warning(
        "catalog part %s skipped: %s; its job's next compaction rewrites its rows whole",
        where,
        reason,
    )
    return None


def apply_parts(
    rows: list[dict[str, Any]], parts: Iterable[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Rows after each change in order: `put` (a row, replacing its key or slot) or
    `update` (columns of one row)."""
    for part in parts:
        if part["op"] == "put":
            rows = upsert(rows, part["row"])
        else:
            for r in rows:
                if r["grid_key"] == part["key"]:
                    r.update(part["values"])
    return rows


def to_table(rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """The rows as a table: the core columns typed (`CORE_SCHEMA`), every other column
    float64 when its values are numbers (the metrics), else the type its values share: a
    column a newer lorp added (text, say) is kept, not refused. A value that does not fit
    its column's type is one line naming the column and the row."""
    extra = sorted({k for r in rows for k in r if k not in CORE})
    arrays, fields = [], []
    for name in [*CORE_SCHEMA.names, *extra]:
        values = [r.get(name) for r in rows]
        typ = CORE_SCHEMA.field(name).type if name in CORE else _extra_type(values)
        try:
            arrays.append(pa.array(values, type=typ))
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as exc:
            raise ValueError(_misfit(name, typ, rows, exc)) from None
        fields.append(pa.field(name, arrays[-1].type))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def _extra_type(values: Sequence[Any]) -> pa.DataType | None:
    """float64 for numbers (bools included, as metrics always were); null for no value
    at all; None (pyarrow's inference) for anything else."""
    present = [v for v in values if v is not None]
    if not present:  # no type yet: a table takes the one a value brings later
        return pa.null()
    if all(isinstance(v, int | float) for v in present):
        return pa.float64()
    return None


def _misfit(
    name: str, typ: pa.DataType | None, rows: Sequence[Mapping[str, Any]], exc: Exception
) -> str:
    """The first value of column `name` that does not fit it, in one line: against the
    column's type, or (a type inferred) against the type of the column's first value."""
    present = [(r.get("grid_key"), r[name]) for r in rows if r.get(name) is not None]
    for key, value in present:
        if typ is None:
            first = present[0][1]
            fits, want = type(value) is type(first), f"{type(first).__name__}, as its first value"
        else:
            fits, want = _fits(value, typ), str(typ)
        if not fits:
            return (
                f"catalog column {name!r}: row {key!r} holds {type(value).__name__} "
                f"{value!r}; the column is {want}"
            )
    return f"catalog column {name!r}: {str(exc).splitlines()[0]}"


def _fits(value: Any, typ: pa.DataType) -> bool:
    try:
        pa.array([value], type=typ)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        return False
    return True


def write_catalog(path: str | os.PathLike[str], rows: Sequence[Mapping[str, Any]]) -> Path:
    """Write all rows atomically (temporary file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = to_table(rows)
    with atomic_file(path) as tmp:
        pq.write_table(table, tmp)
    return path


def slot(row: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a row answers for: one job's model, method label and budget. A rerun with
    other evaluation settings gives the slot a new grid key; its row replaces the old."""
    return (row["job"], row["model"], row["method_label"], row["budget"])


def upsert(rows: list[dict[str, Any]], row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Rows with `row` replacing any row of the same grid key or slot."""
    keep = [r for r in rows if r["grid_key"] != row["grid_key"] and slot(r) != slot(row)]
    return keep + [dict(row)]


class Catalog:
    """A job's catalog table and its rows in memory; every change is committed at once
    (see the module docstring).

    With a `mirror` (the job's storage, when it is not the run directory) the local table
    is a working copy: the storage's replaces it at the start, so a job resumes from
    storage on any machine, and every commit is copied to storage.

    With `publish` (the organisation's shared catalog, `pipeline.catalog.shared`)
    every change is handed to it too (it publishes in the background), and `compact`
    hands it all of the job's rows."""

    NAME = NAME

    def __init__(
        self,
        path: Path,
        mirror: Storage | None = None,
        publish: Publisher | None = None,
        job: str = "",
    ) -> None:
        self.path, self.mirror, self.publish, self.job = Path(path), mirror, publish, job
        self.table = DeltaTable(str(self.path))
        self.copy = None if mirror is None else TableMirror(self.path, mirror, NAME)
        if self.copy is not None and not self.copy.pull():
            self._fetch_old_format()
        self.commits = 0
        self.migrated = self._migrate()
        """Rows taken from the format before Delta at this start (0: none)."""
        self.rows = rows_of(self.table.read())

    def by_key(self) -> dict[str, dict[str, Any]]:
        return {r["grid_key"]: r for r in self.rows}

    def put(self, row: Mapping[str, Any]) -> None:
        """A row, replacing its grid key's or its slot's (committed before it is held:
        a row the table refuses is one line, and the rows stay as they were)."""
        rows = upsert(self.rows, row)
        removed = {r["grid_key"] for r in self.rows} - {r["grid_key"] for r in rows}
        self._commit(dict(row), removed)
        self.rows = rows
        if self.publish is not None:
            self.publish.changed(row, removed)

    def update(self, grid_key: str, values: Mapping[str, Any]) -> dict[str, Any]:
        """Add or replace columns of one row (figures measured after the point)."""
        row = self.by_key()[grid_key]
        self._commit({**row, **values}, ())
        row.update(values)
        if self.publish is not None:
            self.publish.changed(row)
        return row

    def _commit(self, row: dict[str, Any], removed: Iterable[str]) -> None:
        gone = [{"grid_key": k} for k in sorted(removed)]
        source = to_table([json_safe(row), *gone])
        flags = pa.array([False] + [True] * len(gone), pa.bool_())
        self.table.merge(source.append_column(DELETED, flags), ["grid_key"], delete_flag=DELETED)
        self.commits += 1
        if self.commits % COMPACT_EVERY == 0:
            self.table.compact_files()
        if self.copy is not None:
            self.copy.push()

    def compact(self) -> None:
        """Small files compacted, the log checkpointed, what no version of the last
        `RETENTION_HOURS` reads removed; all the job's rows go to the shared catalog."""
        if self.publish is not None:
            self.publish.whole()
        if self.table.exists():
            self.table.maintain(RETENTION_HOURS)
        if self.copy is not None:
            self.copy.push(prune=True)

    def _fetch_old_format(self) -> None:
        """The storage's catalog in the format before Delta, to migrate here."""
        assert self.mirror is not None
        old = self.path.with_name(OLD_NAME)
        self.mirror.get_file(OLD_NAME, old)
        for name in self.mirror.list(PARTS):
            self.mirror.get_file(f"{PARTS}/{name}", old.parent / PARTS / name)

    def _migrate(self) -> int:
        """A catalog in the format before Delta becomes the table's first version; its
        files go (here and in the storage) once the table holds its rows."""
        old = self.path.with_name(OLD_NAME)
        if self.table.exists() or not (old.is_file() or (old.parent / PARTS).is_dir()):
            return 0
        rows = read_parquet_catalog(old)
        self.table.create(to_table([json_safe(r) for r in rows]), None)
        if self.copy is not None:
            self.copy.push()
        old.unlink(missing_ok=True)
        shutil.rmtree(old.parent / PARTS, ignore_errors=True)
        if self.mirror is not None:
            self.mirror.delete(OLD_NAME)
            for name in self.mirror.list(PARTS):
                self.mirror.delete(f"{PARTS}/{name}")
        return len(rows)


def json_safe(row: Mapping[str, Any]) -> dict[str, Any]:
    """numpy scalars and arrays as Python values (what a row's figures may be)."""
    import numpy as np

    return {
        k: v.item() if isinstance(v, np.generic) else v.tolist() if isinstance(v, np.ndarray) else v
        for k, v in row.items()
    }


def merge_catalogs(paths: Iterable[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    """One row per grid key across catalogs (tables or parquet files); the newest
    `created_at` wins."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        table = (Path(path) / DELTA_LOG).is_dir()
        if not table and not Path(path).is_file():
            raise FileNotFoundError(f"catalog not found: {str(path)!r}")
        try:
            got = read_catalog(path) if table else read_parquet_catalog(path)
        except pa.ArrowInvalid as exc:
            raise ValueError(f"{str(path)!r} is not a parquet catalog ({exc})") from None
        if any("grid_key" not in row for row in got):
            raise ValueError(f"{str(path)!r} is not a lorp catalog (no grid_key column)")
        rows.extend(got)
    return newest_per_key(rows)


def newest_per_key(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per grid key (the newest `created_at`; two jobs that measured the same
    point hold the same figures), sorted by model, method label and budget."""
    best: dict[str, dict[str, Any]] = {}
    for row in rows:
        current = best.get(row["grid_key"])
        if current is None or row["created_at"] >= current["created_at"]:
            best[row["grid_key"]] = row
    return sorted(best.values(), key=lambda r: (r["model"], r["method_label"], r["budget"]))
