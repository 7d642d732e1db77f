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
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from lorp.models.loading import parse_dtype, read_config
from lorp.models.memory import WeightSize, gib, weight_size
from lorp.models.safetensors_index import tensor_index
from lorp.models.shape import ModelShape
from pipeline.cluster.capacity import node_memory_bytes
from pipeline.plan.decisions import HEADROOM, Decision, TooLargeError, decide
from pipeline.plan.reads import read_model
from pipeline.spec.calibration import CalibrationSpec
from pipeline.spec.checks import SpecError
from pipeline.spec.domains import domains_of
from pipeline.spec.evaluation import EvaluationSpec
from pipeline.spec.job import JobSpec
from pipeline.spec.repair import RepairSettings
from pipeline.spec.resources import Resources

if TYPE_CHECKING:
    import torch

    from pipeline.plan.grid import ModelPlan

GIB = 1024**3
MAX_EVAL_BATCH = 64
"""Windows per streamed evaluation forward at most (zero-shot items share the batch)."""


FIELDS = {"capture": "capture", "evaluate": "grid"}
"""A stage's `resources.<field>`."""


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


def run_sums_bytes(d: int, held_domains: int) -> int:
    """One run's sums as a repaired point fetches them (`lorp.repair.stats.RepairStats`,
    one run at a time: `pipeline.stages.sublayer_points.run_statistics`): its start's
    Gram matrix and its cross matrix, and the same two for each held-out domain's
    windows, d x d float64 each."""
    return (2 + 2 * held_domains) * 8 * d * d


def repair_fit_bytes(
    repair: RepairSettings,
    plan: ModelPlan,
    shape: ModelShape,
    itemsize: int,
    *,
    distills: bool = False,
    on_gpu: bool = False,
    held_domains: int = 1,
) -> int:
    """What a repaired point holds besides its model: one run's (or follower's) sums and
    fit at a time (on the CPU: not counted against a GPU), and a streamed model's fold overrides
    (one `down_proj` per run and per follower, kept while it evaluates, or the
    embeddings for a run from block 0 of an untied model; held whole, the fold's one
    result before it is copied in). 0 without repair. A follower's forwards take the
    evaluation's tokens per batch at most (`pipeline.stages.statistics.follower_windows`),
    so the evaluation's activations cover them, as they do the gate's forwards (no more
    tokens per batch either). `distills`: a repaired point of the job is distilled
    (`JobSpec.distills`); `on_gpu`: the grid's points run on GPUs; `held_domains`: the
    domains of the held-out calibration windows (`run_sums_bytes`)."""
    if "linear" not in repair.repairs:
        return 0
    # A point removing b blocks folds at most min(b, (n + 1) / 2) runs (runs are apart).
    runs = min(max(plan.budgets, default=0), (plan.n_blocks + 1) // 2)
    units = max((b for _, bs in plan.unit_budgets for b in bs), default=0)
    runs = max(runs, min(units, plan.n_blocks))  # unit runs are apart too: at most N of 2N
    maps = min(runs * (1 + repair.followers), plan.n_blocks)
    down = shape.hidden * shape.intermediate * itemsize
    first = down if plan.tied_embeddings else max(down, shape.vocab * shape.hidden * itemsize)
    d = shape.hidden
    fit = 0 if on_gpu else FIT_MATRICES * 8 * d * d + run_sums_bytes(d, held_domains)
    return fit + first + max(maps - 1, 0) * down + distill_bytes(distills, shape, maps)


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
    most = node_gpus() if node_gpus is None else node_gpus
    if chosen > most:
        raise SpecError(
            f"model {plan.label!r} needs vLLM over {chosen} GPUs (tensor_parallel_size) and "
            f"the largest node has {most:g}"
        )
    return chosen


def plan_memory(spec: JobSpec, plan: ModelPlan, backend: str = "transformers") -> ModelPlan:
    """`plan` with its capture and evaluation decisions; SpecError (one line, naming the
    model, the need and the worker) when even a module at a time does not fit."""
    dtype = parse_dtype(plan.spec.dtype)
    size = _weight_size(plan, dtype)
    shape = ModelShape.from_config(read_config(plan.path))
    cal, ev, res = plan.calibration, spec.evaluation, spec.resources
    tp = 1
    if backend == "vllm" and res.grid.num_gpus > 0:
        tp = tensor_parallel(res.grid, ev.tensor_parallel_size, plan, size, shape)
    on_gpu, distills = res.grid.num_gpus > 0, spec.distills
    domains = len(domains_of(cal.corpora, spec.domains))
    fit = repair_fit_bytes(
        spec.repair_settings,
        plan,
        shape,
        dtype.itemsize,
        distills=distills,
        on_gpu=on_gpu,
        held_domains=domains,
    )
    sums = _repair_sums("linear" in spec.repair, res.repair_memory_gib, plan, shape.hidden)
    held = _Held(size, shape, dtype.itemsize, sums, (fit, fit), spec.sublayers, spec.ray.num_cpus)
    # The most windows one forward may take when streamed: a capture worker's shard (or
    # the held-out calibration windows its repair pass sums), the windows of one corpus.
    shard = max(-(-cal.samples // cal.shards), cal.loss_samples)  # the held-out windows too
    # Capture workers and grid points of a model overlap (unrepaired points run while
    # the repair sums are captured): a node's memory is shared among both.
    workers = (res.capture_workers or cal.shards) + res.max_concurrent_points
    most = min(ev.max_windows or MAX_EVAL_BATCH, MAX_EVAL_BATCH)
    decisions = (
        ("capture", held.decide("capture", plan, res.capture, workers, cal, shard)),
        ("evaluate", held.decide("evaluate", plan, res.grid, workers, ev, most)),
    )
    _check_distill(spec.distills, plan, decisions[1][1])
    return replace(plan, memory=decisions, tensor_parallel=tp)


def _weight_size(plan: ModelPlan, dtype: torch.dtype) -> WeightSize:
    """`plan`'s weights at `dtype`, its streamed units those of its model on the meta device
    (a mixture's expert banks, which its files may keep one tensor per expert): read from
    the plan's cache of that model (`pipeline.plan.reads`), not built again."""
    size = weight_size(tensor_index(plan.path), dtype, plan.disk_layout())
    peak = read_model(plan.path, plan.spec.trust_remote_code).unit_peak(dtype.itemsize)
    return replace(size, largest_unit=peak)


@dataclass(frozen=True)
class _Held:
    """What a model's workers hold, stage by stage: its weights (`size`, at `itemsize`
    bytes a value), the repair sums a capture keeps (`sums`), what a repaired point keeps
    beside its model (`fit`), and whether S spans the sub-layer boundaries."""

    size: WeightSize
    shape: ModelShape
    itemsize: int
    sums: int | tuple[int, int]
    fit: tuple[int, int]
    sublayers: bool
    num_cpus: float | None

    def decide(
        self,
        stage: str,
        plan: ModelPlan,
        resources: Resources,
        workers: int,
        windows: CalibrationSpec | EvaluationSpec,
        most: int,
    ) -> Decision:
        """One stage's decision: held whole or streamed, in a worker's memory."""
        memory, source = worker_bytes(resources, workers, FIELDS[stage], self.num_cpus)
        try:
            d = decide(
                stage,  # type: ignore[arg-type]
                self.size,
                self.shape,
                worker_bytes=memory,
                batch=windows.batch_size,
                seq_len=windows.seq_len + 1,
                itemsize=self.itemsize,
                label=plan.label,
                max_batch=most,
                kept_bytes=self.sums if stage == "capture" else self.fit,
                # A CPU grid worker keeps the model it loaded and works on a copy.
                copies=2 if stage == "evaluate" and resources.num_gpus == 0 else 1,
                states=2 * self.shape.n_blocks + 1 if self.sublayers else None,  # sub-layer S
                loads_here=resources.num_gpus == 0,  # a GPU worker loads in host memory
            )
        except TooLargeError as exc:
            raise SpecError(f"{exc}; {_room_hint(FIELDS[stage], exc.need_bytes)}") from None
        return replace(d, source=source)


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
