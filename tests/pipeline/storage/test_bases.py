"""A manifest's base is stored once per fingerprint below the job's storage (local, file://,
moto's S3), and a variant pulls from that copy when the base is gone from where the job
read it; a copy whose content is another model's is refused in one line naming the base."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from lorp.models.fingerprint import fingerprint_checkpoint
from lorp.models.variant_manifest import (
    BaseRef,
    materialize_variant,
    write_manifest,
)
from pipeline.storage.bases import (
    META,
    base_rel,
    fetch_base,
    store_base,
    stored_base_uri,
)
from pipeline.storage.store import MARKER, Storage
from tests.helpers.model_checks import assert_same_checkpoint
from tests.helpers.tiny_models import save_tiny


def variant_of(base: Path, store: Storage, out: Path) -> Path:
    """An unrepaired variant of the directory `base` as a job writes it: the base named
    by its path, its copy stored below `store` and named in the manifest."""
    fp = fingerprint_checkpoint(base)
    got = store_base(store, str(base), "dir", fp, base)
    assert got is not None and got.written
    ref = BaseRef(str(base), "dir", fp, None, stored_base_uri(store.location, "dir", fp))
    assert ref.stored == got.uri
    return write_manifest(base, out, ref, [1, 2], {"pruned": [1, 2], "grid_key": "k"})


def test_a_variant_pulls_from_the_stored_base_when_its_own_is_gone(
    store: Storage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORP_CACHE", str(tmp_path / "cache"))  # a node that never had it
    base = save_tiny("llama", tmp_path / "base")
    variant = variant_of(base, store, tmp_path / "variant")
    expected = materialize_variant(variant, tmp_path / "from-base")  # resolved as named

    fp = fingerprint_checkpoint(base)
    again = store_base(store, str(base), "dir", fp, base)
    assert again is not None and not again.written  # once per fingerprint
    own = sum(f.stat().st_size for f in base.iterdir())
    marker = len(store.read_bytes(f"{base_rel(fp)}/{MARKER}") or b"")  # S3's completion
    assert again.bytes == own + _meta_bytes(store, fp) + marker == got_bytes(store, fp)

    shutil.rmtree(base)  # the node that planned the job is gone
    with pytest.raises(ValueError, match="is not available or changed"):
        materialize_variant(variant, tmp_path / "nowhere")  # without the stored copy's route
    pulled = materialize_variant(variant, tmp_path / "pulled", fetch=fetch_base)
    assert_same_checkpoint(expected, pulled)
    if store.remote:  # fetched into this node's cache, once
        assert (tmp_path / "cache" / "bases").is_dir()


def got_bytes(store: Storage, fingerprint: str) -> int:
    return store.tree_bytes(base_rel(fingerprint))


def _meta_bytes(store: Storage, fingerprint: str) -> int:
    with store.fetched(base_rel(fingerprint)) as local:
        return (local / META).stat().st_size


def test_a_stored_base_of_other_content_is_refused_in_one_line(tmp_path: Path) -> None:
    store = Storage(tmp_path / "store")
    base = save_tiny("llama", tmp_path / "base")
    variant = variant_of(base, store, tmp_path / "variant")
    stored = store.local_path(base_rel(fingerprint_checkpoint(base)))
    assert stored is not None
    config = json.loads((stored / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3  # another model under the same name
    (stored / "config.json").write_text(json.dumps(config))
    shutil.rmtree(base)
    with pytest.raises(ValueError) as exc:
        materialize_variant(variant, tmp_path / "out", fetch=fetch_base)
    line = str(exc.value)
    assert "\n" not in line and f"base {str(base)!r}" in line
    assert f"stored at {stored}: {str(stored)!r} has fingerprint" in line
    assert not (tmp_path / "out").exists()


def test_a_hub_base_is_named_not_stored(tmp_path: Path) -> None:
    store = Storage(tmp_path / "store")
    assert stored_base_uri(store.location, "hub", "f" * 64) is None
    assert store_base(store, "org/model", "hub", "f" * 64, tmp_path) is None
    assert not (tmp_path / "store").exists()


def test_a_packaged_model_is_stored_as_its_gguf(tmp_path: Path) -> None:
    """A packaged model's copy is the GGUF it is converted from (98 MB for SmolLM2-135M),
    byte for byte, with what it is beside it."""
    from lorp.models.loading import materialize
    from lorp.models.packaged import packaged_gguf
    from tests.helpers.packaged import require

    require("smollm2-135m")
    local = materialize("smollm2-135m")
    fp = fingerprint_checkpoint(local)
    store = Storage(tmp_path / "store")
    got = store_base(store, "smollm2-135m", "alias", fp, local)
    assert got is not None and got.written
    gguf = packaged_gguf("smollm2-135m")
    copy = store.local_path(base_rel(fp))
    assert copy is not None and got.bytes == gguf.stat().st_size + (copy / META).stat().st_size
    meta = json.loads((copy / META).read_text())
    assert meta == {
        "format": "lorp-base/1",
        "ref": "smollm2-135m",
        "kind": "alias",
        "fingerprint": fp,
        "gguf": gguf.name,
        "name": "smollm2-135m",
    }
    digest = hashlib.sha256((copy / gguf.name).read_bytes()).hexdigest()
    assert digest == hashlib.sha256(gguf.read_bytes()).hexdigest()


def test_a_directory_base_is_stored_as_what_loading_reads_and_never_replaced(
    store: Storage, tmp_path: Path
) -> None:
    """Its weights, config and tokenizer files; not its subdirectories (a training
    checkpoint, `original/` weights, `.git`) nor hidden files. A second writer of the same
    fingerprint (another job, or the same base under two labels) leaves the copy as it is."""
    base = save_tiny("llama", tmp_path / "base")
    (base / "checkpoint-100").mkdir()
    (base / "checkpoint-100" / "optimizer.pt").write_bytes(b"x" * 4096)
    (base / ".lock").write_text("")
    (base / "tokenizer_config.json").write_text("{}")
    fp = fingerprint_checkpoint(base)
    first = store_base(store, str(base), "dir", fp, base)
    assert first is not None
    with store.fetched(base_rel(fp)) as copy:
        names = sorted(p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_file())
    own = sorted(p.name for p in base.iterdir() if p.is_file() and not p.name.startswith("."))
    assert [n for n in names if n != MARKER] == sorted([*own, META])
    # A writer that found no copy yet (it checked before the first finished) writes one
    # without removing anything: the copy stays whole, its marker included.
    with store.fetched(base_rel(fp)) as copy:
        shutil.copytree(copy, tmp_path / "same", ignore=shutil.ignore_patterns(MARKER))
    store.put_dir(tmp_path / "same", base_rel(fp), replace=False)
    assert store.complete(base_rel(fp)) and got_bytes(store, fp) == first.bytes
