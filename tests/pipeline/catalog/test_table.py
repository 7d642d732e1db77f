"""A job's catalog (`pipeline.catalog.table`): a Delta table, one commit per recorded
change, copied to the job's storage and handed to a shared catalog; the format before
Delta migrated."""

from __future__ import annotations

import json
from pathlib import Path

import deltalake
import pytest

from pipeline.catalog.delta_table import DeltaTable, rows_of
from pipeline.catalog.shared import SharedCatalog, open_catalog
from pipeline.catalog.table import (
    COMPACT_EVERY,
    OLD_NAME,
    PARTS,
    Catalog,
    read_catalog,
    write_catalog,
)
from pipeline.storage.store import Storage
from tests.helpers.duckdb_delta import duckdb_rows


def row(i: int) -> dict:  # type: ignore[type-arg]
    return {
        "grid_key": f"k{i:05d}",
        "job": "j",
        "model": f"m{i // 100}",
        "method_label": "lorp",
        "budget": i % 100,
        "created_at": "2026-12-01",
        "pruned_layers": [1, 2],
        "ppl_ptb": 10.0 + i,
    }


def view(rows: list[dict]) -> list[dict]:  # type: ignore[type-arg]
    """Rows by key on the columns these tests set (parquet adds the other core ones)."""
    keys = [*row(0), "speedup", "speed_resolved"]
    nan_free = [{k: r.get(k) for k in keys} for r in rows]
    return sorted(nan_free, key=lambda r: r["grid_key"])


def test_every_change_is_one_commit_and_a_resume_reads_them_all(tmp_path: Path) -> None:
    """A put or an update is one Delta commit (what `lorp status` reads mid-run is
    every change so far); compaction folds the small files and loses nothing; a new
    start reads the same rows; DuckDB's own Delta reader reads them too."""
    cat = Catalog(tmp_path / Catalog.NAME)
    for i in range(40):
        cat.put(row(i))
    cat.update("k00007", {"speedup": 1.25, "speed_resolved": 1.0})
    table = DeltaTable(str(cat.path))
    assert COMPACT_EVERY == 25
    assert table.version() == 42  # created empty, a commit per change, a compaction at 25
    rows = read_catalog(tmp_path / Catalog.NAME)
    assert view(rows) == view(cat.rows)
    by_key = {r["grid_key"]: r for r in rows}
    assert by_key["k00007"]["speedup"] == 1.25 and by_key["k00007"]["ppl_ptb"] == 17.0
    assert len(deltalake.DeltaTable(str(cat.path)).file_uris()) == 1 + 15  # the 25 compacted
    cat.compact()
    assert len(deltalake.DeltaTable(str(cat.path)).file_uris()) == 1
    assert view(read_catalog(cat.path)) == view(rows)
    assert view(Catalog(tmp_path / Catalog.NAME).rows) == view(rows)
    assert sorted(k for (k,) in duckdb_rows(str(cat.path), "grid_key")) == sorted(by_key)


def test_a_put_is_the_whole_row_and_a_redo_replaces_its_slot(tmp_path: Path) -> None:
    """A figure the new row no longer holds is not kept from the old one; a rerun of a
    slot under another grid key removes the old key."""
    cat = Catalog(tmp_path / Catalog.NAME)
    cat.put(row(0))
    cat.update("k00000", {"speedup": 2.0})
    cat.put(row(0) | {"ppl_ptb": 50.0})
    cat.put(row(1))
    cat.put(row(1) | {"grid_key": "k-redo"})
    got = {r["grid_key"]: r for r in read_catalog(cat.path)}
    assert sorted(got) == ["k-redo", "k00000"]
    assert got["k00000"]["speedup"] is None and got["k00000"]["ppl_ptb"] == 50.0


def test_the_storage_holds_the_same_table(store: Storage, tmp_path: Path) -> None:
    """A job whose storage is elsewhere (a directory, file:// or moto's S3): every commit
    is copied there as it is made, so a driver on another machine starts from the same
    rows, and the copy is a Delta table any reader reads; compaction's removals follow."""
    cat = Catalog(tmp_path / "a" / Catalog.NAME, store)
    for i in range(3):
        cat.put(row(i))
    cat.update("k00001", {"speedup": 1.5})
    copy = DeltaTable(store.sub(Catalog.NAME).location)
    assert copy.version() == 4 and view(rows_of(copy.read())) == view(cat.rows)
    assert view(open_catalog(store.location)) == view(cat.rows)
    elsewhere = Catalog(tmp_path / "b" / Catalog.NAME, store)
    assert view(elsewhere.rows) == view(cat.rows)
    before = set(store.files(Catalog.NAME))
    cat.compact()
    after = set(store.files(Catalog.NAME))
    assert after == {p.relative_to(cat.path).as_posix() for p in cat.path.rglob("*") if p.is_file()}
    assert after != before and view(rows_of(copy.read())) == view(cat.rows)
    assert view(Catalog(tmp_path / "c" / Catalog.NAME, store).rows) == view(cat.rows)


def write_old_format(run_dir: Path) -> list[dict]:  # type: ignore[type-arg]
    """A job's catalog as lorp wrote it before Delta: a snapshot and a part after it."""
    rows = [row(0), row(1)]
    write_catalog(run_dir / OLD_NAME, rows)
    (run_dir / PARTS).mkdir()
    part = {"op": "update", "key": "k00001", "values": {"speedup": 2.0}}
    (run_dir / PARTS / "00000000000000000001-1-000000001.json").write_text(json.dumps(part))
    return [rows[0], rows[1] | {"speedup": 2.0}]


def test_a_catalog_of_the_format_before_delta_becomes_a_table(
    store: Storage, tmp_path: Path
) -> None:
    """Read as it is until the job starts again; then its rows (parts applied) are the
    table's first version and its files go, here and in the job's storage."""
    run_dir = tmp_path / "run"
    expected = write_old_format(run_dir)
    assert view(read_catalog(run_dir / Catalog.NAME)) == view(expected)  # `lorp status`
    cat = Catalog(run_dir / Catalog.NAME)
    assert cat.migrated == 2 and view(cat.rows) == view(expected)
    assert not (run_dir / OLD_NAME).exists() and not (run_dir / PARTS).exists()
    assert DeltaTable(str(cat.path)).version() == 0
    # the same in a storage elsewhere, fetched to a new machine's run directory
    other = tmp_path / "other"
    expected = write_old_format(other)
    store.put_file(other / OLD_NAME, OLD_NAME)
    store.put_file(next((other / PARTS).glob("*.json")), f"{PARTS}/p.json")
    cat = Catalog(tmp_path / "new" / Catalog.NAME, store)
    assert cat.migrated == 2 and view(cat.rows) == view(expected)
    assert store.read_bytes(OLD_NAME) is None and store.list(PARTS) == []
    assert view(rows_of(DeltaTable(store.sub(Catalog.NAME).location).read())) == view(expected)


class Recording:
    """A publisher that keeps what a catalog hands it (`catalog.Publisher`)."""

    def __init__(self) -> None:
        self.changes: list[tuple[str, dict, list[str]]] = []
        self.wholes = 0

    def changed(self, row, removed=()) -> None:  # type: ignore[no-untyped-def]
        self.changes.append((row["grid_key"], dict(row), sorted(removed)))

    def whole(self) -> None:
        self.wholes += 1


def test_every_change_goes_to_the_publisher_with_the_keys_it_replaced(tmp_path: Path) -> None:
    """A put, an update (the row's whole new value) and a rerun of a slot under a new grid
    key (the old key is named as removed, so the shared catalog deletes it)."""
    sink = Recording()
    cat = Catalog(tmp_path / Catalog.NAME, publish=sink, job="j")
    cat.put(row(0))
    cat.update("k00000", {"ppl_ptb": 99.0})
    cat.put(row(0) | {"grid_key": "k-new"})  # the same slot, other evaluation settings
    cat.compact()
    assert [(k, r["ppl_ptb"], gone) for k, r, gone in sink.changes] == [
        ("k00000", 10.0, []),
        ("k00000", 99.0, []),
        ("k-new", 10.0, ["k00000"]),
    ]
    assert sink.wholes == 1


def test_a_column_a_newer_lorp_added_is_kept(tmp_path: Path) -> None:
    """A text column this version does not know (a newer lorp's) survives the fold, the
    compaction and the shared catalog (it stopped a resume: "Could not convert ... with
    type str: tried to convert to double")."""
    shared = SharedCatalog(str(tmp_path / "shared"))
    cat = Catalog(tmp_path / "run" / Catalog.NAME, job="j")
    cat.put(row(0) | {"owner_team": "search", "tokens_seen": 12})
    cat.put(row(1))
    cat.compact()
    shared.publish("run-j", cat.rows, whole=("j", "/s"))
    for rows in (read_catalog(cat.path), shared.read()):
        by_key = {r["grid_key"]: r for r in rows}
        assert by_key["k00000"]["owner_team"] == "search" and by_key["k00001"]["owner_team"] is None
        assert by_key["k00000"]["tokens_seen"] == 12.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"budget": "four"},
            "catalog column 'budget': row 'k00001' holds str 'four'; the column is int64",
        ),
        (
            {"ppl_ptb": "n/a"},
            "catalog {table}: column 'ppl_ptb' is double in the table and string in this lorp's "
            "rows; a column's type never changes (name the new figure as a new column)",
        ),
    ],
)
def test_a_value_of_another_type_is_one_line_naming_the_column(
    tmp_path: Path,
    change: dict,
    message: str,  # type: ignore[type-arg]
) -> None:
    cat = Catalog(tmp_path / Catalog.NAME)
    cat.put(row(0))
    with pytest.raises(ValueError) as err:
        cat.put(row(1) | change)
    assert str(err.value) == message.format(table=cat.path)
    assert [r["grid_key"] for r in read_catalog(cat.path)] == ["k00000"]  # nothing lost
    assert [r["grid_key"] for r in cat.rows] == ["k00000"]  # nor held without the table


def test_a_table_being_created_reads_as_no_rows(tmp_path: Path) -> None:
    """`lorp status` polls a run's catalog while the run creates it: the directory comes
    first, then the log's directory, then the first commit."""
    table = tmp_path / "catalog"
    table.mkdir()
    assert read_catalog(table) == []
    (table / "_delta_log").mkdir()
    assert read_catalog(table) == []
