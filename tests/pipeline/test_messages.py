"""What crosses to a Ray worker (`pipeline.messages`): the held-out windows by domain, and
every task and result through a real Ray object store and a worker process, equal to
what was sent (windows as arrays, nested object refs still resolving)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray

from pipeline.cluster.model_source import ModelSource
from pipeline.messages import (
    CaptureTask,
    FollowerWindows,
    LossTask,
    PointResult,
    PointTask,
    RepairTask,
    Shard,
    SpeedTask,
)
from pipeline.spec.evaluation import EvaluationSpec
from pipeline.spec.resources import Resources
from tests.helpers.ray_cluster import local_ray

SOURCE = ModelSource("/models/tiny", "dir", fingerprint="f" * 16, label="tiny")
WINDOWS = np.arange(24, dtype=np.int32).reshape(4, 6)
HELD = np.arange(100, 130, dtype=np.int32).reshape(5, 6)


@pytest.fixture(scope="module")
def worker() -> Iterator[Any]:
    """A local Ray, and a task that sends back what a worker process received (a closure:
    Ray ships it by value, the messages it carries by reference to `pipeline.messages`)."""
    with local_ray(num_cpus=1):
        yield ray.remote(num_cpus=1)(lambda message: message)


def test_held_out_windows_by_domain_in_the_order_first_met() -> None:
    fw = FollowerWindows(WINDOWS, HELD, 1, 2, ("prose", "code", "prose", "code", "code"))
    by_domain = fw.held_by_domain()
    assert list(by_domain) == ["prose", "code"]
    np.testing.assert_array_equal(by_domain["prose"], HELD[[0, 2]])
    np.testing.assert_array_equal(by_domain["code"], HELD[[1, 3, 4]])


def test_held_out_windows_without_domains_are_one_unnamed_domain() -> None:
    by_domain = FollowerWindows(WINDOWS, HELD, 0, 4).held_by_domain()
    assert list(by_domain) == [""] and by_domain[""] is HELD


@pytest.mark.integration
def test_tasks_and_results_come_back_from_a_worker_equal(worker: Any) -> None:
    ev = EvaluationSpec(perplexity=("ptb", "lee"), seq_len=48, max_windows=2)
    point = PointTask(
        "key-1",
        SOURCE,
        (2, 3),
        "/store",
        "checkpoints/tiny/shortgpt-b2",
        provenance={"method": "shortgpt", "pruned": [2, 3]},
        evaluation=ev,
        resources=Resources(num_cpus=2),
        name="shortgpt-b2",
    )
    speed = SpeedTask(SOURCE, "/store", (("key-1", (2, 3), None), ("d", (), None)), 48, n_blocks=6)
    capture = CaptureTask(SOURCE, "cal-1", batch_size=4, skip_prefix=1, sublayers=True)
    result = PointResult(
        "key-1",
        [0, 1, 4, 5],
        900,
        1200,
        {"ppl_ptb": 31.5},
        2.0,
        repair=[{"residual": 0.2}],
        peak_gib=0.3,
    )
    for message in (point, speed, capture, result):
        assert ray.get(worker.remote(message)) == message
        assert ray.get(ray.put(message)) == message


@pytest.mark.integration
def test_windows_cross_as_arrays_and_nested_refs_still_resolve(worker: Any) -> None:
    shard = ray.get(worker.remote(Shard("shard-0000", WINDOWS)))
    assert shard.name == "shard-0000"
    np.testing.assert_array_equal(shard.windows, WINDOWS)
    loss = ray.get(worker.remote(LossTask(SOURCE, HELD, batch_size=2)))
    assert (loss.model, loss.batch_size) == (SOURCE, 2)
    np.testing.assert_array_equal(loss.windows, HELD)
    assert loss.windows.dtype == np.int32

    fw = FollowerWindows(WINDOWS, HELD, 1, 2, ("prose", "code", "prose", "code", "code"))
    domains = ray.get(worker.remote(fw)).held_by_domain()
    assert list(domains) == ["prose", "code"]
    np.testing.assert_array_equal(domains["code"], HELD[[1, 3, 4]])
    sums, windows = ray.put({"run": (2, 3)}), ray.put(fw)
    repair = RepairTask(((2, 3),), (sums,), None, followers=1, windows=windows, distill=2)
    back = ray.get(worker.remote(repair))
    assert (back.runs, back.ridge, back.followers, back.distill) == (((2, 3),), None, 1, 2)
    assert ray.get(back.stats[0]) == {"run": (2, 3)}
    np.testing.assert_array_equal(ray.get(back.windows).held, HELD)
