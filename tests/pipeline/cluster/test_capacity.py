"""What a Ray cluster offers a stage's workers (`pipeline.cluster.capacity`): the local node
lorp starts (the machine's total memory less the object store), the largest node before
and after Ray is up, one worker's share of it, the GPUs of a CPU-only cluster, and the
one line that asks for a GPU's memory where no GPU answers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.cluster import capacity
from pipeline.cluster.capacity import (
    OBJECT_STORE_SHARE,
    gpu_memory_bytes,
    largest_node,
    local_node,
    node_gpus,
    node_memory_bytes,
)
from pipeline.spec.checks import SpecError
from pipeline.spec.resources import Resources
from tests.helpers.ray_cluster import local_ray


@pytest.fixture(scope="module")
def cpu_ray() -> Iterator[None]:
    """A local Ray of 2 CPUs and no GPU, as lorp starts it (`local_node`)."""
    with local_ray(num_cpus=2, num_gpus=0):
        yield


def test_the_local_node_is_the_machines_total_memory_less_the_object_store() -> None:
    from ray._common.utils import get_system_memory

    node = local_node(3)
    total = int(get_system_memory())
    assert node["total"] == total and node["CPU"] == 3.0
    assert node["memory"] + node["object_store_memory"] == total
    shm = os.statvfs("/dev/shm")
    cap = int(0.95 * shm.f_blocks * shm.f_frsize)
    assert node["object_store_memory"] == min(int(OBJECT_STORE_SHARE * total), cap)
    assert local_node()["CPU"] == float(os.cpu_count() or 1)


def test_the_machines_memory_is_rays_and_a_containers_limit_lowers_it(tmp_path: Path) -> None:
    """Counted as Ray counts it, without importing Ray: psutil's total, or a cgroup's
    limit below it (v1's file first; v2's "max" is no limit)."""
    import psutil
    from ray._common.utils import get_system_memory

    assert capacity.system_memory() == int(get_system_memory())
    total = psutil.virtual_memory().total
    v1, v2, absent = tmp_path / "v1", tmp_path / "v2", str(tmp_path / "none")
    v1.write_text(f"{2**30}\n")
    v2.write_text("max\n")
    assert capacity.system_memory((str(v1), str(v2))) == min(2**30, total)
    assert capacity.system_memory((absent, str(v2))) == total
    v2.write_text(f"{2**31}\n")
    assert capacity.system_memory((absent, str(v2))) == min(2**31, total)
    assert capacity.system_memory((absent, absent)) == total
    v1.write_text(f"{2 * total}\n")  # a limit above the machine: the machine's
    assert capacity.system_memory((str(v1), str(v2))) == total


def test_before_ray_is_up_the_largest_node_is_the_local_one() -> None:
    import ray

    assert not ray.is_initialized()
    node, where = largest_node(2)
    assert node == local_node(2)
    assert where == "this machine (the local Ray lorp starts)"


@pytest.mark.integration
def test_a_live_clusters_largest_node_is_what_ray_reports(cpu_ray: None) -> None:
    node, where = largest_node()
    assert where == "the largest Ray node"
    assert node["CPU"] == 2.0 and node["memory"] == local_node(2)["memory"]


@pytest.mark.integration
def test_a_cpu_workers_share_is_the_nodes_memory_over_the_workers_that_fit(
    cpu_ray: None,
) -> None:
    memory = int(largest_node()[0]["memory"])
    share, why = node_memory_bytes(Resources(num_cpus=1), workers=5)
    assert share == memory // 2  # 2 CPUs: two of the five run at once
    assert why.startswith("the largest Ray node: ") and why.endswith("over 2 worker(s)")
    assert node_memory_bytes(Resources(num_cpus=2), workers=5)[0] == memory
    assert node_memory_bytes(Resources(num_cpus=1), workers=1)[0] == memory


@pytest.mark.integration
def test_a_cpu_only_cluster_has_no_gpus(cpu_ray: None) -> None:
    assert node_gpus() == 0


@pytest.mark.integration
def test_without_any_gpu_the_plan_asks_for_the_stages_memory_gib(
    cpu_ray: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe waits for a GPU worker that never comes (1 s here, not 120 s)."""
    import torch

    if torch.cuda.is_available():  # the driver's own device answers
        total = torch.cuda.get_device_properties(0).total_memory
        assert gpu_memory_bytes("capture") == total
        return
    monkeypatch.setattr(capacity, "GPU_PROBE_S", 1.0)
    with pytest.raises(
        SpecError,
        match=r"^resources\.capture\.memory_gib: the capture runs on GPUs and no GPU worker "
        r"reported its memory within 1 s; set it to one GPU's memory$",
    ):
        gpu_memory_bytes("capture")
    assert capacity._GPU_MEMORY == {}  # nothing remembered: a later GPU node is asked again
