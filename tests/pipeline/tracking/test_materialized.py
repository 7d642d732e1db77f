"""`tracking.materialize: best` on a real sqlite Model Registry: each `best-<budget>` alias is
written out as a standard checkpoint at a fixed place, left alone while the alias holds,
replaced when it moves; other aliases are not written out."""

from __future__ import annotations

import json
from pathlib import Path

from mlflow.tracking import MlflowClient

from lorp.models.fingerprint import fingerprint_checkpoint
from lorp.models.variant_manifest import BaseRef, materialize_variant, write_manifest
from pipeline.storage.store import Storage
from pipeline.tracking.materialized import (
    MARKER_FILE,
    materialize_aliases,
    materialized_rel,
    materialized_source,
)
from tests.helpers.model_checks import assert_same_checkpoint, full_copy, in_memory
from tests.helpers.tiny_models import save_tiny

NAME = "lorp-tiny"


def test_best_aliases_are_written_out_and_follow_their_alias(tmp_path: Path) -> None:
    base = save_tiny("llama", tmp_path / "base")
    ref = BaseRef(str(base), "dir", fingerprint_checkpoint(base))
    manifest = write_manifest(base, tmp_path / "v-manifest", ref, [1], {"pruned": [1]})
    expected = materialize_variant(manifest, tmp_path / "expected")
    full = full_copy(in_memory(base), [], [2, 3], tmp_path / "v-full", {"pruned": [2, 3]})

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=store, registry_uri=store)
    client.create_registered_model(NAME)
    run = client.create_run(client.create_experiment("e")).info.run_id
    v1 = client.create_model_version(NAME, manifest.resolve().as_uri(), run).version
    v2 = client.create_model_version(NAME, Path(full).resolve().as_uri(), run).version
    storage = Storage(tmp_path / "storage")
    served = tmp_path / "storage" / materialized_rel("tiny", "best-1")

    aliases = {"best-1": str(v1), "best-1-abc123": str(v2), "dense": str(v2)}
    (done,) = materialize_aliases(client, NAME, "tiny", aliases, storage, store)
    assert (done.alias, done.version, done.written) == ("best-1", str(v1), True)
    assert done.uri == str(served)
    assert_same_checkpoint(expected, served)  # the manifest written out
    assert not (served / "lorp_variant.json").exists()
    assert sorted(p.name for p in served.parent.iterdir()) == ["best-1"]  # no other alias
    assert client.get_model_version(NAME, str(v1)).tags["materialized"] == str(served)
    assert client.get_registered_model(NAME).tags["lorp.materialized.best-1"] == str(served)
    assert materialized_source(storage, materialized_rel("tiny", "best-1")) == (
        manifest.resolve().as_uri()
    )

    stamp = (served / MARKER_FILE).stat().st_mtime_ns
    (again,) = materialize_aliases(client, NAME, "tiny", aliases, storage, store)
    assert not again.written and (served / MARKER_FILE).stat().st_mtime_ns == stamp

    (moved,) = materialize_aliases(client, NAME, "tiny", {"best-1": str(v2)}, storage, store)
    assert moved.written and moved.version == str(v2)
    assert_same_checkpoint(Path(full), served)  # the alias's new version, replaced whole
    assert json.loads((served / MARKER_FILE).read_text())["version"] == str(v2)

    # The alias is gone (its budget left the spec): so are its directory and its tag.
    (gone,) = materialize_aliases(client, NAME, "tiny", {"dense": str(v2)}, storage, store)
    assert gone.removed and gone.alias == "best-1" and not served.exists()
    assert "lorp.materialized.best-1" not in client.get_registered_model(NAME).tags


def test_a_write_out_that_fails_is_one_line_and_the_job_goes_on(tmp_path: Path) -> None:
    """On its own thread (the fleet goes on), joined at the job's end: a version whose
    files are gone is one line in the run's failures and an event, not a traceback."""
    from pipeline.tracking.materialized import AliasWriter

    gone = save_tiny("llama", tmp_path / "gone")
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=store, registry_uri=store)
    client.create_registered_model(NAME)
    run = client.create_run(client.create_experiment("e")).info.run_id
    version = client.create_model_version(NAME, gone.resolve().as_uri(), run).version
    for f in gone.iterdir():
        f.unlink()
    gone.rmdir()
    events: list[tuple[str, dict]] = []
    notes: list[str] = []
    failed: list[str] = []

    def event(kind: str, **fields: object) -> None:
        events.append((kind, fields))

    writer = AliasWriter(store, Storage(tmp_path / "storage"), event, notes.append, failed)
    writer.start("tiny", NAME, {"best-2": str(version)})
    writer.join()
    assert len(failed) == 1 and failed[0].startswith("tiny/materialize: ") and "\n" not in failed[0]
    assert str(gone) in failed[0]
    assert events == [("materialize_failed", {"model": "tiny", "cause": failed[0][18:]})]
    assert notes == [] and not (tmp_path / "storage" / "materialized").exists()
