"""Per model and stage: hold the model whole in a worker's memory, or stream it.

The sizes come from the checkpoint's safetensors headers (`lorp.models.memory`, no weights read)
and the worker's memory from the spec (`resources.<stage>.memory_gib`) or, by default,
from the cluster: the largest live Ray node's `memory` resource (what Ray lets its tasks
use there) shared among the stage's workers that run on it at once, or a GPU's memory
where the stage runs on GPUs. Decided once per model on
the driver after Ray is up; every worker of the stage then loads the model the same way
(`ModelSource.streamed`).
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import TYPE_CHECKING

from lorp.models.loading import parse_dtype, read_config
from lorp.models.memory import WeightSize, gib, weight_size
from lorp.models.safetensors_index import tensor_index
from lorp.models.shape import ModelShape
from pipeline.cluster.decisions import HEADROOM, Decision, TooLargeError, decide
from pipeline.spec.checks import SpecError
from pipeline.spec.job import JobSpec
from pipeline.spec.resources import Resources

if TYPE_CHECKING:
    from pipeline.plan import ModelPlan

GIB = 1024**3
MAX_EVAL_BATCH = 64
"""Windows per streamed evaluation forward at most (zero-shot items share the batch)."""


FIELDS = {"capture": "capture", "evaluate": "grid"}
"""A stage's `resources.<field>`."""
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
    from ray._common.utils import get_system_memory

    total = int(get_system_memory())
    store = int(OBJECT_STORE_SHARE * total)
    if os.path.isdir("/dev/shm"):
        shm = os.statvfs("/dev/shm")
        store = min(store, int(0.95 * shm.f_blocks * shm.f_frsize))
    cpus = float(num_cpus if num_cpus is not None else (os.cpu_count() or 1))
    return {"memory": total - store, "object_store_memory": store, "CPU": cpus, "total": total}


def largest_node(num_cpus: float | None = None) -> tuple[dict[str, float], str]:
    """The resources of the live Ray node with the most memory for tasks, and what they
    are; before Ray is up, the local node this machine would start."""
    import ray

    if not ray.is_initialized():
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


def worker_bytes(
    resources: Resources, workers: int, stage: str = "grid", num_cpus: float | None = None
) -> tuple[int, str]:
    """The memory one worker of a stage plans with, and which figure it is: the spec's
    `memory_gib`, else its share of the largest node (`node_memory_bytes`)."""
    if resources.memory_gib is not None:
        field = f"resources.{stage}.memory_gib"
        return int(resources.memory_gib * GIB), f"{field}: {resources.memory_gib:g}"
    return node_memory_bytes(resources, workers, stage, num_cpus)


def _repair_sums(repairs: bool, memory_gib: float, plan: ModelPlan, d: int) -> tuple[int, int]:
    """(most, least) bytes of repair sums a capture worker holds, twice (the held-out
    windows'): per pass at most the spec's bound, at most a d x d float64 per run and per
    start for runs that can number N, at least one start's and one run's (one run per
    pass). (0, 0) when the job does not repair. `memory_gib`: the spec's
    `resources.repair_memory_gib`."""
    if not repairs:
        return 0, 0
    one = 2 * 8 * d * d
    return 2 * min(int(memory_gib * GIB), one * plan.n_blocks), 2 * one


FIT_MATRICES = 12
"""d x d float64 matrices a run's fit holds at once: its sums and the held-out ones
(4), the unrepaired map, the regularised pair and its factor (3), the candidate and the
chosen map, and a normed fit's rotation, its update and their products
(`lorp.repair.fit.fit_runs`)."""


def repair_fit_bytes(spec: JobSpec, plan: ModelPlan, shape: ModelShape, itemsize: int) -> int:
    """What a repaired point holds besides its model: one run's (or follower's) fit at a
    time (on the CPU: not counted against a GPU), and a streamed model's fold overrides
    (one `down_proj` per run and per follower, kept while it evaluates, or the
    embeddings for a run from block 0 of an untied model; held whole, the fold's one
    result before it is copied in). 0 without repair. A follower's forwards take the
    evaluation's tokens per batch at most (`pipeline.stages.statistics.follower_windows`),
    so the evaluation's activations cover them."""
    if "linear" not in spec.repair:
        return 0
    # A point removing b blocks folds at most min(b, (n + 1) / 2) runs (runs are apart).
    runs = min(max(plan.budgets, default=0), (plan.n_blocks + 1) // 2)
    units = max((b for _, bs in plan.unit_budgets for b in bs), default=0)
    runs = max(runs, min(units, plan.n_blocks))  # unit runs are apart too: at most N of 2N
    maps = min(runs * (1 + spec.repair_followers), plan.n_blocks)
    down = shape.hidden * shape.intermediate * itemsize
    first = down if plan.tied_embeddings else max(down, shape.vocab * shape.hidden * itemsize)
    fit = FIT_MATRICES * 8 * shape.hidden**2 if spec.resources.grid.num_gpus == 0 else 0
    return fit + first + max(maps - 1, 0) * down + distill_bytes(spec.distills, shape, maps)


DISTILL_COPIES = 5
"""Vocabulary-wide float32 arrays a distillation step holds per position of a chunk: the
dense log-probabilities and their exponential, the pruned logits, their log-softmax and
its gradient."""


def distill_bytes(distills: bool, shape: ModelShape, maps: int) -> int:
    """What `repair_distill` adds to a repaired point: one chunk's log-probabilities
    (`lorp.repair.distill.CHUNK` positions) and every map with Adam's two moments, in float32.
    The backward's activations are those of the blocks after the first map for one step's
    windows (bounded like a follower's forward), fewer than the evaluation's forward
    holds."""
    if not distills:
        return 0
    from lorp.repair.distill import CHUNK

    return DISTILL_COPIES * 4 * CHUNK * shape.vocab + maps * 3 * 4 * shape.hidden**2


SHARDS = (1, 2, 4, 8, 16, 32, 64)
"""Tensor parallel sizes tried, fewest GPUs first."""


def tensor_parallel(
    grid: Resources,
    asked: int | str,
    plan: ModelPlan,
    size: WeightSize,
    shape: ModelShape,
    node_gpus: int | None = None,
) -> int:
    """The GPUs one vLLM engine of this model spans. vLLM holds a whole variant (the
    dense model first), its weights split over them: `evaluation.tensor_parallel_size`
    when the spec sets a number, else the fewest that hold the weights in `HEADROOM` of
    each GPU and divide the attention heads (a number that does not fit is refused, as
    is one no node has the GPUs for). 1 where vLLM does not run on GPUs. `asked` is the
    spec's `evaluation.tensor_parallel_size`, `grid` its grid workers' resources."""
    gpu, _ = worker_bytes(grid, 1)

    def fits(t: int) -> bool:
        heads = shape.heads % t == 0 and (shape.kv_heads % t == 0 or t % shape.kv_heads == 0)
        return heads and size.total / t <= HEADROOM * gpu

    smallest = next((t for t in SHARDS if fits(t)), None)
    if isinstance(asked, int):  # the spec's number, if the weights fit it
        tried, chosen = asked, asked if size.total / asked <= HEADROOM * gpu else None
    else:
        tried, chosen = SHARDS[-1], smallest
    if chosen is None:
        hint = (
            f"set evaluation.tensor_parallel_size: {smallest} (or auto)"
            if smallest
            else "no tensor parallel size up to 64 that divides its attention heads fits"
        )
        raise SpecError(
            f"model {plan.label!r}: its {gib(size.total)} of weights do not fit vLLM on "
            f"{tried} GPU(s) of {gib(gpu)} ({HEADROOM:.0%} usable): {hint}"
        )
    most = _node_gpus() if node_gpus is None else node_gpus
    if chosen > most:
        raise SpecError(
            f"model {plan.label!r} needs vLLM over {chosen} GPUs (tensor_parallel_size) and "
            f"the largest node has {most:g}"
        )
    return chosen


def _node_gpus() -> int:
    """GPUs of the live node that has the most."""
    import ray

    return int(max((n["Resources"].get("GPU", 0) for n in ray.nodes() if n.get("Alive")),
                   default=0))  # fmt: skip


def plan_memory(spec: JobSpec, plan: ModelPlan, backend: str = "transformers") -> ModelPlan:
    """`plan` with its capture and evaluation decisions; SpecError (one line, naming the
    model, the need and the worker) when even a module at a time does not fit."""
    dtype = parse_dtype(plan.spec.dtype)
    itemsize, size = dtype.itemsize, weight_size(tensor_index(plan.path), dtype)
    shape = ModelShape.from_config(read_config(plan.path))
    cal, ev, res = spec.calibration_for(plan.spec), spec.evaluation, spec.resources
    tp = 1
    if backend == "vllm" and res.grid.num_gpus > 0:
        tp = tensor_parallel(res.grid, ev.tensor_parallel_size, plan, size, shape)
    capture_workers = res.capture_workers or cal.shards
    sums = _repair_sums("linear" in spec.repair, res.repair_memory_gib, plan, shape.hidden)
    fit = repair_fit_bytes(spec, plan, shape, itemsize)
    # The most windows one forward may take when streamed: a capture worker's shard (or
    # the held-out calibration windows its repair pass sums), the windows of one corpus.
    shard = max(-(-cal.samples // cal.shards), cal.loss_samples)  # the held-out windows too
    # Capture workers and grid points of a model overlap (unrepaired points run while
    # the repair sums are captured): a node's memory is shared among both.
    workers = capture_workers + res.max_concurrent_points
    stages = {
        "capture": (res.capture, workers, cal.batch_size, cal.seq_len + 1, shard),
        "evaluate": (
            res.grid, workers, ev.batch_size, ev.seq_len + 1, ev.max_windows or MAX_EVAL_BATCH
        ),
    }  # fmt: skip
    decisions: list[tuple[str, Decision]] = []
    for stage, (resources, workers, batch, seq_len, most) in stages.items():
        memory, source = worker_bytes(resources, workers, FIELDS[stage], spec.ray.num_cpus)
        try:
            d = decide(
                stage,  # type: ignore[arg-type]
                size,
                shape,
                worker_bytes=memory,
                batch=batch,
                seq_len=seq_len,
                itemsize=itemsize,
                label=plan.label,
                max_batch=min(most, MAX_EVAL_BATCH) if stage == "evaluate" else most,
                kept_bytes=sums if stage == "capture" else (fit, fit),
                # A CPU grid worker keeps the model it loaded and works on a copy.
                copies=2 if stage == "evaluate" and resources.num_gpus == 0 else 1,
                states=2 * shape.n_blocks + 1 if spec.sublayers else None,  # sub-layer S
                loads_here=resources.num_gpus == 0,  # a GPU worker loads in host memory
            )
        except TooLargeError as exc:
            raise SpecError(f"{exc}; {_room_hint(FIELDS[stage], exc.need_bytes)}") from None
        decisions.append((stage, replace(d, source=source)))
    _check_distill(spec.distills, plan, dict(decisions)["evaluate"])
    return replace(plan, memory=tuple(decisions), tensor_parallel=tp)


def _room_hint(field: str, need: int) -> str:
    """The setting to change and a value that would work: a worker's memory that holds
    `need` bytes within `HEADROOM`, rounded up to half a GiB."""
    value = math.ceil(need / HEADROOM / GIB * 2) / 2
    return f"set resources.{field}.memory_gib: {value:g} (or run on a node with that much)"


def _check_distill(distills: bool, plan: ModelPlan, evaluate: Decision) -> None:
    """Distillation backpropagates through the model: a streamed one would hold it all."""
    if distills:
        why = "distillation trains through the model held whole"
        _held_whole("repair_distill", plan, evaluate, why, "repair_distill: 0")


def _held_whole(field: str, plan: ModelPlan, evaluate: Decision, why: str, fix: str) -> None:
    """One line naming `field` where the plan streams `plan`'s model in its grid points
    and `why` needs it held whole."""
    if evaluate.mode == "streamed":
        raise SpecError(
            f"{field}: {plan.label} is streamed in its grid points (held whole it needs "
            f"{gib(evaluate.memory_bytes)}, a grid worker has {gib(evaluate.worker_bytes)}, "
            f"{evaluate.source}) and {why}; set {fix}, or "
            f"{_room_hint('grid', evaluate.memory_bytes)}"
        )
