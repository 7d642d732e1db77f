"""Where lorp keeps what it computes once and reuses: converted GGUF checkpoints, assembled
packaged models, fingerprint memos. A module of its own so that every writer of the cache
imports it without importing the others."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$LORP_CACHE`, else ~/.cache/lorp (read at every call, so tests can redirect it)."""
    return Path(os.environ.get("LORP_CACHE") or Path.home() / ".cache" / "lorp")
