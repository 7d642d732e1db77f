"""The shared catalog's format before Delta (`pipeline.catalog.legacy`), read for
migration: snapshots and parts folded; a truncated part skipped with a line naming it."""

from __future__ import annotations

import json
import logging

import pyarrow.parquet as pq
import pytest

from pipeline.catalog.legacy import is_legacy, read_legacy
from pipeline.catalog.table import to_table
from pipeline.storage.store import Storage


def test_snapshots_and_parts_fold(tmp_path, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    store = Storage(tmp_path / "old")
    assert not is_legacy(store)
    (tmp_path / "old" / "jobs").mkdir(parents=True)
    rows = [
        {
            "grid_key": "k0",
            "job": "a",
            "model": "m",
            "method_label": "x",
            "budget": 1,
            "created_at": "2026",
            "ppl_ptb": 10.0,
        }
    ]
    pq.write_table(to_table(rows), tmp_path / "old" / "jobs" / "a.parquet")
    store.write_bytes(
        "parts/a~1-1-000000001.json",
        json.dumps({"op": "update", "key": "k0", "values": {"speedup": 1.5}}).encode(),
    )
    store.write_bytes("parts/a~1-1-000000002.json", b'{"op": "upd')
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        got = read_legacy(store)
    assert is_legacy(store)
    assert [(r["grid_key"], r["speedup"]) for r in got] == [("k0", 1.5)]
    assert "a~1-1-000000002.json skipped" in caplog.records[0].getMessage()
