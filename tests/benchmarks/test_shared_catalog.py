"""benchmarks/shared_catalog.py at a small load: three jobs publishing 60 rows each (one
compaction midway, one at the end) into one shared catalog while a reader folds it; no
row lost, doubled, or seen to go away."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

sys.path.insert(0, str(REPO))

from benchmarks import shared_catalog  # noqa: E402


def test_small_load_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "shared.json"
    assert shared_catalog.main(["--jobs", "3", "--rows", "60", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert (r["jobs"], r["rows_per_job"]) == (3, 60)
    assert r["changes"] == 3 * 60 * 3  # every row put, then its speed and gate updates
    assert r["rows"] == 180 and r["rows_lost"] == r["rows_doubled"] == r["reader_drops"] == 0
    assert r["reader_folds"] >= 1 and 0 <= r["fold_s_busy"] <= r["fold_s_busy_max"]  # rounded
    assert 0 < r["publish_ms_p50"] <= r["publish_ms_p95"]
    assert r["fold_s_final"] > 0


def test_a_job_that_dies_fails_the_run_instead_of_hanging(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A publishing process that dies never puts its times: the script says which one
    died, and stops the reader, instead of waiting for ever."""

    def broken(location: str, job: str, rows: int, out) -> None:  # type: ignore[no-untyped-def]
        os._exit(3)  # as a job killed mid-run: no traceback, no result

    monkeypatch.setattr(shared_catalog, "publish", broken)
    with pytest.raises(RuntimeError, match=r"team-0\d exited with code 3"):
        shared_catalog.main(["--jobs", "2", "--rows", "1"])
