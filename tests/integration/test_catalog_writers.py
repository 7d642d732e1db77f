"""Seven jobs writing one organisation's catalogs at once, as processes of their own: four
on a shared catalog in a local directory (one killed with SIGKILL midway) and three on
moto's S3 server, two of each group sharing one job name (with different storages), each
job publishing `CHANGES` changes while two readers read throughout. Afterwards each table
holds every committed change exactly once, checked against every writer's own log, and
DuckDB's own Delta reader reads the same rows (`benchmarks/shared_catalog.py` does the
work)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pipeline.catalog.shared import SharedCatalog
from tests.helpers.duckdb_delta import duckdb_rows
from tests.helpers.local_servers import (
    AWS_TEST_ENV,
    create_bucket,
    free_port,
    s3_location,
    start_moto,
)
from tests.helpers.paths import REPO

sys.path.insert(0, str(REPO))

from benchmarks.shared_catalog import run  # noqa: E402

pytestmark = [pytest.mark.integration]

CHANGES = 60
"""Per job: a row put, then two updates of it, 20 times. The jobs still commit side by
side for half a minute (about 150 commits, some retried after a conflict, 80 reads), and
the killed one still dies midway; more changes only cost CPU, as each is a commit and
each read reads the whole table (200 a job took 230 CPU-seconds for the module)."""
ROWS = -(-CHANGES // 3)
"""Rows each surviving job puts: its first change and every third after it."""


def assert_whole(result: dict, writers: int, killed: int) -> None:  # type: ignore[type-arg]
    assert result["reader_failures"] == [] and result["reads"] >= 2
    assert result["reader_drops"] == 0
    assert result["rows_lost"] == result["rows_doubled"] == result["rows_wrong"] == 0
    assert result["nightly_run_ids"] == 2  # one name, two storages: two jobs, both kept
    survivors = writers - killed
    assert result["rows"] >= survivors * ROWS
    assert not [n for n in result["notes"] if "not" in n], result["notes"]


def test_four_local_writers_one_killed(tmp_path: Path) -> None:
    location = str(tmp_path / "catalog")
    result = run(location, writers=4, changes=CHANGES, kill=1, work=tmp_path, pace=0.01)
    assert_whole(result, 4, 1)
    rows = SharedCatalog(location).read()
    assert sorted(duckdb_rows(location, "run_id, grid_key, speedup")) == sorted(
        (r["run_id"], r["grid_key"], r.get("speedup")) for r in rows
    )


def test_three_writers_on_s3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in AWS_TEST_ENV.items():
        monkeypatch.setenv(key, value)
    port = free_port()
    moto = start_moto(port, tmp_path / "moto.log")
    try:
        create_bucket(port, "org")
        location = s3_location(port, "org", "catalog")
        result = run(location, writers=3, changes=CHANGES, kill=0, work=tmp_path, pace=0.01)
        assert_whole(result, 3, 0)
        assert result["rows"] == 3 * ROWS
    finally:
        moto.terminate()
        moto.wait(timeout=30)
