"""Where the repository is, for tests at any depth of `tests/`."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
