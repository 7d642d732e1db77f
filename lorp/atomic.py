"""Atomic writes: a reader (another Ray task, a resumed job) sees the old file or directory
or the complete new one, never a half-written one.

Both helpers write to a temporary sibling in the same directory (so `os.replace` is a
rename on one filesystem), fsync it, and rename it into place on success; on any error,
including KeyboardInterrupt, the temporary is removed. Temporary names start with a dot
and carry a random part, so concurrent writers never share one: files end in `.tmp`,
directories in `.partial` (`.<name>.<random>.partial`), the pattern the pipeline deletes
when it resumes a killed job.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PARTIAL_SUFFIX = ".partial"


@contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success it replaces `path`."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def atomic_dir(path: str | os.PathLike[str], *, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory next to `path`; on success it becomes `path`.

    An existing `path` is replaced only with `overwrite=True` (moved aside, then deleted
    after the swap); otherwise FileExistsError, also when another writer finished first.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(
        tempfile.mkdtemp(prefix=f".{target.name}.", suffix=PARTIAL_SUFFIX, dir=target.parent)
    )
    try:
        yield tmp
        _fsync_tree(tmp)
        _commit_dir(tmp, target, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _commit_dir(tmp: Path, target: Path, overwrite: bool) -> None:
    if not target.exists():
        try:
            os.replace(tmp, target)
            return
        except OSError:
            if not target.exists():  # not a lost race: a real error
                raise
    if not overwrite:
        raise FileExistsError(f"output directory already exists: {str(target)!r}")
    trash = target.with_name(f".{target.name}.old")
    shutil.rmtree(trash, ignore_errors=True)  # left by a writer killed mid-swap
    os.replace(target, trash)
    os.replace(tmp, target)
    shutil.rmtree(trash, ignore_errors=True)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            _fsync_file(path)
