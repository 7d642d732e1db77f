"""Atomic writes, so a reader (another task, a resumed job) never sees a half-written file or
directory, whatever stops the writer."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorp.atomic import atomic_dir, atomic_file


def test_atomic_file_replaces_or_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "a.json"
    with atomic_file(target) as tmp:
        assert tmp.parent == target.parent and tmp.name.startswith(".a.json.")
        tmp.write_text("1")
        assert not target.exists()
    assert target.read_text() == "1"
    with pytest.raises(RuntimeError, match="boom"), atomic_file(target) as tmp:
        tmp.write_text("2")
        raise RuntimeError("boom")
    assert target.read_text() == "1" and [p.name for p in target.parent.iterdir()] == ["a.json"]


def test_atomic_dir_commit_overwrite_and_cleanup(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    with atomic_dir(out) as tmp:
        # The pipeline deletes `*/.*.partial` leftovers of killed writers on resume.
        assert tmp.name.startswith(".ckpt.") and tmp.name.endswith(".partial")
        assert tmp.match(".*.partial")
        (tmp / "w").write_text("v1")
    assert (out / "w").read_text() == "v1"
    with pytest.raises(FileExistsError, match="already exists"), atomic_dir(out) as tmp:
        (tmp / "w").write_text("v2")
    with atomic_dir(out, overwrite=True) as tmp:
        (tmp / "w").write_text("v3")
    assert (out / "w").read_text() == "v3"
    with pytest.raises(KeyboardInterrupt), atomic_dir(tmp_path / "x") as tmp:
        raise KeyboardInterrupt
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
