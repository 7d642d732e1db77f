"""The job's progress lines as a list, whatever handlers `pipeline.cli.talk()` installed."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


class _Said(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.INFO)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def progress_lines() -> Iterator[list[str]]:
    """Inside: every line the "pipeline" logger says at INFO is appended to the list."""
    lines: list[str] = []
    said, log = _Said(lines), logging.getLogger("pipeline")
    level = log.level
    log.addHandler(said)
    log.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        log.removeHandler(said)
        log.setLevel(level)
