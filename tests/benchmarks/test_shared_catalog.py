"""benchmarks/shared_catalog.py at a small load: three jobs (two of one name) publishing
into one shared Delta table while two readers read it, one job killed midway; checked
against every writer's own log."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

sys.path.insert(0, str(REPO))

from benchmarks import shared_catalog  # noqa: E402


@pytest.mark.slow  # 30 s: writers and readers of a real catalog at once
def test_small_load_loses_nothing(tmp_path: Path) -> None:
    out, page = tmp_path / "shared.json", tmp_path / "page.md"
    argv = [
        "--writers",
        "3",
        "--changes",
        "30",
        "--kill",
        "1",
        "--read-rows",
        "800",
        "--pace",
        "0.05",
        "0.02",
    ]
    assert shared_catalog.main([*argv, "--json", str(out), "--page", str(page)]) == 0
    r = json.loads(out.read_text())
    assert (r["writers"], r["changes_per_writer"], r["killed"]) == (3, 30, 1)
    assert r["rows_lost"] == r["rows_doubled"] == r["rows_wrong"] == r["reader_drops"] == 0
    assert r["reader_failures"] == [] and r["reads"] >= 1
    assert r["nightly_run_ids"] == 2  # two jobs of one name: two run ids, both kept
    assert 0 < r["publish_ms_p50"] <= r["publish_ms_p95"] and r["commits"] >= 2
    assert r["read"][0]["rows"] == 800 and r["read"][0]["read_s"] > 0
    assert [x["pace_s"] for x in [r, *r["also"]]] == [0.05, 0.02]
    assert all(x["rows_lost"] == x["rows_doubled"] == 0 for x in r["also"])
    assert r["cpu_ms_per_change"] > 0
    assert "| rows lost / doubled / wrong | 0 / 0 / 0 | 0 / 0 / 0 | 0 / 0 / - |" in page.read_text()
    assert "| figure | pace 0.05 s | pace 0.02 s | before" in page.read_text()


def test_a_writer_that_dies_fails_the_run_instead_of_hanging() -> None:
    with pytest.raises(RuntimeError, match=r"writer-\d exited with code 1"):
        shared_catalog.main(["--writers", "2", "--changes", "3", "--location", "hdfs://nn/x"])
