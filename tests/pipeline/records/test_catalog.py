"""The parquet catalog (`pipeline.records.catalog`): one small part per recorded change,
parts applied and folded idempotently, mirrored to the job's storage and to a shared catalog."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pipeline.records.catalog import PARTS, Catalog, read_catalog, write_catalog
from pipeline.records.shared_catalog import SharedCatalog
from pipeline.storage import Storage


def row(i: int) -> dict:  # type: ignore[type-arg]
    return {
        "grid_key": f"k{i:05d}", "job": "j", "model": f"m{i // 100}", "method_label": "lorp",
        "budget": i % 100, "created_at": "2026-12-01", "pruned_layers": [1, 2],
        "ppl_ptb": 10.0 + i,
    }  # fmt: skip


def view(rows: list[dict]) -> list[dict]:  # type: ignore[type-arg]
    """Rows by key on the columns these tests set (parquet adds the other core ones)."""
    keys = [*row(0), "speedup", "speed_resolved"]
    nan_free = [{k: r.get(k) for k in keys} for r in rows]
    return sorted(nan_free, key=lambda r: r["grid_key"])


def test_a_change_costs_one_part_whatever_the_size(tmp_path: Path) -> None:
    cat = Catalog(tmp_path / Catalog.NAME)
    sizes = []
    for i in range(600):
        cat.put(row(i))
        parts = sorted((tmp_path / PARTS).glob("*.json"))
        assert len(parts) == i + 1  # one new file per row, the others untouched
        sizes.append(parts[-1].stat().st_size)
    assert max(sizes) - min(sizes) < 16  # the 600th costs what the 1st did
    assert not (tmp_path / Catalog.NAME).exists()  # no whole-file rewrite per row
    cat.update("k00007", {"speedup": 1.25, "speed_resolved": 1.0})
    rows = read_catalog(tmp_path / Catalog.NAME)  # what `lorp status` reads mid-run
    assert len(rows) == 600 and rows[7]["speedup"] == 1.25 and rows[7]["ppl_ptb"] == 17.0

    cat.compact()
    assert not list((tmp_path / PARTS).glob("*.json"))
    assert view(read_catalog(tmp_path / Catalog.NAME)) == view(rows)
    assert view(Catalog(tmp_path / Catalog.NAME).rows) == view(rows)


def test_parts_applied_twice_change_nothing(tmp_path: Path) -> None:
    """A crash after the fold's rename and before its deletes leaves parts the file already
    holds: read again, they replace rows with themselves."""
    cat = Catalog(tmp_path / Catalog.NAME)
    for i in range(5):
        cat.put(row(i))
    cat.update("k00002", {"ppl_ptb": 99.0})
    cat.put(row(1) | {"ppl_ptb": 50.0})  # a redo replaces its slot's row
    expected = read_catalog(tmp_path / Catalog.NAME)
    write_catalog(tmp_path / Catalog.NAME, cat.rows)  # the fold's rename, then the crash
    again = read_catalog(tmp_path / Catalog.NAME)
    assert sorted(again, key=lambda r: r["grid_key"]) == sorted(
        expected, key=lambda r: r["grid_key"]
    )
    assert len(again) == 5 and {r["grid_key"]: r["ppl_ptb"] for r in again}["k00001"] == 50.0


def test_the_storage_holds_the_same_parts(tmp_path: Path) -> None:
    """A job whose storage is elsewhere: every part is copied there as it is written, so a
    driver on another machine starts from the same rows before any fold."""
    store = Storage(tmp_path / "shared")
    cat = Catalog(tmp_path / "a" / Catalog.NAME, store)
    for i in range(3):
        cat.put(row(i))
    assert len(store.list(PARTS)) == 3
    elsewhere = Catalog(tmp_path / "b" / Catalog.NAME, store)
    assert elsewhere.rows == cat.rows
    cat.compact()
    assert store.list(PARTS) == [] and store.read_bytes(Catalog.NAME) is not None
    assert view(Catalog(tmp_path / "c" / Catalog.NAME, store).rows) == view(cat.rows)


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
        ("k00000", 10.0, []), ("k00000", 99.0, []), ("k-new", 10.0, ["k00000"]),
    ]  # fmt: skip
    assert sink.wholes == 1


def test_a_clock_stepped_back_keeps_the_changes_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An update recorded after its put, with the clock set back between them (NTP, a VM
    restored): it was named by the time and applied first, so the put undid it."""
    clock = iter(range(10**18, 0, -(10**15)))  # every reading earlier than the last
    monkeypatch.setattr(time, "time_ns", lambda: next(clock))
    cat = Catalog(tmp_path / Catalog.NAME)
    cat.put(row(0))
    cat.update("k00000", {"ppl_ptb": 99.0})
    cat.put(row(1))
    assert [r["ppl_ptb"] for r in view(read_catalog(cat.path))] == [99.0, 11.0]
    cat.compact()
    assert [r["ppl_ptb"] for r in view(read_catalog(cat.path))] == [99.0, 11.0]


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
        ({"budget": "four"},
         "catalog column 'budget': row 'k00001' holds str 'four'; the column is int64"),
        ({"ppl_ptb": "n/a"},
         "catalog column 'ppl_ptb': row 'k00001' holds str 'n/a'; the column is float, as its "
         "first value"),
    ],
)  # fmt: skip
def test_a_value_of_another_type_is_one_line_naming_the_column(
    tmp_path: Path,
    change: dict,
    message: str,  # type: ignore[type-arg]
) -> None:
    cat = Catalog(tmp_path / Catalog.NAME)
    cat.put(row(0))
    cat.put(row(1) | change)
    with pytest.raises(ValueError) as err:
        cat.compact()
    assert str(err.value) == message
    assert len(read_catalog(cat.path)) == 2  # nothing lost: the parts are still there
