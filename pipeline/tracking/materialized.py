"""`tracking.materialize: best`: each `best-<budget>` alias of a model, written out as a
standard checkpoint at a fixed place in the job's storage, so a serving team points vLLM
(or `from_pretrained`) at a directory, not at a manifest.

The place is `materialized/<model>/best-<budget>` below the storage. It holds the version
the alias points at when the job registers the model (a manifest written out from its
base, `lorp.models.variant_manifest`; a full copy copied as it is) and
`lorp_materialized.json`, which names that version and the variant directory it came from.
When the alias moves, the next job that registers the model replaces the directory
(atomically on a filesystem; on an object store the completion marker goes first, so a
reader never takes a half-written one for whole); a directory that already holds the
alias's version is left alone. The version is tagged `materialized` with the directory,
and the registered model `lorp.materialized.<alias>`.

An alias that is gone (its budget left the spec, or every variant of it degraded) takes
its directory with it. `lorp gc` removes a materialisation whose variant directory no
catalog row references any more, or one its writer never finished (`pipeline.driver.cleanup`).
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.spec.names import safe_name
from pipeline.storage.store import Storage, scratch_dir

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

MATERIALIZED = "materialized"
MARKER_FILE = "lorp_materialized.json"
BEST = re.compile(r"best-\d+")
"""The aliases `best` materialises: one per budget, ranked in the reference protocol."""


@dataclass(frozen=True)
class Materialized:
    alias: str
    version: str
    uri: str
    written: bool
    """False when the directory held the alias's version already."""
    removed: bool = False
    """The alias is gone (its budget left the spec, or every variant of it degraded): so
    is its directory."""

    def record(self) -> dict[str, object]:
        """The event's fields (`materialized`)."""
        return {
            "alias": self.alias,
            "version": self.version,
            "uri": self.uri,
            "written": self.written,
            "removed": self.removed,
        }

    def line(self, name: str) -> str:
        if self.removed:
            return f"materialized {name}@{self.alias}: removed (the alias is gone)"
        how = "written" if self.written else "already there"
        return f"materialized {name}@{self.alias} (v{self.version}): {self.uri} ({how})"


def materialized_rel(label: str, alias: str) -> str:
    return f"{MATERIALIZED}/{safe_name(label)}/{alias}"


def materialize_aliases(
    client: MlflowClient,
    name: str,
    label: str,
    aliases: dict[str, str],
    storage: Storage,
    store: str,
) -> list[Materialized]:
    """Write out every `best-<budget>` alias of registered model `name` (`aliases`: alias
    -> version) below `storage`; `store`: the tracking store's URI."""
    out = []
    for alias, version in sorted(aliases.items()):
        if BEST.fullmatch(alias):
            out.append(_materialize(client, name, label, alias, str(version), storage, store))
    for alias in storage.subdirs(f"{MATERIALIZED}/{safe_name(label)}"):
        if BEST.fullmatch(alias) and alias not in aliases:  # the alias is gone: so is its copy
            storage.delete_dir(materialized_rel(label, alias))
            client.delete_registered_model_tag(name, f"lorp.materialized.{alias}")
            out.append(Materialized(alias, "", "", written=False, removed=True))
    return out


def _materialize(
    client: MlflowClient,
    name: str,
    label: str,
    alias: str,
    version: str,
    storage: Storage,
    store: str,
) -> Materialized:
    from pipeline.tracking.registry_loading import check_provenance, version_files

    rel = materialized_rel(label, alias)
    source = client.get_model_version_download_uri(name, version)
    want = {"name": name, "version": version, "alias": alias, "source": source}
    held = storage.read_bytes(f"{rel}/{MARKER_FILE}")
    if held is not None and storage.complete(rel) and json.loads(held) == want:
        return Materialized(alias, version, storage.uri(rel), written=False)
    mv = client.get_model_version(name, version)
    with version_files(client, mv, store) as path, scratch_dir() as tmp:
        check_provenance(path, mv)  # a variant redone since it was registered is refused
        staged = Path(tmp) / "staged"
        staged.mkdir()
        for f in sorted(p for p in path.rglob("*") if p.is_file() and p.name != MARKER_FILE):
            target = staged / f.relative_to(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(f.resolve(), target)  # the copy reads the files where they are
        (staged / MARKER_FILE).write_text(json.dumps(want, indent=2))
        uri = storage.put_dir(staged, rel)
    client.set_model_version_tag(name, version, "materialized", uri)
    client.set_registered_model_tag(name, f"lorp.materialized.{alias}", uri)
    return Materialized(alias, version, uri, written=True)


def materialized_source(storage: Storage, rel: str) -> str | None:
    """The variant directory (its `source` URI) the materialisation at `rel` was written
    from; None when it has no readable marker (a copy its writer never finished)."""
    held = storage.read_bytes(f"{rel}/{MARKER_FILE}")
    try:
        return str(json.loads(held)["source"]) if held is not None else None
    except (ValueError, KeyError, TypeError):
        return None


class AliasWriter:
    """The recorder's `tracking.materialize: best`: each model's aliases written out on a
    thread of their own (a checkpoint per budget: minutes for a 70B model, while the fleet
    goes on), joined at the job's end. A failure fails this step only: one line in the
    run's failures and a `materialize_failed` event."""

    def __init__(
        self,
        tracking_uri: str,
        storage: Storage,
        events: Callable[..., Any],
        note: Callable[[str], None],
        failed: list[str],
    ) -> None:
        self.uri, self.storage, self.events = tracking_uri, storage, events
        self.note, self.failed = note, failed
        self.threads: list[threading.Thread] = []
        self._one = threading.Semaphore(1)
        """One model written out at a time: a fleet's 70B checkpoints never pile up on
        the driver's disk and network at once."""

    def start(self, label: str, name: str, aliases: dict[str, str]) -> None:
        thread = threading.Thread(
            target=self._write,
            args=(label, name, dict(aliases)),
            name=f"materialize {label}",
            daemon=True,
        )
        self.threads.append(thread)
        thread.start()

    def join(self, wait: bool = True) -> None:
        """The job's end: wait for every write-out; a stopped job (`wait=False`) does not
        wait (a write-out cut short leaves only its temporary copy, which `lorp gc`
        removes, and the alias is written out again by the next run)."""
        if not wait:
            return
        for thread in self.threads:
            thread.join()

    def _write(self, label: str, name: str, aliases: dict[str, str]) -> None:
        from mlflow.tracking import MlflowClient

        try:
            with self._one:
                client = MlflowClient(tracking_uri=self.uri)  # this thread's own client
                done = materialize_aliases(client, name, label, aliases, self.storage, self.uri)
                for m in done:
                    self.events("materialized", model=label, **m.record())
                    self.note(m.line(name))
        except Exception as exc:  # noqa: BLE001 (the job's records are complete: it ends well)
            cause = (str(exc).splitlines() or [type(exc).__name__])[0][:500]
            self.failed.append(f"{label}/materialize: {cause}")
            self.events("materialize_failed", model=label, cause=cause)
