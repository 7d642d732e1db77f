"""Shared fixtures (helpers live in `tests/helpers/`, never imported from here) and the
order the suite's files run in (`tests.helpers.file_order`)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.file_order import order, read_durations, recorder
from tests.helpers.ray_cluster import CPUS, local_ray
from tests.helpers.states import make_states

TESTS = Path(__file__).resolve().parent
DURATIONS = TESTS / "file_durations.json"
"""Each file's seconds in a measured run of the suite (`make test-durations`)."""


def pytest_configure(config: pytest.Config) -> None:
    """Record each file's seconds where the run asks (`LORP_TEST_DURATIONS`)."""
    record = recorder(config)
    if record is not None:
        config.pluginmanager.register(record, "lorp-file-durations")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files longest first, as measured (`tests.helpers.file_order`)."""
    order(items, TESTS, read_durations(DURATIONS))


@pytest.fixture
def states() -> np.ndarray:
    """[9, 40, 32] states with real depth structure."""
    return make_states(n_states=9, tokens=40, d=32, seed=1)


@pytest.fixture(scope="module")
def ray_cluster(request: pytest.FixtureRequest) -> Iterator[None]:
    """A local Ray for the test module, with the module's `RAY_CPUS` (default `CPUS`)."""
    with local_ray(num_cpus=getattr(request.module, "RAY_CPUS", CPUS)):
        yield


@pytest.fixture
def ray_tmp() -> Iterator[Path]:
    """A private Ray temp root, short: Ray's unix socket paths must fit in 107 bytes."""
    root = Path(tempfile.mkdtemp(prefix="lorpc", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A test that skips fails, unless it needs a GPU (marked `gpu`): `make test` installs
    everything else a test needs, so a skip would be a test that never runs."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if (
        report.skipped
        and item.get_closest_marker("gpu") is None
        and not hasattr(report, "wasxfail")
    ):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = (
            f"skipped outside a GPU test (make test installs what tests need): {reason}"
        )
