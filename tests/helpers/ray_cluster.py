"""A local Ray for a test module: fresh (`address="local"`), never another cluster this
machine knows of, shut down afterwards. Every test that needs Ray starts it here, so the
CPU counts the suite plans for (two test processes on two cores) live in one place."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray

CPUS = 2
"""Enough for a capture worker beside a grid point; the fleet tests ask for more."""


@contextmanager
def local_ray(num_cpus: int = CPUS, **options: Any) -> Iterator[Any]:
    """`ray.init` of a fresh local cluster, yielding its context; shut down after."""
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
