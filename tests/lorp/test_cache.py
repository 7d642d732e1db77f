"""Where lorp caches what it computes once: `$LORP_CACHE`, read at every call."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorp.cache import cache_root


def test_the_cache_follows_lorp_cache_at_every_call(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LORP_CACHE", str(tmp_path / "a"))
    assert cache_root() == tmp_path / "a"
    monkeypatch.setenv("LORP_CACHE", str(tmp_path / "b"))
    assert cache_root() == tmp_path / "b"
    monkeypatch.delenv("LORP_CACHE")
    assert cache_root() == Path.home() / ".cache" / "lorp"
