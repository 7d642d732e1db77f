"""Shared fixtures (helpers live in `tests/helpers/`, never imported from here) and the
order the suite's files run in."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from tests.helpers.ray_cluster import CPUS, local_ray
from tests.helpers.states import make_states

# `make test` shares whole files among two processes (pytest-xdist, `--dist loadfile`,
# files handed out in collection order). The files that take minutes (real Ray jobs, two
# nodes, real models, measured under xdist) go out first and the quick ones fill in behind
# them, so neither process is left alone with a long file at the end.
SLOW_FILES = (
    "test_pipeline.py",
    "test_faults.py",
    "test_two_nodes.py",
    "test_shared_catalog.py",
    "test_connect.py",
    "test_pipeline_streamed.py",
    "test_evaluation.py",
    "test_pipeline_repair.py",
    "test_fleet.py",
    "test_dashboard.py",
    "test_model_registry.py",
    "test_real_model.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow files first, in `SLOW_FILES` order; every other file and every file's own
    tests keep pytest's order."""
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture
def states() -> np.ndarray:
    """[9, 40, 32] states with real depth structure."""
    return make_states(n_states=9, tokens=40, d=32, seed=1)


@pytest.fixture(scope="module")
def ray_cluster(request: pytest.FixtureRequest) -> Iterator[None]:
    """A local Ray for the test module, with the module's `RAY_CPUS` (default `CPUS`)."""
    with local_ray(num_cpus=getattr(request.module, "RAY_CPUS", CPUS)):
        yield
