"""Content fingerprints: one per config and tensors, whatever the path or sharding, so
cached statistics are shared; kept in lorp's cache without loading a model."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lorp.models.fingerprint import fingerprint_checkpoint
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
