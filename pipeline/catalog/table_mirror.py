"""A job's catalog table copied to its storage, when the storage is not the run directory
(`pipeline.catalog.table.Catalog`): the run directory holds the working table, and
every commit's files are copied to `<storage>/catalog/` as it is made, so a driver on any
machine resumes from the same rows and any Delta reader reads them there.

Delta files never change once written (data files and commits have names of their own;
only `_last_checkpoint` is rewritten), so a copy is a Delta table at every moment if the
files go in order: data files first, then each commit in version order, `_last_checkpoint`
last. What the working table's maintenance removed goes after (`push(prune=True)`).
A pull fetches the log from its last checkpoint on, not every commit before it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from lorp.atomic import atomic_dir
from pipeline.storage.store import Storage

LOG = "_delta_log"
_VERSION = re.compile(r"^(\d+)\.")


def _is_table_file(name: str) -> bool:
    """Not a writer's temporary (delta-rs commits by renaming `_commit_*.tmp` files)."""
    base = name.rsplit("/", 1)[-1]
    return not (base.startswith((".", "_commit_")) or base.endswith(".tmp"))


def _order(name: str) -> tuple[int, int, str]:
    """Data files, then log files by version (a commit before its checkpoint), then
    `_last_checkpoint`."""
    if not name.startswith(f"{LOG}/"):
        return (0, 0, name)
    base = name[len(LOG) + 1 :]
    if base == "_last_checkpoint":
        return (3, 0, base)
    found = _VERSION.match(base)
    version = int(found.group(1)) if found else 0
    return (1, version, "0" if base.endswith(".json") else base)


class TableMirror:
    """The copy of the table at `local` kept at `rel` below `storage`."""

    def __init__(self, local: Path, storage: Storage, rel: str) -> None:
        self.local, self.storage, self.rel = Path(local), storage, rel
        self._copied: dict[str, tuple[int, int]] = {}
        """File -> (size, mtime) of the local file when it was copied."""

    def exists(self) -> bool:
        """Whether the storage holds a table here."""
        return any(name.startswith(f"{LOG}/") for name in self.storage.files(self.rel))

    def pull(self) -> bool:
        """Replace the working table with the storage's copy; False when there is none
        (the working table is left as it is). Commits older than the last checkpoint are
        left out: the checkpoint holds them (a night's thousands of commits are not
        fetched at every start)."""
        names = [n for n in self.storage.files(self.rel) if _is_table_file(n)]
        if not any(n.startswith(f"{LOG}/") for n in names):
            return False
        since = self._checkpoint_version()
        names = [n for n in names if not (n.startswith(f"{LOG}/") and _order(n)[1] < since)]
        with atomic_dir(self.local, overwrite=True) as tmp:
            for name in sorted(names, key=_order):
                if not self.storage.get_file(f"{self.rel}/{name}", tmp / name):
                    raise OSError(f"{self.storage.uri(self.rel)}: {name} vanished while read")
        self._copied = {name: self._stamp(name) for name in names}
        return True

    def push(self, *, prune: bool = False) -> None:
        """Copy what the working table gained since the last push, in order; with
        `prune`, then remove from the copy what the working table no longer has."""
        here = {
            p.relative_to(self.local).as_posix()
            for p in self.local.rglob("*")
            if p.is_file() and _is_table_file(p.relative_to(self.local).as_posix())
        }
        for name in sorted(here, key=_order):
            if name in self._copied and not name.endswith("_last_checkpoint"):
                continue  # written once, never changed: no stat per file per commit
            stamp = self._stamp(name)
            if self._copied.get(name) != stamp:
                self.storage.put_file(self.local / name, f"{self.rel}/{name}")
                self._copied[name] = stamp
        if prune:  # what this working table had from the copy, or gave it, and dropped
            for name in sorted(set(self._copied) - here, key=_order):
                self.storage.delete(f"{self.rel}/{name}")
                self._copied.pop(name)

    def _checkpoint_version(self) -> int:
        data = self.storage.read_bytes(f"{self.rel}/{LOG}/_last_checkpoint")
        try:
            return int(json.loads(data)["version"]) if data else 0
        except (ValueError, KeyError, TypeError):
            return 0  # damaged: everything is fetched

    def _stamp(self, name: str) -> tuple[int, int]:
        path = self.local / name
        if not path.is_file():
            return (-1, -1)
        st = path.stat()
        return (st.st_size, st.st_mtime_ns)
