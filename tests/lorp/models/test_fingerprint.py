"""Content fingerprints: one per config and tensors, whatever the path or sharding, so
cached statistics are shared; kept in lorp's cache without loading a model."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lorp.models.fingerprint import check_readable, fingerprint_checkpoint
from tests.helpers.paths import REPO
from tests.helpers.tiny_models import save_tiny, tiny_model


def test_fingerprint_is_content_not_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORP_CACHE", str(tmp_path / "cache"))
    a = save_tiny("llama", tmp_path / "a")
    b = save_tiny("llama", tmp_path / "b")
    c = save_tiny("llama", tmp_path / "c", seed=1)
    assert fingerprint_checkpoint(a) == fingerprint_checkpoint(b) != fingerprint_checkpoint(c)
    # Sharded differently: same tensors, same fingerprint.
    tiny_model("llama").save_pretrained(tmp_path / "d", max_shard_size="100KB")
    assert len(list((tmp_path / "d").glob("*.safetensors"))) > 1
    assert fingerprint_checkpoint(tmp_path / "d") == fingerprint_checkpoint(a)


def _imports(path: Path, module: str) -> set[str]:
    """Every lorp module `path` imports, at the top or inside a function."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("lorp")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lorp"):
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out - {module}


def test_fingerprint_imports_the_cache_not_the_loader() -> None:
    """Its memo lives in lorp's cache: `lorp.models.fingerprint` imports `lorp.cache` for
    it, never `lorp.models.loading` (which imports the fingerprint)."""
    imported = _imports(REPO / "lorp" / "models" / "fingerprint.py", "lorp.models.fingerprint")
    assert "lorp.cache" in imported and "lorp.models.loading" not in imported


def test_an_unchanged_checkpoint_is_not_hashed_again_and_a_changed_file_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The memo is keyed by each file's size and mtime: a second fingerprint of the same
    files reads it; weights rewritten in place (same names, same sizes) are hashed anew."""
    import lorp.models.fingerprint as fingerprint

    monkeypatch.setenv("LORP_CACHE", str(tmp_path / "cache"))
    a = save_tiny("llama", tmp_path / "a")
    first = fingerprint_checkpoint(a)
    hashed: list[Path] = []
    real = fingerprint._hash_checkpoint
    monkeypatch.setattr(
        fingerprint, "_hash_checkpoint", lambda p, files: hashed.append(p) or real(p, files)
    )
    assert fingerprint_checkpoint(a) == first and not hashed
    tiny_model("llama", seed=1).save_pretrained(a, safe_serialization=True)
    assert fingerprint_checkpoint(a) != first and hashed == [a]


def test_check_readable_names_a_cut_file_as_the_fingerprint_would_without_hashing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lorp.models.fingerprint as fingerprint

    monkeypatch.setattr(fingerprint, "_update_tensor", lambda *a: pytest.fail("hashed"))
    a = save_tiny("llama", tmp_path / "a")
    check_readable(a)  # whole: nothing to say
    f = a / "model.safetensors"
    (a / "model-copy.safetensors").write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model-copy\.safetensors' is not a readable safetens"):
        check_readable(a)
