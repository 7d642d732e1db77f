"""The order `make test` hands whole files to its processes: longest first, as measured.

pytest-xdist (`--dist loadfile`) hands files out in collection order, two to each process
at the start, then one to whichever has at most two tests left. A file of minutes handed
out last leaves one process working alone at the end; handed out first, the quick files
fill in behind it. So files go out longest first, by their seconds in a measured run of
the suite (`tests/file_durations.json`, written by `make test-durations`: every test's
setup, call and teardown summed per file). A file the measure does not know yet (a new
one) goes out as the longest known integration file does if it is marked `integration`
(a real job: minutes), else with the quick ones, until the next measure.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import pytest

RECORD_ENV = "LORP_TEST_DURATIONS"
"""Where a run writes its per-file seconds (`make test-durations` sets it)."""


def read_durations(path: Path) -> dict[str, float]:
    """File (below tests/) -> seconds; empty where none were measured."""
    return json.loads(path.read_text()) if path.is_file() else {}


def order(items: list[pytest.Item], tests: Path, durations: Mapping[str, float]) -> None:
    """Sort `items` in place: files longest first (stable: a file's tests, and files of
    equal length, keep pytest's order)."""
    integration = [s for f, s in durations.items() if f.startswith("integration/")]
    unknown_job = max(integration, default=float("inf"))  # none measured: jobs first
    name = {id(item): item.path.relative_to(tests).as_posix() for item in items}
    jobs = {name[id(i)] for i in items if i.get_closest_marker("integration")}
    seconds = {f: durations.get(f, unknown_job if f in jobs else 0.0) for f in name.values()}
    # one figure per file, so a file's tests stay together and in pytest's order
    items.sort(key=lambda item: -seconds[name[id(item)]])


class DurationRecorder:
    """Sums each file's test seconds from the reports (the controller's, under xdist)
    and writes them when the whole suite passed."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        name = report.nodeid.split("::")[0].removeprefix("tests/")
        self.seconds[name] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if exitstatus == 0 and self.seconds:
            self.out.write_text(json.dumps(rounded(self.seconds), indent=1, sort_keys=True) + "\n")


def rounded(seconds: Mapping[str, float]) -> dict[str, float]:
    return {name: round(s, 1) for name, s in seconds.items()}


def recorder(
    config: pytest.Config, environ: Mapping[str, str] = os.environ
) -> DurationRecorder | None:
    """The recorder a run asked for (`LORP_TEST_DURATIONS=<file>`), or None; only in the
    process that sees every report (not an xdist worker, which sees its own files')."""
    out = environ.get(RECORD_ENV)
    worker = hasattr(config, "workerinput")
    return DurationRecorder(Path(out)) if out and not worker else None
