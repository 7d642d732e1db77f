"""A local Ray for a test module: fresh (`address="local"`), never another cluster this
machine knows of, shut down afterwards. Every test that needs Ray starts it here, so the
CPU counts the suite plans for (three test processes on two cores) live in one place."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray

CPUS = 2
RAY_CLI = Path(sys.executable).with_name("ray")
"""The `ray` command of this environment, for tests that start nodes as processes."""
"""Enough for a capture worker beside a grid point; the fleet tests ask for more."""


@contextmanager
def local_ray(num_cpus: int = CPUS, **options: Any) -> Iterator[Any]:
    """`ray.init` of a fresh local cluster, yielding its context; shut down after. Its
    memory is set as lorp's own local Ray sets it (`local_node`): from the machine's
    total, so what a test's plan decides does not depend on what else is running."""
    from pipeline.cluster.capacity import local_node

    node = local_node(num_cpus)
    options = {
        "object_store_memory": int(node["object_store_memory"]),
        "_memory": int(node["memory"]),
    } | options
    # Ray's auth mode is the session's (`tests.helpers.RAY_TEST_ENV`), never set here.
    context = ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        logging_level="WARNING",
        **options,
    )
    try:
        yield context
    finally:
        ray.shutdown()
