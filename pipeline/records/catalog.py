"""The parquet catalog: one row per grid point, recorded atomically as every point ends.

A finished point costs one small file, whatever the catalog's size: each change (a row
put, figures added to a row) is a JSON *part* in `catalog.parts/`, written by atomic
rename (or, in a remote storage, as one object), named by the writer's start and its
count of changes, so parts apply in order whatever the clock does.
`read_catalog` reads the parquet file and applies the parts after it; every reader
(`lorp status`, the dashboard, `lorp catalog merge`) goes through it. `Catalog.compact`
folds the parts into `catalog.parquet` (atomic rename) and then deletes them, at the
start and the end of a job: a crash between the two leaves parts that apply again to a
file that already has them, which changes nothing (a put replaces its grid key's row,
an update sets the same values).

Core columns are typed (`CORE_SCHEMA`); metric columns (`ppl_<corpus>`, `acc_<task>`,
`latency_ms`, ...) are float64 and appear as evaluations add them. `merge_catalogs`
combines many jobs' catalogs into the organisation-wide one, one row per grid key (the
newest wins).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from lorp.atomic import atomic_file

if TYPE_CHECKING:
    from pipeline.storage import Storage


class Publisher(Protocol):
    """Where a job's changes are published besides its own catalog: the shared catalog
    (`pipeline.records.shared_catalog.JobPublisher`). Both calls return at once."""

    def changed(self, row: Mapping[str, Any], removed: Iterable[str] = ()) -> None: ...

    def whole(self) -> None: ...


CORE_SCHEMA = pa.schema(
    [
        ("grid_key", pa.string()),
        ("job", pa.string()),
        ("run_id", pa.string()),
        ("model", pa.string()),
        ("model_ref", pa.string()),
        ("family", pa.string()),
        ("fingerprint", pa.string()),
        ("dtype", pa.string()),
        ("n_blocks", pa.int64()),
        ("method", pa.string()),
        ("method_label", pa.string()),
        ("variant", pa.string()),
        ("options", pa.string()),
        ("budget", pa.int64()),
        ("pruned_layers", pa.list_(pa.int64())),
        ("kept_layers", pa.list_(pa.int64())),
        ("stages", pa.string()),
        ("memory_plan", pa.string()),
        ("speed_skipped", pa.string()),
        ("repair", pa.string()),
        ("repair_fits", pa.string()),
        ("repair_kept", pa.string()),
        ("rls", pa.float64()),
        ("k", pa.int64()),
        ("labels", pa.list_(pa.int64())),
        ("calibration", pa.string()),
        ("calibration_id", pa.string()),
        ("evaluation", pa.string()),
        ("protocol", pa.string()),
        ("reference_claim", pa.bool_()),
        ("zero_shot", pa.string()),
        ("serving", pa.string()),
        ("stats_file", pa.string()),
        ("params", pa.int64()),
        ("params_dense", pa.int64()),
        ("checkpoint", pa.string()),
        ("storage", pa.string()),
        ("eval_backend", pa.string()),
        ("degraded", pa.bool_()),
        ("judged_on", pa.string()),
        ("fits_calibration_only", pa.bool_()),
        ("tracking_uri", pa.string()),
        ("experiment_id", pa.string()),
        ("mlflow_run_id", pa.string()),
        ("model_uri", pa.string()),
        ("created_at", pa.string()),
        ("lorp_version", pa.string()),
    ]
)
CORE = set(CORE_SCHEMA.names)


NAME = "catalog.parquet"
PARTS = "catalog.parts"


def parts_dir(path: str | os.PathLike[str]) -> Path:
    """The directory of a catalog file's parts."""
    return Path(path).parent / PARTS


def read_catalog(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rows of a catalog file, its parts applied; [] when there is none.

    The bytes are read in one go: a writer replaces the file by rename at any moment, and
    pyarrow reading by path takes the size from one look and the pages from another, so
    a reader racing a write (`lorp status` during a run) failed with "Page was smaller"."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        rows = []
    else:
        rows = pq.read_table(pa.BufferReader(data)).to_pylist()
    return apply_parts(rows, _read_parts(parts_dir(path)))


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
    """One part (a change of a job's rows), or None with a warning naming `where` when it
    is not a whole one: a writer killed mid-write on a store without atomic rename, or a
    full disk. One such file never stops a reader (every job's start-up check, `lorp
    catalog`, the registry's ranking); the job that wrote it still holds the change in its
    own catalog, and its next compaction publishes its rows whole again."""
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
    """float64 for numbers (bools included, as metrics always were); None (pyarrow's
    inference) for anything else."""
    present = [v for v in values if v is not None]
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
    """A job's catalog and its rows in memory; every change is recorded at once, as one
    part (see the module docstring), and folded into the parquet file by `compact`.

    With a `mirror` (the job's storage, when it is not the run directory) the local files
    are a working copy: the storage's catalog and parts replace them at the start, so a
    job resumes from storage on any machine, and every part is copied to storage.

    With `publish` (the organisation's shared catalog, `pipeline.records.shared_catalog`)
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
        self.path, self.mirror, self.publish, self.job = path, mirror, publish, job
        self.parts = parts_dir(path)
        self.n = 0
        self.started = time.time_ns()
        """Every part's name starts with it and ends with its count (`_record`)."""
        if mirror is not None:
            mirror.get_file(self.NAME, path)
            shutil.rmtree(self.parts, ignore_errors=True)
            for name in mirror.list(PARTS):
                mirror.get_file(f"{PARTS}/{name}", self.parts / name)
        self.rows = read_catalog(path)

    def by_key(self) -> dict[str, dict[str, Any]]:
        return {r["grid_key"]: r for r in self.rows}

    def put(self, row: Mapping[str, Any]) -> None:
        before = {r["grid_key"] for r in self.rows}
        self.rows = upsert(self.rows, row)
        self._record({"op": "put", "row": dict(row)})
        if self.publish is not None:
            self.publish.changed(row, before - {r["grid_key"] for r in self.rows})

    def update(self, grid_key: str, values: Mapping[str, Any]) -> dict[str, Any]:
        """Add or replace columns of one row (figures measured after the point)."""
        row = self.by_key()[grid_key]
        row.update(values)
        self._record({"op": "update", "key": grid_key, "values": dict(values)})
        if self.publish is not None:
            self.publish.changed(row)
        return row

    def _record(self, part: dict[str, Any]) -> None:
        self.n += 1
        # Ordered by the count, not by the clock at each change: a clock stepped back
        # would sort an update before its put. (Another process's parts never interleave:
        # each start folds its predecessors' parts before it records a change.)
        name = f"{self.started:020d}-{os.getpid()}-{self.n:09d}.json"
        data = json.dumps(part, default=_plain).encode()
        with atomic_file(self.parts / name) as tmp:
            tmp.write_bytes(data)
        if self.mirror is not None:
            self.mirror.put_file(self.parts / name, f"{PARTS}/{name}")

    def compact(self) -> None:
        """Fold the parts into the parquet file (atomically), then delete them; all the
        job's rows go to the shared catalog."""
        done = sorted(self.parts.glob("*.json")) if self.parts.is_dir() else []
        if self.publish is not None:
            self.publish.whole()
        if not done:
            return
        write_catalog(self.path, self.rows)
        if self.mirror is not None:
            self.mirror.put_file(self.path, self.NAME)
        for f in done:
            if self.mirror is not None:
                self.mirror.delete(f"{PARTS}/{f.name}")
            f.unlink(missing_ok=True)


def _plain(value: Any) -> Any:
    """numpy scalars as Python numbers; anything else as text."""
    return value.item() if hasattr(value, "item") else str(value)


def merge_catalogs(paths: Iterable[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    """One row per grid key across catalogs; the newest `created_at` wins."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        if not Path(path).is_file():
            raise FileNotFoundError(f"catalog not found: {str(path)!r}")
        try:
            got = read_catalog(path)
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
