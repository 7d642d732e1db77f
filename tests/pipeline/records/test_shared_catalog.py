"""The organisation's shared catalog (`pipeline.records.shared_catalog`) under many jobs at
once, on every storage backend (local, file://, S3 on moto)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.records import shared_catalog
from pipeline.records.catalog import Catalog
from pipeline.records.shared_catalog import JobPublisher, SharedCatalog, open_catalog
from pipeline.storage import Storage
from tests.helpers.local_servers import (
    AWS_TEST_ENV,
    create_bucket,
    free_port,
    s3_location,
    start_moto,
)


def shared_row(job: str, i: int) -> dict[str, Any]:
    return {
        "grid_key": f"k{i:03d}", "job": job, "model": "m", "method_label": f"x{i}",
        "budget": i, "created_at": f"2026-12-01T00:00:{i:02d}", "ppl_ptb": 10.0 + i,
    }  # fmt: skip


def test_a_shared_catalog_takes_many_jobs_at_once(store: Storage, tmp_path: Path) -> None:
    """Three jobs publish into one shared catalog at once, each compacting (snapshot
    replaced, its parts deleted) every few rows, while a reader folds it again and again:
    the reader never sees a job's row count drop (a compaction under it is read again),
    and at the end every row is there exactly once. A rerun replaces its own rows only."""
    shared = SharedCatalog(store)
    jobs = ["team-a", "team-b", "team-c"]
    counts: dict[str, list[int]] = {j: [] for j in jobs}
    stop = threading.Event()

    def write(job: str) -> None:
        cat = Catalog(tmp_path / job / Catalog.NAME, publish=shared, job=job)
        for i in range(20):
            cat.put(shared_row(job, i))
            cat.update(f"k{i:03d}", {"speedup": 1.0 + i})
            if i % 2:
                cat.compact()

    failures: list[BaseException] = []

    def read() -> None:
        try:
            while not stop.is_set():
                rows = shared.read()
                for j in jobs:
                    counts[j].append(sum(r["job"] == j for r in rows))
        except BaseException as exc:  # the test fails on it, not a dead thread
            failures.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(j,)) for j in jobs]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    reader.join()
    assert failures == []
    rows = shared.read()
    assert sorted((r["job"], r["grid_key"]) for r in rows) == sorted(
        (j, f"k{i:03d}") for j in jobs for i in range(20)
    )
    assert all(r["speedup"] == 1.0 + r["budget"] for r in rows)
    for j in jobs:
        assert counts[j] == sorted(counts[j]), j  # never a row lost to a compaction
    assert len(counts["team-a"]) > 3
    shared.replace_rows("team-b", [shared_row("team-b", 0)])  # a rerun with one point
    after = shared.read()
    assert sum(r["job"] == "team-b" for r in after) == 1
    assert sum(r["job"] != "team-b" for r in after) == 40


def test_a_broken_part_is_named_and_stops_no_reader(
    store: Storage, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A truncated part (a writer killed mid-write on a store without atomic rename, or a
    full disk) is skipped with one warning naming it: `lorp catalog`, every job's start-up
    check and the registry's ranking read every other row. The job that wrote it still
    has the change, and its next compaction publishes its rows whole again."""
    shared = SharedCatalog(store)
    a = Catalog(tmp_path / "a" / Catalog.NAME, publish=shared, job="team-a")
    b = Catalog(tmp_path / "b" / Catalog.NAME, publish=shared, job="team-b")
    for i in range(3):
        a.put(shared_row("team-a", i))
        b.put(shared_row("team-b", i))
    b.update("k002", {"speedup": 1.5})
    [last] = [n for n in store.list("parts") if n.startswith("team-b")][-1:]
    whole = store.read_bytes(f"parts/{last}")
    assert whole is not None and b'"speedup"' in whole  # the update is b's last part
    store.write_bytes(f"parts/{last}", whole[: len(whole) // 2])  # cut mid-string
    store.write_bytes("parts/team-b~zz-empty.json", b"")
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        rows = open_catalog(store.uri())
    assert sorted((r["job"], r["grid_key"]) for r in rows) == sorted(
        (j, f"k{i:03d}") for j in ("team-a", "team-b") for i in range(3)
    )
    assert all("speedup" not in r for r in rows)  # the cut update is not applied
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2, warned
    assert warned[0].startswith(f"catalog part {store.uri(f'parts/{last}')} skipped: ")
    assert "Unterminated string" in warned[0] and "team-b~zz-empty.json" in warned[1]
    b.compact()  # team-b's next compaction: its rows whole, with the change
    assert {r["grid_key"]: r.get("speedup") for r in shared.read() if r["job"] == "team-b"} == {
        "k000": None, "k001": None, "k002": 1.5,
    }  # fmt: skip


# -- a job's publisher when the catalog is out of reach -----------------------------------


@pytest.fixture
def unreachable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A shared catalog on an S3 endpoint nothing listens on yet (`start` serves it with
    moto), a job `j` publishing to it, and the notes the job printed."""
    monkeypatch.setattr(shared_catalog, "CHECK_RETRY_S", 0.2)
    monkeypatch.setattr(shared_catalog, "ERROR_RETRY_S", 0.0)  # one refused call a check
    for key, value in AWS_TEST_ENV.items():
        monkeypatch.setenv(key, value)
    port, servers = free_port(), []
    shared = SharedCatalog(s3_location(port, "org", "catalog"))
    notes: list[str] = []

    def job(run: str) -> tuple[JobPublisher, Catalog]:
        box: list[Catalog] = []
        publisher = JobPublisher(shared, "j", "/store/j", lambda: box[0].rows, notes.append)
        box.append(Catalog(tmp_path / run / Catalog.NAME, publish=publisher, job="j"))
        return publisher, box[0]

    def start() -> None:
        servers.append(start_moto(port, tmp_path / "moto.log"))
        create_bucket(port, "org")

    yield {"shared": shared, "notes": notes, "job": job, "start": start}
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
    """The start goes on with one note (it was a traceback after 60 s); the changes wait
    in the job's own catalog; once the endpoint serves, the background check finds it and
    the next change publishes all of them, and later ones as parts."""
    shared, notes = unreachable["shared"], unreachable["notes"]
    publisher, cat = unreachable["job"]("run")
    publisher.open()
    assert publisher.state == "unchecked" and len(notes) == 1, notes
    assert notes[0].startswith(f"shared catalog {shared.uri()} not reachable (")
    assert publisher.ranking_rows() == {}  # the registry ranks by its own tags meanwhile
    assert notes[-1] == f"shared catalog {shared.uri()} not read: not reachable"
    for i in range(3):
        cat.put(shared_row("j", i))
    assert len(cat.rows) == 3
    unreachable["start"]()
    wait_for(lambda: publisher.state == "late", "the background check never found the catalog")
    assert shared.read() == []  # checked, not yet published: that is the next change's
    cat.put(shared_row("j", 3))
    assert publisher.state == "live" and notes[-1].endswith("this job's rows published there")
    assert sorted(r["grid_key"] for r in shared.read()) == ["k000", "k001", "k002", "k003"]
    ranked = publisher.ranking_rows()
    assert sorted(ranked) == [(f"k00{i}", "") for i in range(4)]
    assert ranked[("k002", "")]["ppl_ptb"] == 12.0
    cat.update("k001", {"ppl_ptb": 99.0})  # from here on, one part per change
    assert {r["grid_key"]: r["ppl_ptb"] for r in shared.read()}["k001"] == 99.0
    publisher.close()
    cat.compact()
    assert len(shared.read()) == 4 and len(notes) == 3, notes


def test_a_catalog_unreachable_to_the_end_is_published_by_the_next_start(
    unreachable: dict[str, Any],
) -> None:
    shared, notes = unreachable["shared"], unreachable["notes"]
    publisher, cat = unreachable["job"]("run")
    publisher.open()
    cat.put(shared_row("j", 0))
    cat.put(shared_row("j", 1))
    publisher.close()
    cat.compact()  # the job's end: one last check, refused
    assert notes[-1].endswith(
        "still not reachable: this job's rows are published by its next start"
    )
    unreachable["start"]()
    again, cat = unreachable["job"]("run")  # the next start, from the job's own catalog
    again.open()
    assert again.state == "live"
    cat.compact()
    assert sorted(r["grid_key"] for r in shared.read()) == ["k000", "k001"]


def test_another_job_found_late_stops_the_publishing_not_the_job(
    unreachable: dict[str, Any],
) -> None:
    """Another team's job of the same name (another storage) already in the catalog when
    it comes back: this job publishes nothing there and records on in its own catalog."""
    shared, notes = unreachable["shared"], unreachable["notes"]
    publisher, cat = unreachable["job"]("run")
    shared_catalog.CHECK_RETRY_S = 3600  # no background check: theirs lands first
    publisher.open()
    cat.put(shared_row("j", 0))
    unreachable["start"]()
    theirs = shared_row("j", 7) | {"storage": "s3://theirs/j"}
    shared.replace_rows("j", [theirs])
    publisher.check_again()  # what the background check does
    assert publisher.state == "refused"
    assert "already holds 1 row(s) of another job named 'j'" in notes[-1]
    cat.put(shared_row("j", 1))
    publisher.close()
    cat.compact()
    assert [r["grid_key"] for r in shared.read()] == ["k007"]
    assert sorted(r["grid_key"] for r in cat.rows) == ["k000", "k001"]
