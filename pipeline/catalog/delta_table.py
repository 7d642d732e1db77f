"""A Delta Lake table at a storage location, through `deltalake` (delta-rs: no JVM, no
server): the shared catalog's format (`pipeline.catalog.shared`).

What lorp writes, so that every reader of Delta reads it (Spark, Trino, DuckDB's `delta`
extension, Polars, pandas through `deltalake`): protocol reader 1 / writer 2, no table
features (no deletion vectors, no column mapping), no partitions; new columns are added
by schema evolution (`merge_schema`), never renamed or retyped.

Commits are optimistic: every change is one MERGE, retried on a conflict with another
writer (`merge`). On a local disk or a shared mount delta-rs commits by an atomic
create-if-absent; on S3 (and S3-compatible stores) by a conditional write
(`If-None-Match`), which S3 has served since 2024. A store that ignores the condition
would lose commits silently, so an object store is probed once per process before lorp
writes there (`check_commits_are_safe`): one that lets a second writer replace a commit
is refused in one line.

Locations are lorp's storage URIs (`pipeline.storage.store`): a path, `file://`, `s3://bucket/
prefix?endpoint_override=host:port&scheme=http&region=...`, `gs://`, `az://`; credentials
come from the environment (AWS_ACCESS_KEY_ID, ...) or the URI, and never appear in an
error (`storage.redact`, `storage._scrub`).
"""

from __future__ import annotations

import contextlib
import functools
import random
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import pyarrow as pa

from pipeline.storage import s3_conditional
from pipeline.storage.store import _scrub, delta_location, redact

DELTA_LOG = "_delta_log"
CONFLICT_TRIES = 50
"""How often one change is tried against other writers' commits before it is given up
(each try reloads the table; 7 writers publishing at once conflict a few times a change)."""


class TableError(OSError):
    """The table could not be read or written: one line, naming the table, no secrets."""


class DeltaTable:
    """One Delta table at a lorp storage location (see the module docstring)."""

    def __init__(self, location: str) -> None:
        self.location = str(location)
        self.table_uri, self.options = delta_location(self.location)
        self.conflicts = 0
        """Commits of this object's that another writer's commit made it try again."""
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (to a Ray worker, say) without this process's per-thread tables."""
        return {k: v for k, v in self.__dict__.items() if k != "_local"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    @property
    def _table(self) -> Any:
        """The table as this thread's writes last saw it (`_latest`). One per thread: a
        delta-rs table object shared by threads has its snapshot moved by each of them
        (a commit sets the object to its own post-commit version, possibly older than
        another thread's), so a write planned on it could read one version and commit
        against another (measured: a stale row in about 1 of 10 runs of six publishers
        sharing one catalog object, before this)."""
        return getattr(self._local, "table", None)

    @_table.setter
    def _table(self, table: Any) -> None:
        self._local.table = table

    def uri(self) -> str:
        return redact(self.location)

    def _fail(self, exc: BaseException, doing: str) -> TableError:
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0].strip()
        return TableError(f"catalog {self.uri()}: {doing}: {_scrub(text, self.location)}")

    def exists(self) -> bool:
        from deltalake import DeltaTable as Table

        try:
            return Table.is_deltatable(self.table_uri, storage_options=self.options)
        except Exception as exc:  # noqa: BLE001 (delta-rs raises its own kinds)
            raise self._fail(exc, "not reachable") from None

    def _open(self, version: int | str | datetime | None = None):  # type: ignore[no-untyped-def]
        from deltalake import DeltaTable as Table
        from deltalake.exceptions import TableNotFoundError

        try:
            pinned = version if isinstance(version, int) else None  # loaded at it, once
            table = Table(self.table_uri, version=pinned, storage_options=self.options)
            if version is not None and pinned is None:
                table.load_as_version(version)
        except TableNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc, "not readable") from None
        return table

    def _latest(self) -> Any:
        """The table at its newest version, for a write: kept open and brought up to date
        (opening replays the log from its checkpoint: about 30 ms of CPU each time, a
        third of a commit). Each thread keeps its own (`_table`)."""
        if self._table is not None:
            try:
                self._table.update_incremental()
                return self._table
            except Exception:  # noqa: BLE001 (vacuumed or replaced meanwhile: open afresh)
                self._table = None
        self._table = self._open()
        return self._table

    def read(self, as_of: int | str | datetime | None = None) -> pa.Table | None:
        """The table (as of a version, or of a time), or None where there is none. A file
        the log does not name is never read; a corrupt one it names is one line."""
        table = self._open(as_of)
        if table is None:
            return None
        from deltalake import QueryBuilder

        # QueryBuilder, not to_pyarrow_table(): the pyarrow filesystem delta-rs hands
        # pyarrow for object stores aborts the interpreter at its exit (measured, 1.6.6).
        try:
            return pa.table(
                QueryBuilder().register("t", table).execute("SELECT * FROM t").read_all()
            )
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc, f"version {table.version()} not readable") from None

    def keys(self, column: str, where: str, value: str) -> list[str]:
        """`column` of the rows whose `where` equals `value` (a partition: read alone)."""
        table = self._open()
        if table is None:
            return []
        from deltalake import QueryBuilder

        query = f"SELECT {_q(column)} FROM t WHERE {_q(where)} = {sql_text(value)}"
        try:
            got = pa.table(QueryBuilder().register("t", table).execute(query).read_all())
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc, "not readable") from None
        return [str(v) for v in got.column(0).to_pylist()]

    def version(self) -> int | None:
        table = self._open()
        return None if table is None else table.version()

    def merge(
        self,
        source: pa.Table,
        keys: Sequence[str],
        *,
        delete_flag: str,
        partition: str | None = None,
        scope: str | None = None,
    ) -> dict[str, Any]:
        """One transaction: `source`'s rows upserted on `keys`, each its whole new value
        (a column it lacks is null; `whole_rows`), a row whose `delete_flag` is true
        deleting its key instead. `scope`, a predicate on the target `t`, limits
        what the MERGE reads, and so what it can conflict with. Created on first use,
        partitioned by the column `partition`: a MERGE scoped to one partition reads and
        rewrites that partition only, so writers of other partitions never conflict with
        it (measured: 0 conflicts where a whole-table MERGE had one a commit). Retried on
        a conflict with another writer's commit."""
        from deltalake.exceptions import CommitFailedError

        for attempt in range(CONFLICT_TRIES):
            table = self._latest()
            if table is None:
                schema = source.drop_columns([delete_flag]).schema
                table = self._table = self._create(schema, partition)
            check_types(table, source.drop_columns([delete_flag]).schema, self.uri())
            whole = whole_rows(source, table)
            try:
                return self._merge_once(
                    table,
                    whole,
                    keys,
                    [c for c in whole.column_names if c != delete_flag],
                    delete_flag,
                    scope,
                )
            except CommitFailedError:
                self.conflicts += 1
                time.sleep(random.uniform(0.01, 0.05) * min(attempt + 1, 10))
            except Exception as exc:  # noqa: BLE001
                self._table = None
                raise self._fail(exc, "not written") from None
        raise TableError(
            f"catalog {self.uri()}: not written: {CONFLICT_TRIES} tries all conflicted "
            "with other writers"
        )

    def delete_where(self, predicate: str) -> int:
        """Delete the rows `predicate` names (a partition-local predicate conflicts with
        no other partition's writer); retried on a conflict. The rows deleted."""
        from deltalake.exceptions import CommitFailedError

        for attempt in range(CONFLICT_TRIES):
            table = self._latest()
            if table is None:
                return 0
            try:
                return int(table.delete(predicate).get("num_deleted_rows", 0))
            except CommitFailedError:
                self.conflicts += 1
                time.sleep(random.uniform(0.01, 0.05) * min(attempt + 1, 10))
            except Exception as exc:  # noqa: BLE001
                raise self._fail(exc, "not written") from None
        raise TableError(f"catalog {self.uri()}: not written: {CONFLICT_TRIES} tries conflicted")

    @staticmethod
    def _merge_once(
        table: Any,
        source: pa.Table,
        keys: Sequence[str],
        columns: Sequence[str],
        flag: str,
        scope: str | None,
    ) -> dict[str, Any]:
        on = " AND ".join(f"t.{_q(k)} = s.{_q(k)}" for k in keys)
        on = f"({scope}) AND {on}" if scope else on
        new = bool(set(columns) - {f.name for f in pa.schema(table.schema())})
        values = {_q(c): f"s.{_q(c)}" for c in columns}
        merger = (
            # A schema change only when a column is new: every commit that evolves the
            # schema conflicts with every other writer's (a metadata change).
            table.merge(source, on, source_alias="s", target_alias="t", merge_schema=new)
            .when_matched_delete(f"s.{_q(flag)}")
            .when_matched_update(values, f"NOT s.{_q(flag)}")
            .when_not_matched_insert(values, f"NOT s.{_q(flag)}")
        )
        return merger.execute()

    def _create(self, schema: pa.Schema, partition: str | None) -> Any:
        """An empty table of `schema` (another writer creating it at once: theirs)."""
        self.create(schema.empty_table(), partition)
        table = self._open()
        if table is None:
            raise TableError(f"catalog {self.uri()}: not created: created, then not found")
        return table

    def create(self, rows: pa.Table, partition: str | None) -> bool:
        """The table's version 0, holding `rows`; False where a table was there already
        (or another writer's create won: Delta's first commit is create-if-absent)."""
        from deltalake import write_deltalake

        if self.exists():
            return False
        empty = [f.name for f in rows.schema if pa.types.is_null(f.type)]
        rows = rows.drop_columns(empty)  # a column of no values has no Delta type yet
        try:
            write_deltalake(
                self.table_uri,
                rows,
                mode="error",
                partition_by=[partition] if partition else None,
                storage_options=self.options,
            )
        except Exception as exc:  # noqa: BLE001 (a concurrent create: theirs stands)
            if not self.exists():
                raise self._fail(exc, "not created") from None
            return False
        return True

    def compact_files(self, partition: tuple[str, str] | None = None) -> int:
        """The small files a writer's commits left (one per commit) rewritten as one, in
        one partition (`(column, value)`: no other partition's writer conflicts) or in
        every partition; a MERGE then reads one file, not hundreds. The files replaced (0
        where a conflict made it give way: the next does it).

        A partitioned table's partition is rewritten as a data change (its rows read and
        overwritten by predicate), not by `optimize.compact()`: delta-rs lets two
        compactions planned on one version both commit (their removes are marked as no
        data change), and both compacted files then hold the same rows (measured: two
        jobs' maintenance at once doubled a job's rows in the shared catalog). A
        rewrite conflicts with a concurrent rewrite, compaction or MERGE of its
        partition, and gives way. An unpartitioned table (a job's own, one writer) is
        compacted as before."""
        from deltalake.exceptions import CommitFailedError

        table = self._latest()
        if table is None:
            return 0
        columns = table.metadata().partition_columns
        try:
            if not columns:
                return int(table.optimize.compact().get("numFilesRemoved", 0))
            files = _partition_files(table, columns[0])
            values = [partition[1]] if partition else sorted(files)
            done = 0
            for value in [v for v in values if files.get(v, 0) > 1]:
                pinned = self._open(self._latest().version())  # this rewrite's alone
                with contextlib.suppress(CommitFailedError):  # the next compaction does it
                    done += _rewrite_partition(pinned, columns[0], value)
            return done
        except CommitFailedError:
            return 0
        except Exception as exc:  # noqa: BLE001
            self._table = None
            raise self._fail(exc, "not compacted") from None

    def maintain(self, retention_hours: int) -> dict[str, Any]:
        """Small files compacted (`compact_files`, every partition), the log
        checkpointed, files older than `retention_hours` that no version within it reads
        removed. A conflict with a writer is not an error: the next maintenance does it."""
        from deltalake.exceptions import CommitFailedError

        if self._open() is None:
            return {}
        try:
            compacted = self.compact_files()
            table = self._open()
            table.create_checkpoint()
            table.cleanup_metadata()
            removed = table.vacuum(
                retention_hours=retention_hours, dry_run=False, enforce_retention_duration=False
            )
        except CommitFailedError:
            return {"skipped": "conflict"}
        except TableError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc, "not maintained") from None
        return {
            "files_removed_by_compaction": compacted,
            "files_vacuumed": len(removed),
            "version": table.version(),
        }

    def size_bytes(self) -> int:
        """The bytes of the current version's data files."""
        table = self._open()
        if table is None:
            return 0
        adds = pa.table(table.get_add_actions(flatten=True))
        return int(sum(adds.column("size_bytes").to_pylist()))


def whole_rows(source: pa.Table, table: Any) -> pa.Table:
    """`source` with every column of the table's: one it lacks is null (an upserted row
    is the whole row; a figure it no longer has is not kept), one of no values takes the
    table's type, or is left out where the table has no such column yet."""
    held = pa.schema(table.schema())
    for field in source.schema:
        if pa.types.is_null(field.type):
            i = source.schema.get_field_index(field.name)
            if field.name in held.names:
                typ = held.field(field.name).type
                source = source.set_column(i, field.name, pa.nulls(len(source), typ))
            else:
                source = source.remove_column(i)
    for field in held:
        if field.name not in source.column_names:
            source = source.append_column(field.name, pa.nulls(len(source), field.type))
    return source


def _partition_files(table: Any, column: str) -> dict[str, int]:
    """Partition value -> its live data files in `table`'s version."""
    adds = pa.table(table.get_add_actions(flatten=True))
    out: dict[str, int] = {}
    for value in adds.column(f"partition.{column}").to_pylist():
        out[value] = out.get(value, 0) + 1
    return out


def _rewrite_partition(table: Any, column: str, value: str) -> int:
    """One partition's files of `table`'s version rewritten as one file, a data change
    the conflict checker sees; the files replaced (0 where it has one already). `table`
    is a table object of this call's alone, opened at one version: the rows are read
    from the version the overwrite commits against, so any commit after it conflicts."""
    from deltalake import QueryBuilder, write_deltalake

    n = _partition_files(table, column).get(value, 0)
    if n < 2:
        return 0
    where = f"{_q(column)} = {sql_text(value)}"
    query = f"SELECT * FROM t WHERE {where}"
    rows = pa.table(QueryBuilder().register("t", table).execute(query).read_all())
    write_deltalake(table, rows, mode="overwrite", predicate=where)
    return n


def _q(name: str) -> str:
    """A column name quoted for delta-rs's SQL (metric names keep their case)."""
    return "`" + name.replace("`", "``") + "`"


def sql_text(value: str) -> str:
    """A text literal for a predicate."""
    return "'" + value.replace("'", "''") + "'"


def _base(typ: pa.DataType) -> str:
    """A type as Delta holds it: string views and large types are the same column."""
    if pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_string_view(typ):
        return "string"
    if pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_list_view(typ):
        return f"list<{_base(typ.value_type)}>"
    if pa.types.is_timestamp(typ):
        return "timestamp"
    return str(typ)


def check_types(table: Any, schema: pa.Schema, where: str) -> None:
    """Refuse (one line) a column whose type differs from the table's: a type change is
    never merged (a new column is)."""
    held = {f.name: f.type for f in pa.schema(table.schema())}
    for field in schema:
        if field.name not in held or pa.types.is_null(field.type):
            continue
        if _base(field.type) != _base(held[field.name]):
            raise ValueError(
                f"catalog {where}: column {field.name!r} is {_base(held[field.name])} in "
                f"the table and {_base(field.type)} in this lorp's rows; a column's type "
                "never changes (name the new figure as a new column)"
            )


@functools.lru_cache(maxsize=16)
def check_commits_are_safe(location: str) -> None:
    """Refuse (ValueError, one line) an S3-compatible store that would let a second
    writer replace a commit: probed once per process by writing one scratch object twice
    with `If-None-Match: *` (the condition delta-rs commits by); the second must fail.
    AWS S3 itself (no endpoint override) has kept the condition since 2024: not probed.
    A store that does not answer the probe as S3 does is a TableError (tried again)."""
    if not s3_conditional.is_s3(location) or not s3_conditional.endpoint_of(location):
        return
    scratch = f"_lorp_commit_probe/{uuid.uuid4().hex}"
    try:
        if s3_conditional.put_if_absent(location, scratch, b"probe") is not True:
            raise OSError("a first conditional PUT of a new object was refused")
        second = s3_conditional.put_if_absent(location, scratch, b"probe")
        s3_conditional.delete(location, scratch)
    except OSError as exc:
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise TableError(
            f"catalog {redact(location)}: not reachable: {_scrub(text, location)}"
        ) from None
    if second is s3_conditional.PRESENT:
        return
    raise ValueError(
        f"catalog: {redact(location)!r}: this store does not keep conditional writes "
        "(a second PUT with If-None-Match replaced the first), so concurrent jobs would "
        "replace each other's commits; use a store that does (AWS S3, MinIO, R2) or a "
        "shared filesystem"
    )


def rows_of(table: pa.Table | None, columns: Iterable[str] | None = None) -> list[dict[str, Any]]:
    if table is None:
        return []
    if columns is not None:
        table = table.select([c for c in columns if c in table.column_names])
    return table.to_pylist()
