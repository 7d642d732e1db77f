"""Shared fixtures (helpers live in `tests/helpers/`, never imported from here) and the
order the suite's files run in."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.ray_cluster import CPUS, local_ray
from tests.helpers.states import make_states

# `make test` shares whole files among three processes (pytest-xdist, `--dist loadfile`,
# files handed out in collection order, two to each process at the start, then one to
# whichever has at most two tests left). The files that take minutes (real Ray jobs, two
# nodes, real models) go out first, longest first as measured in a run of the suite, and the
# quick ones fill in behind them, so no process is left alone with a long file at the end.
SLOW_FILES = (
    "integration/test_pipeline.py",
    "integration/test_faults.py",
    "integration/test_pipeline_streamed.py",
    "integration/test_two_nodes.py",
    "integration/test_model_registry.py",
    "integration/test_pipeline_vllm.py",
    "integration/test_pipeline_repair.py",
    "integration/test_pipeline_sublayers.py",
    "integration/test_fleet.py",
    "integration/test_sublayer_vllm.py",
    "integration/test_shared_catalog.py",
    "integration/test_catalog_writers.py",
    "integration/test_dashboard.py",
    "integration/test_real_model.py",
    "integration/test_experts_vllm.py",
    "pipeline/cluster/test_connect.py",
    "integration/test_evaluation.py",
    "pipeline/stages/test_tasks.py",
    "pipeline/evaluation/test_zero_shot.py",
    "pipeline/evaluation/test_peak_memory.py",
    "pipeline/stages/test_points.py",
    "lorp/repair/test_distill.py",
    "lorp/methods/test_removal_loss.py",
    "pipeline/evaluation/test_speed.py",
    "docs/test_gen_reference.py",
    "benchmarks/test_gpu.py",
    "benchmarks/test_gpu_experts.py",
)
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow files first, in `SLOW_FILES` order (paths below tests/); every other file
    and every file's own tests keep pytest's order."""
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.relative_to(TESTS).as_posix(), len(rank)))


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
