"""The organisation's shared catalog (`pipeline.catalog.shared`), a Delta Lake
table, under many jobs at once, on every storage backend (local, file://, S3 on moto)."""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.catalog import shared as shared_catalog
from pipeline.catalog.delta_table import TableError
from pipeline.catalog.shared import JobPublisher, SharedCatalog, open_catalog
from pipeline.catalog.table import Catalog, to_table
from pipeline.storage.store import Storage
from tests.helpers.duckdb_delta import duckdb_rows
from tests.helpers.local_servers import (
    AWS_TEST_ENV,
    create_bucket,
    free_port,
    s3_location,
    start_moto,
)


def shared_row(job: str, i: int) -> dict[str, Any]:
    return {
        "grid_key": f"k{i:03d}",
        "job": job,
        "model": "m",
        "method_label": f"x{i}",
        "budget": i,
        "created_at": f"2026-12-01T00:00:{i:02d}",
        "ppl_ptb": 10.0 + i,
    }


def job(shared: SharedCatalog, root: Path, name: str, run_id: str, notes: list[str]):  # type: ignore[no-untyped-def]
    """A job's catalog publishing to `shared` as `run_id`, its start compacted."""
    box: list[Catalog] = []
    publisher = JobPublisher(
        shared, name, str(root / f"storage-{run_id}"), run_id, lambda: box[0].rows, notes.append
    )
    box.append(Catalog(root / run_id / Catalog.NAME, publish=publisher, job=name))
    publisher.open()
    box[0].compact()
    return publisher, box[0]


@pytest.mark.slow  # 13-27 s a store: concurrent publishers
def test_jobs_publish_at_once_and_readers_never_fail(store: Storage, tmp_path: Path) -> None:
    """Three jobs publish at once, two of them named alike (two teams' `nightly`, other
    storages): each keeps its rows under its own run id. A reader reading throughout
    never fails and never sees a job's row count drop; at the end every row is there
    once with its last values, and DuckDB's own Delta reader reads the same rows. A
    rerun with one point replaces that job's rows only."""
    shared, notes = SharedCatalog(store), []
    jobs = {"run-a": "nightly", "run-b": "nightly", "run-c": "team-c"}
    counts: dict[str, list[int]] = {r: [] for r in jobs}
    stop, failures = threading.Event(), []

    def write(run_id: str) -> None:
        publisher, cat = job(shared, tmp_path, jobs[run_id], run_id, notes)
        for i in range(20):
            cat.put(shared_row(jobs[run_id], i))
            cat.update(f"k{i:03d}", {"speedup": 1.0 + i})
            if i % 7 == 6:
                cat.compact()
        cat.compact()
        publisher.close()

    def read() -> None:
        try:
            while not stop.is_set():
                rows = shared.read()
                for r in jobs:
                    counts[r].append(sum(row["run_id"] == r for row in rows))
        except BaseException as exc:  # the test fails on it, not a dead thread
            failures.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(r,)) for r in jobs]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    reader.join()
    assert failures == []
    rows = shared.read()
    assert sorted((r["run_id"], r["job"], r["grid_key"]) for r in rows) == sorted(
        (r, j, f"k{i:03d}") for r, j in jobs.items() for i in range(20)
    )
    assert all(r["speedup"] == 1.0 + r["budget"] for r in rows)
    for r in jobs:
        assert counts[r] == sorted(counts[r]), r  # never a row lost under a reader
    assert len(counts["run-a"]) > 3
    if not store.remote:
        assert sorted(duckdb_rows(store.uri(), "run_id, grid_key, speedup")) == sorted(
            (r["run_id"], r["grid_key"], r["speedup"]) for r in rows
        )
    shared.publish("run-b", [shared_row("nightly", 0)], whole=("nightly", "elsewhere"))
    after = shared.read()
    assert sum(r["run_id"] == "run-b" for r in after) == 1
    assert sum(r["run_id"] != "run-b" for r in after) == 40
    assert not [n for n in notes if "not reachable" in n or "not published" in n], notes


@pytest.mark.parametrize("first", ["maintain", "partition"])
@pytest.mark.parametrize("second", ["maintain", "partition"])
def test_two_compactions_planned_on_one_version_never_double_a_partition(
    store: Storage, first: str, second: str
) -> None:
    """Two jobs' maintenance (or a publisher's own compaction) planned on the same table
    version: the second gives way, and no row is there twice. delta-rs lets two
    `optimize.compact()` commits of one version both land; each job's rows then came
    back twice (the flake this test pins, seen once in the suite)."""
    from pipeline.catalog.delta_table import DeltaTable

    shared = SharedCatalog(store)
    for i in range(4):  # 4 commits: 4 small files in run-b's partition
        shared.publish("run-b", [shared_row("nightly", i)])
    a, b = DeltaTable(store.location), DeltaTable(store.location)
    frozen = b._latest()  # b planned on the version a also reads...
    b._latest = lambda: frozen  # type: ignore[method-assign]
    b._open = lambda version=None: frozen  # type: ignore[method-assign]
    run = {
        "maintain": lambda t: t.maintain(168),
        "partition": lambda t: t.compact_files(("run_id", "run-b")),
    }
    run[first](a)
    second_report = run[second](b)  # ...and commits after a did
    keys = [(r["run_id"], r["grid_key"]) for r in shared.read()]
    assert sorted(keys) == [("run-b", f"k{i:03d}") for i in range(4)]
    given_way = second_report in (0, {"skipped": "conflict"}) or (
        isinstance(second_report, dict) and second_report["files_removed_by_compaction"] == 0
    )
    assert given_way, second_report
    assert a.compact_files(("run_id", "run-b")) == 0  # a's rewrite left one file


def test_a_stray_file_and_a_newer_column_leave_reading_working(tmp_path: Path) -> None:
    """A file the log does not name (a writer killed before its commit, a stray copy) is
    never read; a column a newer lorp adds is merged into the schema and an older reader
    gets it as one more key; a column whose type changes is refused in one line."""
    shared = SharedCatalog(str(tmp_path / "shared"))
    shared.publish("r1", [shared_row("j", 0), shared_row("j", 1)])
    pq.write_table(to_table([shared_row("ghost", 9)]), tmp_path / "shared" / "part-stray.parquet")
    (tmp_path / "shared" / "notes.txt").write_text("left by hand")
    shared.publish("r2", [shared_row("k", 2) | {"ppl_code": 3.5, "owner": "team-x"}])
    rows = {r["grid_key"]: r for r in open_catalog(str(tmp_path / "shared"))}
    assert sorted(rows) == ["k000", "k001", "k002"]
    assert rows["k002"]["owner"] == "team-x" and rows["k000"]["owner"] is None
    shared.publish("r1", [shared_row("j", 1) | {"ppl_ptb": 5.0}])  # an older writer's row
    assert {r["grid_key"]: r["ppl_ptb"] for r in shared.read()}["k001"] == 5.0
    with pytest.raises(ValueError) as err:
        shared.publish("r3", [shared_row("k", 3) | {"owner": 7.0}])
    assert str(err.value) == (
        f"catalog {tmp_path / 'shared'}: column 'owner' is string in the table and double in "
        "this lorp's rows; a column's type never changes (name the new figure as a new column)"
    )
    assert len(shared.read()) == 3  # nothing written


def test_a_corrupt_file_the_log_names_is_named(tmp_path: Path) -> None:
    shared = SharedCatalog(str(tmp_path / "shared"))
    shared.publish("r1", [shared_row("j", 0)])
    [data] = [p for p in (tmp_path / "shared").rglob("*.parquet") if "_delta_log" not in str(p)]
    data.write_bytes(data.read_bytes()[:40])
    with pytest.raises(TableError) as err:
        shared.read()
    message = str(err.value)
    assert message.startswith(f"catalog {tmp_path / 'shared'}: version 1 not readable: ")
    assert "\n" not in message


def test_as_of_reads_a_version_or_a_time(tmp_path: Path) -> None:
    location = str(tmp_path / "shared")
    shared = SharedCatalog(location)
    shared.publish("r1", [shared_row("j", 0)])
    first = time.time()
    time.sleep(1.1)
    shared.publish("r1", [shared_row("j", 1)])
    assert len(open_catalog(location)) == 2
    assert [r["grid_key"] for r in open_catalog(location, as_of="1")] == ["k000"]
    when = datetime.fromtimestamp(first + 0.5).isoformat()  # local time, microseconds kept
    assert [r["grid_key"] for r in open_catalog(location, as_of=when)] == ["k000"]
    with pytest.raises(ValueError, match=r"^--as-of: 'yesterday' is neither a table version"):
        open_catalog(location, as_of="yesterday")


def write_old_format(root: Path) -> None:
    """A shared catalog as lorp wrote it before Delta: snapshots plus one part each."""
    (root / "jobs").mkdir(parents=True)
    (root / "parts").mkdir()
    for name, store in (("team-a", "/s/a"), ("team-b", "/s/b")):
        rows = [shared_row(name, i) | {"storage": store} for i in range(2)]
        pq.write_table(to_table(rows), root / "jobs" / f"{name}.parquet")
        part = {"op": "update", "key": "k001", "values": {"speedup": 2.0}}
        (root / "parts" / f"{name}~0001-1-000000001.json").write_text(json.dumps(part))


def test_a_catalog_of_the_old_format_migrates_and_its_jobs_take_their_rows_over(
    tmp_path: Path,
) -> None:
    root = tmp_path / "shared"
    write_old_format(root)
    assert {r["job"] for r in open_catalog(str(root))} == {"team-a", "team-b"}  # read as is
    shared = SharedCatalog(str(root))
    assert shared.migrate() == 4
    assert shared.migrate() == 0  # once
    rows = shared.read()
    assert sorted((r["run_id"], r["grid_key"], r.get("speedup")) for r in rows) == [
        ("legacy:team-a", "k000", None),
        ("legacy:team-a", "k001", 2.0),
        ("legacy:team-b", "k000", None),
        ("legacy:team-b", "k001", 2.0),
    ]
    mine = [shared_row("team-a", i) | {"storage": "/s/a"} for i in range(3)]
    shared.publish("new-run", mine, whole=("team-a", "/s/a"))
    assert sorted((r["run_id"], r["grid_key"]) for r in shared.read()) == [
        ("legacy:team-b", "k000"),
        ("legacy:team-b", "k001"),
        ("new-run", "k000"),
        ("new-run", "k001"),
        ("new-run", "k002"),
    ]


def test_a_migration_that_lost_the_race_brings_no_taken_row_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Jobs A and B start on an old catalog at once: both see no table; A migrates and
    takes its rows over first; B's migration (its table check long past) takes
    nothing, so `legacy:team-a` never comes back. A row of a lorp that kept no storage
    is the job's too."""
    root = tmp_path / "shared"
    write_old_format(root)
    rows = pq.read_table(root / "jobs" / "team-a.parquet").to_pylist()
    pq.write_table(to_table([*rows, shared_row("team-a", 7)]), root / "jobs" / "team-a.parquet")
    a, b = SharedCatalog(str(root)), SharedCatalog(str(root))
    assert a.migrate() == 5
    a.publish("run-a", [shared_row("team-a", 0) | {"storage": "/s/a"}], whole=("team-a", "/s/a"))
    seen = iter([False])  # B's check ran before A's create
    monkeypatch.setattr(b.table, "exists", lambda: next(seen, True))
    assert b.migrate() == 0
    assert sorted((r["run_id"], r["grid_key"]) for r in a.read()) == [
        ("legacy:team-b", "k000"),
        ("legacy:team-b", "k001"),
        ("run-a", "k000"),
    ]


def test_the_first_write_migrates(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    write_old_format(root)
    SharedCatalog(str(root)).publish("r", [shared_row("team-c", 0)])
    assert len(SharedCatalog(str(root)).read()) == 5


# -- a job's publisher when the catalog is out of reach -----------------------------------


@pytest.fixture
def unreachable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A shared catalog on an S3 endpoint nothing listens on yet (`start` serves it with
    moto), and the notes the job printed."""
    monkeypatch.setattr(shared_catalog, "CHECK_RETRY_S", 0.5)
    monkeypatch.setattr(shared_catalog, "CLOSE_WAIT_S", 3.0)
    for key, value in AWS_TEST_ENV.items():
        monkeypatch.setenv(key, value)
    port, servers = free_port(), []
    shared = SharedCatalog(s3_location(port, "org", "catalog"))

    def start() -> None:
        servers.append(start_moto(port, tmp_path / "moto.log"))
        create_bucket(port, "org")

    yield {"shared": shared, "notes": [], "start": start, "root": tmp_path}
    for server in servers:
        server.terminate()
        server.wait(timeout=30)


def wait_for(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + 60
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_catalog_unreachable_at_start_gets_every_row_once_it_is_back(
    unreachable: dict[str, Any],
) -> None:
    """The start goes on with one note (it was a traceback after 60 s) and a change
    returns at once; the changes wait in the job's own catalog; once the endpoint
    serves, the publisher's next try publishes all of them."""
    shared, notes = unreachable["shared"], unreachable["notes"]
    start = time.monotonic()
    publisher, cat = job(shared, unreachable["root"], "j", "run-j", notes)
    for i in range(3):
        cat.put(shared_row("j", i))
    assert time.monotonic() - start < 2  # a point never waits on the catalog
    wait_for(lambda: notes, "no note said the catalog was out of reach")
    assert notes[0].startswith(f"shared catalog {shared.uri()} not reachable (")
    assert publisher.ranking_rows() == {}  # the registry ranks by its own tags meanwhile
    assert notes[-1] == f"shared catalog {shared.uri()} not read: not reachable"
    unreachable["start"]()
    wait_for(lambda: publisher.state == "live", "the catalog was never reached")
    assert notes[-1].endswith("this job's rows published there")
    assert sorted(r["grid_key"] for r in shared.read()) == ["k000", "k001", "k002"]
    cat.update("k001", {"ppl_ptb": 99.0})
    ranked = publisher.ranking_rows()  # waits for this job's own changes first
    assert sorted(ranked) == [(f"k00{i}", "") for i in range(3)]
    assert ranked[("k001", "")]["ppl_ptb"] == 99.0
    cat.compact()
    publisher.close()
    assert len(shared.read()) == 3


def test_a_catalog_unreachable_to_the_end_is_published_by_the_next_start(
    unreachable: dict[str, Any],
) -> None:
    shared, notes = unreachable["shared"], unreachable["notes"]
    publisher, cat = job(shared, unreachable["root"], "j", "run-j", notes)
    cat.put(shared_row("j", 0))
    cat.put(shared_row("j", 1))
    cat.compact()
    publisher.close()  # the job's end: still refused
    assert notes[-1].endswith(
        "not reachable at the job's end: this job's rows are in its own catalog and are "
        "published by its next start"
    )
    unreachable["start"]()
    again, cat = job(shared, unreachable["root"], "j", "run-j", notes)  # from its own catalog
    assert again.flush(30)
    assert sorted(r["grid_key"] for r in shared.read()) == ["k000", "k001"]
    again.close()


def test_a_store_reached_through_a_path_uri_reads_the_same(tmp_path: Path) -> None:
    shared = SharedCatalog((tmp_path / "shared").as_uri())
    shared.publish("r", [shared_row("j", 0)])
    assert [r["grid_key"] for r in open_catalog(str(tmp_path / "shared"))] == ["k000"]
    assert isinstance(SharedCatalog(str(tmp_path / "shared")).table.read(), pa.Table)


def test_credentials_in_the_catalog_uri_appear_in_no_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An unreachable catalog whose URI carries its keys: the publisher's notes, the read's
    error and the log name the catalog without them."""
    monkeypatch.setattr(shared_catalog, "CLOSE_WAIT_S", 1.0)
    secret = "wJalrXUtnFEMIK7MDENGbPxRfiCY"
    location = (
        f"s3://AKIATESTKEY:{secret}@org/catalog?endpoint_override=127.0.0.1:{free_port()}"
        "&scheme=http&region=us-east-1"
    )
    shared, notes = SharedCatalog(location), []
    publisher, cat = job(shared, tmp_path, "j", "run-j", notes)
    cat.put(shared_row("j", 0))
    wait_for(lambda: notes, "no note said the catalog was out of reach")
    with pytest.raises(OSError) as err:
        shared.read()
    publisher.close()
    lines = [*notes, str(err.value), *(r.getMessage() for r in caplog.records)]
    assert len(notes) >= 2 and "s3://org/catalog" in notes[0]
    assert not [line for line in lines if secret in line or "AKIATESTKEY" in line], lines


def test_a_failure_of_any_kind_keeps_the_changes_and_the_publisher(tmp_path: Path) -> None:
    """An error delta-rs raises as neither OSError nor ValueError (a panic, say) once:
    the thread lives on, the batch is kept and goes out with the next try."""
    shared, notes = SharedCatalog(str(tmp_path / "shared")), []
    real, calls = shared.publish, []

    def failing_once(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("delta-rs panicked")
        return real(*args, **kwargs)

    shared.publish = failing_once  # type: ignore[method-assign]
    publisher, cat = job(shared, tmp_path, "j", "run-j", notes)
    assert publisher.flush(30)
    cat.put(shared_row("j", 0))
    assert publisher.flush(30) and len(calls) == 3
    assert publisher._thread is not None and publisher._thread.is_alive()
    assert [r["grid_key"] for r in shared.read()] == ["k000"]
    assert notes[0] == (
        f"shared catalog {shared.uri()} not reachable (delta-rs panicked): this job's rows "
        "stay in its own catalog and are published once it is (tried again within 30 s, "
        "and at the job's end)"
    )
    publisher.close()


def test_a_damaged_maintenance_marker_means_maintenance_is_due(tmp_path: Path) -> None:
    shared = SharedCatalog(str(tmp_path / "shared"))
    shared.publish("r", [shared_row("j", 0)])
    shared.storage.write_bytes(shared_catalog.MAINTENANCE, b'{"when": 1}')
    assert shared.maintain(168, 6) is not None
    assert shared.maintain(168, 6) is None  # and then not due for six hours
