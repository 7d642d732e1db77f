"""A job's run id (`pipeline.catalog.run_identity`): minted once per storage, kept."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from pipeline.catalog.run_identity import RUN_FILE, run_identity
from pipeline.storage.store import Storage


def test_a_run_id_is_minted_once_and_kept(store: Storage) -> None:
    first = run_identity(store, "nightly")
    assert len(first) == 32 and run_identity(store, "nightly") == first
    assert store.read_bytes(RUN_FILE) is not None


def test_two_storages_of_one_path_name_are_two_jobs(tmp_path: Path) -> None:
    """Two containers whose jobs use the same default path on disks of their own."""
    a, b = Storage(tmp_path / "host-a" / "runs/job"), Storage(tmp_path / "host-b" / "runs/job")
    assert run_identity(a, "job") != run_identity(b, "job")


def test_drivers_starting_at_once_agree(store: Storage) -> None:
    """Eight drivers mint at once: a link on a disk, a conditional PUT on S3."""
    got: list[str] = []
    threads = [
        threading.Thread(target=lambda: got.append(run_identity(store, "j"))) for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1 and len(got) == 8


def test_a_damaged_record_is_one_line(tmp_path: Path) -> None:
    store = Storage(tmp_path / "s")
    store.write_bytes(RUN_FILE, b'{"run_')
    with pytest.raises(ValueError, match=r"lorp_run.json is not a lorp run record \(a run id"):
        run_identity(store, "j")
