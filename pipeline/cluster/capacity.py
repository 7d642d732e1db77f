"""What a Ray cluster offers a stage's workers: the largest live node's memory for tasks
(or, before Ray is up, the local node lorp would start), one GPU's memory, and the most
GPUs on one node. The plan (`pipeline.plan.memory`) decides with these figures.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from lorp.models.memory import gib
from pipeline.spec.checks import SpecError
from pipeline.spec.resources import Resources

GPU_PROBE_S = 120.0
"""How long planning waits for a GPU worker to report its device's memory."""


OBJECT_STORE_SHARE = 0.3
"""The share of a machine's memory the embedded local Ray gives its object store (Ray's
own default share, taken of the total rather than of what is free when it starts)."""


def local_node(num_cpus: float | None = None) -> dict[str, float]:
    """What the embedded local Ray is started with (`pipeline.cluster.connect.init_ray`)
    and what a plan made before Ray starts assumes: the machine's total memory (cgroup
    aware) less the object store, never a snapshot of free memory, so another job's
    processes or a full page cache change no decision. The store is capped by /dev/shm."""
    total = system_memory()
    store = int(OBJECT_STORE_SHARE * total)
    if os.path.isdir("/dev/shm"):
        shm = os.statvfs("/dev/shm")
        store = min(store, int(0.95 * shm.f_blocks * shm.f_frsize))
    cpus = float(num_cpus if num_cpus is not None else (os.cpu_count() or 1))
    return {"memory": total - store, "object_store_memory": store, "CPU": cpus, "total": total}


CGROUP_LIMITS = ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory.max")
"""A container's memory limit, cgroups v1's file and v2's, in the order Ray reads them."""


def system_memory(limits: tuple[str, str] = CGROUP_LIMITS) -> int:
    """The machine's total memory as Ray counts it (`ray._common.utils.get_system_memory`,
    whose import brings in all of Ray: half a second of every plan): psutil's total, or
    the container's cgroup limit where one is set and lower."""
    import psutil

    v1, v2 = limits
    limit = None
    if os.path.exists(v1):
        limit = int(Path(v1).read_text().strip())
    elif os.path.exists(v2):
        text = Path(v2).read_text().strip()
        limit = int(text) if text.isnumeric() else None  # "max": no limit
    total = int(psutil.virtual_memory().total)
    return total if limit is None else min(limit, total)


def largest_node(num_cpus: float | None = None) -> tuple[dict[str, float], str]:
    """The resources of the live Ray node with the most memory for tasks, and what they
    are; before Ray is up, the local node this machine would start. A process that has
    not imported Ray has not started it: it is not imported for the question."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return local_node(num_cpus), "this machine (the local Ray lorp starts)"
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    node = max(nodes, key=lambda r: r.get("memory", 0), default={})
    if node.get("memory", 0) <= 0:  # a cluster that reports none: this machine's, to plan on
        return local_node(num_cpus), "this machine (the cluster reports no memory)"
    return node, "the largest Ray node"


def node_memory_bytes(
    resources: Resources, workers: int, stage: str = "grid", num_cpus: float | None = None
) -> tuple[int, str]:
    """One worker's share of the largest node, and the figures it came from: one GPU's
    memory where the stage runs on GPUs (one worker per device, `gpu_memory_bytes`), else
    the node's memory for tasks (its total less the object store) divided among the
    stage's workers that can run on it at once (its CPUs over the worker's)."""
    if resources.num_gpus > 0:
        gpu = gpu_memory_bytes(stage)
        return gpu, f"one GPU's {gib(gpu)}"
    node, where = largest_node(num_cpus)
    memory = int(node.get("memory", 0))
    slots = int(node.get("CPU", 1) // max(resources.num_cpus, 1e-9)) or 1
    share = max(1, min(workers, slots))
    return memory // share, f"{where}: {gib(memory)} for tasks over {share} worker(s)"


_GPU_MEMORY: dict[str, int] = {}
"""Ray cluster (GCS address) -> one GPU's memory, read once per cluster."""


def gpu_memory_bytes(stage: str) -> int:
    """One GPU's memory: the driver's device where it has one, else what a one-GPU Ray
    task reports from a worker node (a head node without GPUs is the common case). A
    SpecError naming `resources.<stage>.memory_gib` when no GPU answers in
    `GPU_PROBE_S` (an autoscaler's GPU nodes still down) or none has CUDA."""
    import ray
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    cluster = ray.get_runtime_context().gcs_address
    if cluster not in _GPU_MEMORY:
        ref = ray.remote(num_gpus=1, num_cpus=0)(_probe).remote()
        try:
            found = ray.get(ref, timeout=GPU_PROBE_S)
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref, force=True)
            found = None
        if not found:
            raise SpecError(
                f"resources.{stage}.memory_gib: the {stage} runs on GPUs and no GPU worker "
                f"reported its memory within {GPU_PROBE_S:g} s; set it to one GPU's memory"
            )
        _GPU_MEMORY[cluster] = int(found)
    return _GPU_MEMORY[cluster]


def _probe() -> int | None:
    """On a GPU worker: its device's memory (None where it has no CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)


def node_gpus() -> int:
    """GPUs of the live node that has the most."""
    import ray

    return int(
        max((n["Resources"].get("GPU", 0) for n in ray.nodes() if n.get("Alive")), default=0)
    )
