"""The Delta table under the shared catalog (`pipeline.catalog.delta_table`): commits that
never replace one another, on a store that keeps its conditions and on one that does not
(moto behind a proxy that drops them), and maintenance that keeps the time-travel window."""

from __future__ import annotations

import pickle
import re
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest

from pipeline.catalog.delta_table import DeltaTable, check_commits_are_safe
from pipeline.storage.store import delta_location
from tests.helpers.header_dropping_proxy import start_proxy

DELETED = "_gone"


def source(keys: list[str], value: float, gone: bool = False) -> pa.Table:
    return pa.table(
        {
            "run_id": ["r"] * len(keys),
            "grid_key": keys,
            "x": [value] * len(keys),
            DELETED: [gone] * len(keys),
        }
    )


def test_s3_locations_become_delta_options() -> None:
    uri, options = delta_location(
        "s3://bkt/org/catalog/?endpoint_override=127.0.0.1:9000&scheme=http"
        "&region=eu-west-1&secret_key=s3cr3t"
    )
    assert uri == "s3://bkt/org/catalog"
    assert options["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9000"
    assert options["AWS_ALLOW_HTTP"] == "true" and options["AWS_REGION"] == "eu-west-1"
    assert options["AWS_SECRET_ACCESS_KEY"] == "s3cr3t" and options["retry_timeout"] == "10s"
    _, options = delta_location("s3://AKIA:se%2Fcret@bkt/c?endpoint_override=h:9000&scheme=http")
    assert (options["AWS_ACCESS_KEY_ID"], options["AWS_SECRET_ACCESS_KEY"]) == ("AKIA", "se/cret")
    with pytest.raises(ValueError, match=r"^catalog: 'hdfs://nn/c': Delta tables are not written"):
        delta_location("hdfs://nn/c")


def test_merge_upserts_deletes_and_never_doubles(tmp_path: Path) -> None:
    table = DeltaTable(str(tmp_path / "t"))
    table.merge(source(["a", "b", "c"], 1.0), ["run_id", "grid_key"], delete_flag=DELETED)
    table.merge(source(["b"], 2.0), ["run_id", "grid_key"], delete_flag=DELETED)
    table.merge(source(["c"], 0.0, gone=True), ["run_id", "grid_key"], delete_flag=DELETED)
    rows = table.read().to_pylist()
    assert sorted((r["grid_key"], r["x"]) for r in rows) == [("a", 1.0), ("b", 2.0)]
    assert DELETED not in table.read().column_names and table.version() == 3


def test_maintenance_compacts_and_keeps_the_time_travel_window(tmp_path: Path) -> None:
    table = DeltaTable(str(tmp_path / "t"))
    for i in range(6):
        table.merge(source([f"k{i}"], float(i)), ["run_id", "grid_key"], delete_flag=DELETED)
    files = len(list((tmp_path / "t").glob("*.parquet")))
    report = table.maintain(retention_hours=1)
    assert report["files_removed_by_compaction"] == 6 and report["files_vacuumed"] == 0
    assert table.read(as_of=3).num_rows == 3  # within the window: still readable
    assert (tmp_path / "t" / "_delta_log" / "_last_checkpoint").is_file()
    assert len(list((tmp_path / "t").glob("*.parquet"))) == files + 1
    assert table.size_bytes() > 0


def test_one_object_shared_by_threads_keeps_each_threads_table_its_own(tmp_path: Path) -> None:
    """Threads sharing one DeltaTable (three jobs' publishers in one process, a job's
    publisher and its maintenance) each keep their own delta-rs table: another thread's
    commit never moves the snapshot a write of this thread is planned on. With one
    shared, a publisher's compaction once read its rows at one version and committed
    against a later one, and a row went back to an older value."""
    table = DeltaTable(str(tmp_path / "t"))
    keys = ["run_id", "grid_key"]
    table.merge(source(["a"], 1.0), keys, delete_flag=DELETED, partition="run_id")
    mine = table._latest()
    planned = mine.version()
    other = threading.Thread(
        target=table.merge, args=(source(["b"], 2.0), keys), kwargs={"delete_flag": DELETED}
    )
    other.start()
    other.join()
    assert table.version() == planned + 1  # the other thread's commit landed...
    assert mine.version() == planned  # ...and left this thread's snapshot where it was
    assert table._latest() is mine and mine.version() == planned + 1  # brought up to date
    assert table.compact_files(("run_id", "r")) == 2
    rows = sorted((r["grid_key"], r["x"]) for r in table.read().to_pylist())
    assert rows == [("a", 1.0), ("b", 2.0)]
    copy = pickle.loads(pickle.dumps(table))  # to a Ray worker: without this process's tables
    assert copy._table is None and copy.read().num_rows == 2


def test_a_store_that_ignores_conditional_writes_is_refused(
    s3: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """moto keeps `If-None-Match` (a second commit of one version fails, delta-rs retries
    it as the next): allowed. The same server behind a proxy that drops the header lets
    the second commit replace the first: refused in one line before anything is written."""
    location = s3.format(prefix=f"probe/{time.time_ns()}")
    check_commits_are_safe(location)  # moto: safe
    port = int(re.search(r"127\.0\.0\.1:(\d+)", location).group(1))  # type: ignore[union-attr]
    proxy = start_proxy(port)
    try:
        unsafe = location.replace(f":{port}", f":{proxy.server_address[1]}")
        with pytest.raises(ValueError) as err:
            check_commits_are_safe(unsafe)
    finally:
        proxy.shutdown()
    assert str(err.value).startswith(
        f"catalog: '{unsafe}': this store does not keep conditional writes"
    )
    assert "\n" not in str(err.value)
