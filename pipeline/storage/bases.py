"""A variant's base model, stored once per fingerprint where every node that pulls reaches it.

A variant written as a manifest (`lorp.models.variant_manifest`) names its base by
reference and content fingerprint. A hub id pinned to a commit is reachable wherever the
hub is, so it is only named. Anything else lives on the node that planned the job: a
packaged model or a .gguf file is converted into that node's cache, a local directory is
a path on its disk or a mount. So a job that writes manifests stores such a base below its
storage once, at `bases/<the fingerprint's first 16 hex digits>`, before the model's first
point runs:

- a packaged model or a .gguf file as the GGUF it is converted from (SmolLM2-135M: 98 MB,
  against 517 MB converted to float32), which any node converts the same way;
- a directory as the files loading it reads (`MODEL_FILES`: weights, config, tokenizer).

Beside them, `lorp_base.json` says what the copy is. A node that pulls a variant fetches
the copy into its cache once (`fetch_base`), converts it as the job did, and refuses it
unless its fingerprint is the manifest's. Two jobs of the same base share one copy, and
neither removes what the other wrote (`put_dir(replace=False)`); a copy is complete only
with its marker (or once renamed into place), so a job killed while it wrote one writes
it again at its next start, and `lorp gc` removes what it left. `lorp gc` never removes
a complete copy.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from lorp.cache import cache_root
from pipeline.storage.store import Storage

BASES = "bases"
META = "lorp_base.json"
FORMAT = "lorp-base/1"


def base_rel(fingerprint: str) -> str:
    """Where a base of this content fingerprint is stored, below the storage."""
    return f"{BASES}/{fingerprint[:16]}"


def stored_base_uri(storage: str, kind: str, fingerprint: str) -> str | None:
    """The URI (credentials left out) a manifest names for its base's stored copy, for a
    base of `kind` (`lorp.models.loading.Kind`) planned with `fingerprint` in the storage at
    `storage`; None for a hub id, which is named, not stored."""
    if kind == "hub" or not fingerprint:
        return None
    return Storage(storage).uri(base_rel(fingerprint))


@dataclass(frozen=True)
class StoredBase:
    uri: str
    bytes: int
    """What the copy takes in storage (its files and `lorp_base.json`)."""
    seconds: float
    written: bool
    """False when the copy was there already (another job's, or an earlier start's)."""

    def record(self) -> dict[str, object]:
        """The event's fields (`base_stored`)."""
        return {
            "uri": self.uri,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
            "written": self.written,
        }

    def line(self, label: str) -> str:
        what = f"stored in {self.seconds:.1f} s" if self.written else "stored by an earlier run"
        return f"base {label}: {self.uri} ({self.bytes / 2**20:,.0f} MiB, {what})"


def store_base(
    storage: Storage, ref: str, kind: str, fingerprint: str, local_dir: Path
) -> StoredBase | None:
    """Store the base (`ref` of `kind`, planned from `local_dir` with `fingerprint`) below
    `storage`, unless it is there already; None for a hub id."""
    if stored_base_uri(storage.location, kind, fingerprint) is None:
        return None
    rel = base_rel(fingerprint)
    if storage.complete(rel):
        return StoredBase(storage.uri(rel), storage.tree_bytes(rel), 0.0, written=False)
    start = time.monotonic()
    files = _source_files(ref, kind, local_dir)
    meta = {"format": FORMAT, "ref": ref, "kind": kind, "fingerprint": fingerprint}
    if kind in ("alias", "gguf"):
        (gguf,) = files
        meta |= {"gguf": gguf.name, "name": ref if kind == "alias" else None}
    with tempfile.TemporaryDirectory(prefix="lorp-base-") as tmp:
        staged = Path(tmp)
        for f in files:  # links: the copy reads the source's bytes, nothing is duplicated
            os.symlink(f.resolve(), staged / f.name)
        (staged / META).write_text(json.dumps(meta, indent=2))
        uri = storage.put_dir(staged, rel, replace=False)  # another writer's copy stays
    return StoredBase(uri, storage.tree_bytes(rel), time.monotonic() - start, written=True)


MODEL_FILES = (
    "*.json",
    "*.safetensors",
    "*.model",
    "*.txt",
    "*.py",
    "*.tiktoken",
    "*.jinja",
    "tokenizer*",
)
"""A directory base's files a copy holds: what loading it reads (weights, config, tokenizer,
remote code). Not its subdirectories (`original/` consolidated weights, training
checkpoints, `.git`), nor hidden files."""


def _source_files(ref: str, kind: str, local_dir: Path) -> list[Path]:
    """What a copy of the base holds: the GGUF a packaged model or .gguf file is converted
    from, or a directory's `MODEL_FILES` (its pickled `*.bin` weights where it has no
    safetensors)."""
    if kind == "alias":
        from lorp.models.packaged import packaged_gguf

        return [packaged_gguf(ref)]
    if kind == "gguf":
        return [Path(ref)]
    top = [p for p in Path(local_dir).iterdir() if p.is_file() and not p.name.startswith(".")]
    patterns = (
        MODEL_FILES if any(p.suffix == ".safetensors" for p in top) else (*MODEL_FILES, "*.bin")
    )
    return sorted(p for p in top if p.name != META and any(p.match(g) for g in patterns))


def fetch_base(uri: str) -> Path:
    """The local directory of the base stored at `uri`: converted from its GGUF (once, into
    this node's cache), or its files, fetched into the cache once when the storage is
    remote. The caller checks the fingerprint (`lorp.models.variant_manifest.resolve_base`)."""
    storage = Storage(uri)
    if not storage.complete():
        raise FileNotFoundError(f"no stored base at {storage.uri()!r}")
    local = storage.local_path()
    if local is None:
        local = cache_root() / BASES / Path(storage.uri().split("?")[0]).name
        if not (local / META).is_file():
            with contextlib.suppress(FileExistsError):  # another pull here fetched it first
                storage.get_dir("", local, replace=False)
    meta = json.loads((local / META).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{storage.uri()!r}: format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("gguf"):
        from lorp.models.gguf import convert_gguf

        return convert_gguf(local / meta["gguf"], name=meta.get("name"))
    return local
