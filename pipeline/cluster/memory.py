"""Per model and stage: hold the model whole in a worker's memory, or stream it.

The sizes come from the checkpoint's safetensors headers (`lorp.sizing`, no weights read)
and the worker's memory from the spec (`resources.<stage>.memory_gib`) or, by default,
from the cluster: the largest live Ray node's `memory` resource (what Ray lets its tasks
use there) shared among the stage's workers that run on it at once, or a GPU's memory
where the stage runs on GPUs. Decided once per model on
the driver after Ray is up; every worker of the stage then loads the model the same way
(`ModelSource.streamed`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from lorp.sizing import Decision, Shape, TooLargeError, decide, tensor_index, weight_size
from lorp.sources import parse_dtype, read_config
from pipeline.spec import JobSpec, Resources, SpecError

if TYPE_CHECKING:
    from pipeline.plan import ModelPlan

GIB = 1024**3
STAGES = ("capture", "evaluate")


def node_memory_bytes(resources: Resources, workers: int) -> int:
    """One worker's share of the largest live node: the GPU's memory where the stage runs
    on GPUs (one worker per device), else Ray's `memory` resource of the node divided
    among the stage's workers that can run on it at once (its CPUs over the worker's)."""
    import ray

    if resources.num_gpus > 0:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(0).total_memory)
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    node = max(nodes, key=lambda r: r.get("memory", 0), default={})
    memory = int(node.get("memory", 0))
    if memory <= 0:  # a cluster that reports none: this machine's, to plan on
        import psutil

        memory = int(psutil.virtual_memory().total)
    slots = int(node.get("CPU", 1) // max(resources.num_cpus, 1e-9)) or 1
    return memory // max(1, min(workers, slots))


def worker_bytes(resources: Resources, workers: int) -> int:
    """The memory one worker of a stage plans with: the spec's `memory_gib`, else its
    share of the largest node (`node_memory_bytes`)."""
    if resources.memory_gib is not None:
        return int(resources.memory_gib * GIB)
    return node_memory_bytes(resources, workers)


def plan_memory(spec: JobSpec, plan: ModelPlan) -> ModelPlan:
    """`plan` with its capture and evaluation decisions; SpecError (one line, naming the
    model, the need and the worker) when even a block at a time does not fit."""
    dtype = parse_dtype(plan.spec.dtype)
    itemsize = dtype.itemsize
    size = weight_size(tensor_index(plan.path), dtype)
    shape = Shape.from_config(read_config(plan.path))
    cal, ev = spec.calibration, spec.evaluation
    res = spec.resources
    capture_workers = res.capture_workers or cal.shards
    stages = {
        "capture": (res.capture, capture_workers, cal.batch_size, cal.seq_len + 1),
        "evaluate": (res.grid, res.max_concurrent_points, ev.batch_size, ev.seq_len + 1),
    }
    decisions: list[tuple[str, Decision]] = []
    for stage, (resources, workers, batch, seq_len) in stages.items():
        try:
            d = decide(
                stage,  # type: ignore[arg-type]
                size,
                shape,
                worker_bytes=worker_bytes(resources, workers),
                batch=batch,
                seq_len=seq_len,
                itemsize=itemsize,
                label=plan.label,
            )
        except TooLargeError as exc:
            raise SpecError(str(exc)) from None
        decisions.append((stage, d))
    return replace(plan, memory=tuple(decisions))
