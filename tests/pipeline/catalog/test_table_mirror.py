"""A job's catalog table copied to its storage (`pipeline.catalog.table_mirror`): in an
order that keeps the copy a Delta table at every moment, and pulled back whole."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from pipeline.catalog.delta_table import DeltaTable
from pipeline.catalog.table_mirror import TableMirror
from pipeline.storage.store import Storage

DELETED = "_gone"


class CutStorage(Storage):
    """A real directory storage that records what is copied to it, and stops (as a
    killed driver does) after `limit` files."""

    def __init__(self, location: Path, limit: int = 10**9) -> None:
        super().__init__(location)
        self.copied: list[str] = []
        self.limit = limit

    def put_file(self, src, rel):  # type: ignore[no-untyped-def]
        if len(self.copied) == self.limit:
            raise OSError("killed")
        self.copied.append(rel)
        return super().put_file(src, rel)


def commit(table: DeltaTable, key: str, value: float) -> None:
    rows = pa.table({"grid_key": [key], "x": [value], DELETED: [False]})
    table.merge(rows, ["grid_key"], delete_flag=DELETED)


def test_data_goes_before_the_commit_that_names_it(tmp_path: Path) -> None:
    local, store = tmp_path / "run" / "catalog", CutStorage(tmp_path / "store")
    table, mirror = DeltaTable(str(local)), TableMirror(local, store, "catalog")
    commit(table, "a", 1.0)
    mirror.push()
    pushes = [list(store.copied)]
    commit(table, "b", 2.0)
    table.maintain(retention_hours=0)  # compacted, checkpointed, the old files vacuumed
    mirror.push(prune=True)
    pushes.append(store.copied[len(pushes[0]) :])
    for names in pushes:  # each push: its data files, then its commits
        kinds = ["log" if "/_delta_log/" in n else "data" for n in names]
        assert "data" in kinds and "log" in kinds
        assert kinds == sorted(kinds), names  # "data" < "log": no data after a commit
    assert store.copied[-1].endswith("_last_checkpoint")
    assert set(store.files("catalog")) == {
        p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()
    }
    copy = DeltaTable(str(tmp_path / "store" / "catalog"))
    assert sorted(copy.read().column("grid_key").to_pylist()) == ["a", "b"]


@pytest.mark.parametrize("cut", [1, 2, 3])
def test_a_copy_cut_midway_reads_as_an_earlier_version(tmp_path: Path, cut: int) -> None:
    local = tmp_path / "run" / "catalog"
    table = DeltaTable(str(local))
    store = CutStorage(tmp_path / "store")
    mirror = TableMirror(local, store, "catalog")
    commit(table, "a", 1.0)
    mirror.push()
    commit(table, "b", 2.0)
    commit(table, "a", 3.0)
    store.limit = len(store.copied) + cut
    with pytest.raises(OSError, match="killed"):
        mirror.push()
    copy = DeltaTable(str(tmp_path / "store" / "catalog")).read().to_pylist()
    # the push copies b's and a's new data files, then commit 2 (b), then commit 3 (a = 3)
    expected = {1: {"a": 1.0}, 2: {"a": 1.0}, 3: {"a": 1.0, "b": 2.0}}[cut]
    assert {r["grid_key"]: r["x"] for r in copy} == expected


def test_a_pull_replaces_the_working_table(tmp_path: Path) -> None:
    store = Storage(tmp_path / "store")
    first = tmp_path / "a" / "catalog"
    table = DeltaTable(str(first))
    commit(table, "a", 1.0)
    TableMirror(first, store, "catalog").push()
    other = tmp_path / "b" / "catalog"
    commit(DeltaTable(str(other)), "stale", 0.0)  # what an earlier run left on this machine
    assert TableMirror(other, store, "catalog").pull()
    assert DeltaTable(str(other)).read().column("grid_key").to_pylist() == ["a"]
    assert not TableMirror(tmp_path / "c" / "catalog", Storage(tmp_path / "none"), "c").pull()


def test_a_pull_fetches_the_log_from_its_last_checkpoint_on(tmp_path: Path) -> None:
    """Thirty commits, a checkpoint at the last: a new machine fetches the checkpoint,
    not thirty commits, and reads the same rows; its compaction removes from the copy
    only what it had (the commits before the checkpoint stay there)."""
    store = Storage(tmp_path / "store")
    local = tmp_path / "a" / "catalog"
    table, mirror = DeltaTable(str(local)), TableMirror(local, store, "catalog")
    for i in range(30):
        commit(table, f"k{i:02d}", float(i))
    table.maintain(retention_hours=1)
    mirror.push(prune=True)
    other = tmp_path / "b" / "catalog"
    assert TableMirror(other, store, "catalog").pull()
    commits = sorted(p.name for p in (other / "_delta_log").glob("*.json"))
    assert commits == ["00000000000000000031.json"]  # created, 30 merges, the compaction
    assert sorted(DeltaTable(str(other)).read().column("grid_key").to_pylist()) == [
        f"k{i:02d}" for i in range(30)
    ]
    assert len([n for n in store.files("catalog") if n.endswith(".json")]) == 32
