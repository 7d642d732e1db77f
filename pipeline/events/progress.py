"""A driver that talks: one log line per capture and per finished point (model, method,
budget, headline figure, elapsed, points left, ETA), and a progress bar on terminals only.

Lines go through the `pipeline` logger at INFO; `lorp run` shows them unless `--quiet`.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("pipeline")


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class Progress:
    """Counts the grid's points and says how far the job is."""

    def __init__(
        self, bar: bool | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """`clock` (seconds) paces the ETA; a test passes its own to know the answer."""
        self.total = self.done = self.failed = 0
        self.clock = clock
        self.start = clock()
        self.bar: Any = None
        self.want_bar = sys.stderr.isatty() if bar is None else bar

    def capture(self, model: str, source: str, seconds: float, tokens: int) -> None:
        how = "from cache" if source == "cache" else f"captured in {duration(seconds)}"
        log.info("S %-24s %s (%s calibration tokens)", model, how, f"{tokens:,}")

    def fleet(self, models: int, in_flight: int, points_at_once: int) -> None:
        """The job's shape: how many models, how many at once, points at once."""
        at_once = "all in flight" if in_flight >= models else f"{in_flight} in flight"
        log.info("fleet: %d model(s), %s, %d point(s) at once", models, at_once, points_at_once)

    def grow(self, n: int) -> None:
        """`n` more points to run (a model's points as they become ready). The first ones
        start the grid's clock: the ETA is the grid's pace, not capture's or selection's."""
        if self.total == 0 and self.done + self.failed == 0:
            self.start = self.clock()
        self.total += n
        if self.want_bar and n and self.bar is None:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, desc="points", unit="pt", leave=False)
        elif self.bar is not None:
            self.bar.total = self.total
            self.bar.refresh()

    def add_points(self, model: str, n: int, skipped: int, preparing: int) -> None:
        """A model's preparation ended: `n` points to run in all (some may have started)."""
        self._write(
            f"{model} ready: {n} points to run, {skipped} already done; "
            f"{preparing} model(s) still preparing"
        )

    def point(self, name: str, figure: str, seconds: float, ok: bool = True) -> None:
        self.done += ok
        self.failed += not ok
        ended = self.done + self.failed
        left = self.total - ended
        elapsed = self.clock() - self.start
        eta = duration(elapsed / ended * left) if ended and left else "-"
        status = figure if ok else f"FAILED: {figure}"
        self._write(
            f"[{ended}/{self.total}] {name}: {status} ({duration(seconds)}); {left} left, ETA {eta}"
        )
        if self.bar is not None:
            self.bar.update(1)

    def note(self, text: str) -> None:
        self._write(text)

    def _write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.clear()
        log.info(line)
        if self.bar is not None:
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
