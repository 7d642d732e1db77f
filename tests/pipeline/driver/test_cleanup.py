"""`lorp gc` (`pipeline.driver.cleanup`) on every storage backend (local, file://, S3 on moto): only
variant directories no catalog row references go, and only when asked; nothing of a job
that may be running, nor of a storage whose catalog is missing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lorp.cli import main
from pipeline.catalog.shared import SharedCatalog
from pipeline.catalog.table import Catalog
from pipeline.driver.cleanup import find_garbage, remove
from pipeline.storage.store import MARKER, Storage

KEPT, ELSEWHERE, GONE = "checkpoints/m/lorp-b1", "checkpoints/m/old-b2", "checkpoints/m/gone-b3"


def catalog_row(job: str, store: Storage, rel: str | None, budget: int) -> dict:  # type: ignore[type-arg]
    return {
        "grid_key": f"{job}-{budget}",
        "job": job,
        "model": "m",
        "method_label": "lorp",
        "budget": budget,
        "created_at": "2026-12-04T00:00:00",
        "checkpoint": store.uri(rel) if rel else None,
        "storage": store.uri(),
    }


@pytest.fixture
def variants(store: Storage, tmp_path: Path) -> dict[str, str]:  # type: ignore[type-arg]
    """Three stored variants and a copy its writer never finished: one in the job's own
    catalog, one only in a shared catalog (a row of another job that wrote here), one in
    none. Returns the names, the shared catalog and the half copy's directory."""
    src = tmp_path / "variant"
    src.mkdir()
    (src / "lorp_variant.json").write_text('{"format": "lorp-variant/1"}')
    (src / "lorp_changes.safetensors").write_bytes(b"x" * 4096)
    for rel in (KEPT, ELSEWHERE, GONE):
        store.put_dir(src, rel)
    if store.remote:  # the files, and no completion marker
        half = "checkpoints/m/half-b4"
        store.write_bytes(f"{half}/lorp_changes.safetensors", b"y" * 1000)
    else:
        half = "checkpoints/m/.half-b4.partial"
        (store.local_path(half) / "x").parent.mkdir(parents=True)
        store.local_path(half).joinpath("x").write_bytes(b"y" * 1000)
    own = Catalog(tmp_path / "run" / Catalog.NAME, store)  # the job's table, in its storage
    for row in (catalog_row("j", store, KEPT, 1), catalog_row("j", store, None, 0)):
        own.put(row)
    shared = SharedCatalog(str(tmp_path / "shared"))
    shared.publish("run-other", [catalog_row("other", store, ELSEWHERE, 2)])
    return {"shared": str(tmp_path / "shared"), "half": half}


def stored(store: Storage) -> list[str]:
    return [f"checkpoints/m/{d}" for d in store.subdirs("checkpoints/m")]


def test_only_what_no_row_references_goes(store: Storage, variants: dict[str, str]) -> None:
    before = stored(store)
    assert len(before) == 4
    found = find_garbage(store.location, [variants["shared"]])
    assert found.referenced == 2 and found.running is None
    assert sorted(rel for rel, _ in found.unreferenced) == sorted([GONE, variants["half"]])
    marker = len(store.read_bytes(f"{GONE}/{MARKER}") or b"")  # an object store's only
    assert dict(found.unreferenced) == {GONE: 4096 + 28 + marker, variants["half"]: 1000}
    assert stored(store) == before  # finding removes nothing
    alone = find_garbage(store.location)  # without the shared catalog: its row's goes too
    assert sorted(rel for rel, _ in alone.unreferenced) == sorted(
        [ELSEWHERE, GONE, variants["half"]]
    )
    assert remove(found) == 4096 + 28 + marker + 1000
    assert stored(store) == sorted([KEPT, ELSEWHERE])
    assert store.complete(KEPT) and store.complete(ELSEWHERE)
    assert find_garbage(store.location, [variants["shared"]]).unreferenced == []


def test_written_out_aliases_follow_their_variant_and_whole_bases_stay(
    store: Storage, variants: dict[str, str], tmp_path: Path
) -> None:
    """`materialized/` (`tracking.materialize`) goes with the variant it was written from;
    one from another storage, which this one cannot judge, stays. A stored base stays
    whole; a copy of one a killed job never finished goes."""
    src = tmp_path / "served"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"z" * 512)
    sources = {"best-1": store.uri(KEPT), "best-2": store.uri(GONE), "best-3": "/elsewhere/v"}
    for alias, source in sources.items():
        (src / "lorp_materialized.json").write_text(json.dumps({"source": source}))
        store.put_dir(src, f"materialized/m/{alias}")
    store.put_dir(src, "bases/0123456789abcdef")
    if store.remote:  # the files, and no completion marker
        half = "bases/fedcba9876543210"
        store.write_bytes(f"{half}/model.gguf", b"g" * 700)
    else:
        half = "bases/.fedcba9876543210.partial"
        store.local_path(half).mkdir(parents=True)
        store.local_path(half).joinpath("model.gguf").write_bytes(b"g" * 700)
    found = find_garbage(store.location, [variants["shared"]])
    assert sorted(rel for rel, _ in found.unreferenced) == sorted(
        [GONE, variants["half"], "materialized/m/best-2", half]
    )
    assert found.referenced == 2 + 2  # KEPT, ELSEWHERE; best-1, best-3
    remove(found)
    assert store.subdirs("materialized/m") == ["best-1", "best-3"]
    assert store.subdirs("bases") == ["0123456789abcdef"] and store.complete(
        "bases/0123456789abcdef"
    )


def events(store: Storage, *records: dict) -> None:  # type: ignore[type-arg]
    store.write_bytes("events.jsonl", "".join(json.dumps(r) + "\n" for r in records).encode())


def test_nothing_of_a_job_that_may_be_running(store: Storage, variants: dict[str, str]) -> None:
    here = socket.gethostname()
    start = {"event": "start", "job": "j", "pid": os.getpid(), "host": here}
    events(store, start)  # this very process: alive
    found = find_garbage(store.location, [variants["shared"]])
    assert found.running == "running" and found.unreferenced == []
    assert remove(found) == 0 and len(stored(store)) == 4
    events(store, start | {"host": "another-host"})  # cannot be looked at: counts as running
    assert find_garbage(store.location).running == "running or interrupted"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    events(store, start | {"pid": int(dead.stdout)})  # killed: its leftovers may go
    assert len(find_garbage(store.location, [variants["shared"]]).unreferenced) == 2
    events(store, start, {"event": "end"})
    assert len(find_garbage(store.location, [variants["shared"]]).unreferenced) == 2


def test_a_storage_without_a_catalog_keeps_everything(store: Storage, tmp_path: Path) -> None:
    src = tmp_path / "v"
    src.mkdir()
    (src / "f").write_bytes(b"z")
    store.put_dir(src, GONE)
    with pytest.raises(FileNotFoundError, match=r"^no catalog at .*: nothing says which"):
        find_garbage(store.location)
    assert stored(store) == [GONE]


def test_lorp_gc_is_a_dry_run_unless_told(
    store: Storage, variants: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["gc", store.location, "--catalog", variants["shared"]]
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == sorted(out[:2]) and {ln.split()[2] for ln in out[:2]} == {
        GONE,
        variants["half"],
    }
    assert all(ln.startswith("would remove ") for ln in out[:2])
    assert out[2] == (
        f"gc {store.uri()}: 2 variant(s) referenced by catalog rows, 2 not referenced (0.0 MiB)"
    )
    assert out[3] == "dry run: nothing removed; --delete removes them"
    assert len(stored(store)) == 4
    assert main([*args, "--delete"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("removed ")
    assert stored(store) == sorted([KEPT, ELSEWHERE])
