"""Ray workers: distributed capture of S and its tree reduction, grid-point execution, and
the speed pass.

Everything crossing a Ray boundary is plain data (frozen dataclasses, numpy arrays,
numpy-backed `SimilarityStats`, `PointResult`), and none of it is a path of the driver: a
model travels as its reference (`ModelSource`, resolved on the node that loads it),
calibration windows as arrays in the object store, checkpoints as locations in the job's
storage. Pitfalls, where they bite:

- A capture worker is an actor so the model loads once and serves many shards; each shard
  returns its own partial statistics (nothing accumulates in the actor), so when Ray
  restarts a dead actor and retries a shard, that shard still contributes exactly once.
- Shards go to capture workers as they start, not round-robin up front: a worker still
  waiting for a node (an autoscaler bringing one up, or a cluster too small for the
  spec's count) takes no shard, so nothing waits on it; once every shard is handed out,
  idle and unstarted workers are killed, so a worker Ray restarts after a crash gets
  their resources back instead of waiting behind them.
- torch in a Ray worker would use every core of the node; each worker pins its thread
  count to the CPUs the spec gave it.
- Partials merge pairwise in a tree of small tasks, so the driver never holds all of them.
- A grid point writes its checkpoint from the node that made it: straight into a
  filesystem storage (atomic rename), else into node-local scratch, uploaded with its
  completion marker, then evaluated from that local copy.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray

from lorp.repair_stats import RepairStats
from lorp.similarity import SimilarityStats
from lorp.streaming import device_of
from pipeline.cluster.faults import maybe_fail
from pipeline.cluster.model_source import ModelSource, load_checked
from pipeline.records import timeline
from pipeline.records.rows import PointResult
from pipeline.records.timeline import span
from pipeline.spec import EvaluationSpec, Resources
from pipeline.storage import Storage, scratch_dir

log = logging.getLogger(__name__)


def _pin_threads(num_cpus: float) -> None:
    import torch

    torch.set_num_threads(max(1, int(num_cpus)))


def _device(resources: Resources) -> str:
    return "cuda" if resources.num_gpus > 0 else "cpu"


# -- capture -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CaptureTask:
    """One model's capture: which model, how to run it, what to call the result."""

    model: ModelSource
    calibration: str
    """The calibration fingerprint every partial carries."""
    resources: Resources = field(default_factory=Resources)
    batch_size: int = 1
    skip_prefix: int = 0
    """Leading positions of every window left out of S (1 when windows start with BOS)."""


@dataclass(frozen=True)
class Shard:
    """One calibration shard as data: its name (logs, fault tests) and its windows."""

    name: str
    windows: np.ndarray
    """Token ids [n, T], BOS first where the policy adds one."""


@ray.remote
class CaptureWorker:
    """Holds one loaded model; turns calibration shards into partial statistics."""

    def __init__(self, task: CaptureTask, submitted: float | None = None) -> None:
        start = timeline.actor_start(submitted)
        _pin_threads(task.resources.num_cpus)
        # The decoder stack is all a capture runs: a streamed model's head stays unread.
        self.model = load_checked(task.model, _device(task.resources), head=False).model
        self.task = task
        self._mode = "streamed" if task.model.streamed else "memory"
        timeline.report("load", start, time.time(), model=task.model.label, of="capture")

    def ready(self) -> bool:
        """Answers once the model is loaded: the worker can take shards."""
        return True

    def capture(self, windows: np.ndarray, name: str) -> SimilarityStats:
        from lorp.capture import capture_stats

        maybe_fail("capture", name)
        with span("capture", model=self.task.model.label, shard=name, mode=self._mode):
            return capture_stats(
                self.model,
                self._batches(windows),
                model_fingerprint=self.task.model.fingerprint,
                calibration_fingerprint=self.task.calibration,
                skip_prefix=self.task.skip_prefix,
                progress=False,
            )

    def repair(self, windows: np.ndarray, name: str, runs: list[tuple[int, int]]) -> RepairStats:
        """The partial repair sums of `runs` over one shard (dense inputs, one pass)."""
        from lorp.repair_stats import capture_repair_stats

        maybe_fail("repair", name)
        label = self.task.model.label
        with span("repair_sums", model=label, shard=name, runs=len(runs), mode=self._mode):
            return capture_repair_stats(
                self.model,
                self._batches(windows),
                runs,
                skip_prefix=self.task.skip_prefix,
                model_fingerprint=self.task.model.fingerprint,
                calibration_fingerprint=self.task.calibration,
                progress=False,
            )

    def _batches(self, windows: np.ndarray) -> list[Any]:
        import torch

        ids = torch.from_numpy(np.asarray(windows, dtype=np.int64))
        size = self.task.batch_size
        return [ids[i : i + size] for i in range(0, len(ids), size)]


@ray.remote(num_cpus=0)
def merge_pair(a: Any, b: Any) -> Any:
    """Two partials of the same statistics (`SimilarityStats` or `RepairStats`) merged."""
    return a.merge(b)


def tree_reduce(refs: list[Any]) -> Any:
    """Merge partial statistics pairwise in Ray; the driver fetches only the result."""
    if not refs:
        raise ValueError("no partial statistics to merge")
    while len(refs) > 1:
        merged = [merge_pair.remote(refs[i], refs[i + 1]) for i in range(0, len(refs) - 1, 2)]
        refs = merged + ([refs[-1]] if len(refs) % 2 else [])
    return ray.get(refs[0])


def capture_workers(n_shards: int, workers: int | None) -> int:
    """How many capture workers: the spec's count, else one per shard; never more than
    shards. Decided from the spec alone, so an autoscaler sees the demand."""
    return max(1, min(n_shards, workers or n_shards))


def _start_workers(task: CaptureTask, n: int) -> list[Any]:
    return [
        CaptureWorker.options(
            num_cpus=task.resources.num_cpus,
            num_gpus=task.resources.num_gpus,
            max_restarts=3,
            max_task_retries=3,
            scheduling_strategy="SPREAD",
        ).remote(task, time.time())
        for _ in range(n)
    ]


def distributed_capture(
    task: CaptureTask, shards: list[Shard], workers: int | None = None
) -> SimilarityStats:
    """S over all shards, spread over capture workers (SPREAD: across nodes where it can)."""
    actors = _start_workers(task, capture_workers(len(shards), workers))
    try:
        jobs = [("capture", (ref, s.name)) for ref, s in _put(shards)]
        return tree_reduce(_dispatch(actors, jobs))
    finally:
        for actor in actors:
            ray.kill(actor)


def distributed_repair_capture(
    task: CaptureTask,
    shards: list[Shard],
    passes: list[list[tuple[int, int]]],
    workers: int | None = None,
    held: Shard | None = None,
) -> RepairStats:
    """The repair sums of every run in `passes` over all shards: each worker loads the
    model once and makes one pass per group of runs over each shard it takes (a group's
    sums fit the worker's memory budget, `lorp.repair_stats.repair_passes`); each group's
    partials merge in their own tree, and the groups join into one object. `held`: the
    held-out windows, summed apart by the same workers into the result's `held`."""
    actors = _start_workers(task, capture_workers(len(shards), workers))
    try:
        put = _put(shards + ([held] if held is not None else []))
        jobs = [("repair", (ref, s.name, runs)) for runs in passes for ref, s in put]
        partials = _dispatch(actors, jobs)
        n, k = len(shards), len(put)
        groups = [tree_reduce(partials[i * k : i * k + n]) for i in range(len(passes))]
        held_groups = ray.get([partials[i * k + n] for i in range(len(passes))]) if held else []
    finally:
        for actor in actors:
            ray.kill(actor)
    stats = RepairStats.join(groups)
    if held_groups:
        stats.held = RepairStats.join(held_groups)
    return stats


def _put(shards: list[Shard]) -> list[tuple[Any, Shard]]:
    """Every shard's windows in the object store once, however many passes read them."""
    return [(ray.put(s.windows), s) for s in shards]


def _dispatch(actors: list[Any], jobs: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
    """Each job (a worker method and its arguments) to the next free worker that has
    started; the results' refs, in job order. Once all jobs are handed out, each worker
    that falls idle goes at once, and so do those still starting: their CPUs let a
    restarted worker (retrying the job it died on) come back, and an autoscaler stops
    asking for nodes nobody needs."""
    queue = deque(enumerate(jobs))
    starting = {actor.ready.remote(): actor for actor in actors}
    busy: dict[Any, tuple[Any, int]] = {}
    results: list[Any] = [None] * len(jobs)
    while queue or busy:
        ref = ray.wait([*starting, *busy], num_returns=1)[0][0]
        if ref in starting:
            actor = starting.pop(ref)
            ray.get(ref)  # a worker that cannot load the model fails the capture here
        else:
            actor, i = busy.pop(ref)
            results[i] = ref
        if queue:
            i, (method, args) = queue.popleft()
            busy[getattr(actor, method).remote(*args)] = (actor, i)
            continue
        for idle in [actor, *starting.values()]:
            ray.kill(idle)  # its partial stays in the object store: the driver owns it
        starting.clear()
    return results


# -- grid points -------------------------------------------------------------------------


@dataclass(frozen=True)
class PointTask:
    """One grid point's surgery, saving and evaluation, as plain data."""

    grid_key: str
    model: ModelSource
    layers: tuple[int, ...]
    storage: str
    """The job's storage location (`Storage.location`)."""
    checkpoint: str | None
    """Where the pruned checkpoint goes below `storage`; None: not saved."""
    provenance: dict[str, Any] = field(default_factory=dict)
    evaluation: EvaluationSpec = field(default_factory=EvaluationSpec)
    resources: Resources = field(default_factory=Resources)
    backend: str = "transformers"
    """none, transformers (the model in memory) or vllm (an engine over the checkpoint)."""
    repair: RepairTask | None = None
    """The point's linear repair; None: the blocks are only dropped."""
    name: str = ""
    """The point as log lines and the timeline name it (method, budget, repair)."""


@dataclass(frozen=True)
class RepairTask:
    """What a repaired point needs: its runs' statistics (object-store refs, one per run,
    so a point fetches only the sums of its own runs, each with its held-out sums) and the
    ridge (None: chosen per run on the held-out windows, `lorp.repair.fit_runs`)."""

    runs: tuple[tuple[int, int], ...]
    stats: tuple[Any, ...]
    """One ObjectRef of a one-run `RepairStats` per run, in `runs` order."""
    ridge: float | None
    rounds: int = 100
    """A normed fit's rounds at most (the job's `repair_rounds`)."""
    followers: int = 0
    """Kept blocks after each cut that take a follower map (`lorp.repair.fit_followers`)."""
    windows: Any = None
    """With followers or distillation: an ObjectRef of the model's `FollowerWindows`."""
    distill: int = 0
    """Epochs of distillation of the point's maps (`lorp.distill`); 0: none."""
    distill_lr: float = 1e-4


@dataclass(frozen=True)
class FollowerWindows:
    """What a follower map is fitted on and validated on: the model's calibration windows
    (S's tokens) and its held-out calibration windows, int32 [n, T] each, put in the
    object store once per model."""

    windows: np.ndarray
    held: np.ndarray
    skip_prefix: int
    batch_size: int


def execute_point(task: PointTask) -> PointResult:
    """Fit and fold the repair (if any), drop the blocks, save the checkpoint, evaluate;
    `layers=()` is the dense model."""
    _pin_threads(task.resources.num_cpus)
    try:
        mode = "streamed" if task.model.streamed else "memory"
        with span("point", model=task.model.label, point=task.name, unit=task.grid_key, mode=mode):
            return _execute_point(task)
    finally:
        # The worker process outlives the point: a model kept alive by a reference cycle
        # (transformers' modules, a streamer's hooks) would hold its weights until the
        # collector next ran, and a large model's next point would load beside it.
        gc.collect()


def _execute_point(task: PointTask) -> PointResult:
    from lorp.surgery import drop_layers
    from pipeline.evaluation.speed import count_params

    start = time.perf_counter()
    lm = _point_model(task)
    params_dense = count_params(lm.model)
    fits = _repair(task, lm.model) if task.repair else []
    kept = drop_layers(lm.model, task.layers) if task.layers else list(range(lm.n_blocks))
    params = count_params(lm.model)
    records = [f.record() for f in fits]
    provenance = task.provenance
    if task.repair:
        provenance = {**provenance, "repair": {**(provenance.get("repair") or {}), "runs": records}}
    with scratch_dir() as scratch:
        saved = _save_checkpoint(task, lm, scratch, provenance, fits)
        metrics = _evaluate(task, lm, saved or lm.path)
    seconds = time.perf_counter() - start
    serving = metrics.pop("serving", None) or {}
    info = _zero_shot_info(task.evaluation, metrics)
    return PointResult(
        task.grid_key,
        kept,
        int(params),
        int(params_dense),
        metrics,
        seconds,
        info,
        records,
        serving,
    )


_PRISTINE: dict[tuple[str, str, str], Any] = {}
"""The last dense model this worker process loaded for a grid point (CPU only)."""


def _point_model(task: PointTask) -> Any:
    """The point's dense model: a private copy of the one this worker loaded last when it
    is the same model (a copy costs a fraction of a load: Gemma 3 270M 0.6 s, not 6 s);
    on GPUs and for vLLM points, a fresh load (no second copy held in GPU memory); also
    where the plan found room for one copy only, or streams the model."""
    import copy
    import dataclasses

    device = _device(task.resources)
    if device != "cpu" or task.backend == "vllm" or task.model.streamed or not task.model.pristine:
        return load_checked(task.model, device)
    key = (task.model.ref, task.model.fingerprint, task.model.dtype)
    if key not in _PRISTINE:
        _PRISTINE.clear()  # one model per process: a worker serves one model at a time
        _PRISTINE[key] = load_checked(task.model, device)
    pristine = _PRISTINE[key]
    return dataclasses.replace(pristine, model=copy.deepcopy(pristine.model))


def _repair(task: PointTask, model: Any) -> list[Any]:
    """Fit every run's map from its statistics and fold it into the dense model, here,
    where the checkpoint is made (the fits need the model's own norm weights)."""
    from lorp.repair import check_repairable, fit_runs, fold

    rt = task.repair
    assert rt is not None
    check_repairable(model, task.layers)  # RepairRefused: the point fails with its reason
    fits = []
    for run, ref in zip(rt.runs, rt.stats, strict=True):
        stats = ray.get(ref)
        if stats.model_fingerprint != task.model.fingerprint or stats.runs != [run]:
            raise ValueError(
                f"repair statistics of run {run[0]}-{run[1]} belong to another model or run "
                f"({stats.model_fingerprint}, {stats.runs})"
            )
        fits += fit_runs(model, stats, ridge=rt.ridge, rounds=rt.rounds)
    if rt.followers:
        fits += _followers(task, model, fits)
    if rt.distill:
        fits = _distill(task, model, fits)
    fold(model, fits)  # a streamed model's too: its files get the fold when written
    return fits


def _followers(task: PointTask, model: Any, fits: list[Any]) -> list[Any]:
    """The point's follower maps, fitted on the model's calibration windows with its runs'
    maps applied by hooks (nothing copied: a streamed model too)."""
    import torch

    from lorp.repair import fit_followers

    rt = task.repair
    assert rt is not None and rt.windows is not None
    fw: FollowerWindows = ray.get(rt.windows)
    return fit_followers(
        model, fits, task.layers, torch.from_numpy(fw.windows).long(),
        torch.from_numpy(fw.held).long(), rt.followers, ridge=rt.ridge, rounds=rt.rounds,
        batch_size=fw.batch_size, skip_prefix=fw.skip_prefix,
    )  # fmt: skip


def _distill(task: PointTask, model: Any, fits: list[Any]) -> list[Any]:
    """The point's maps distilled together on the model's calibration windows, validated
    on its held-out windows (`lorp.distill`); one log line per epoch."""
    import torch

    from lorp.distill import DEFAULT_BATCH, distill_fits

    rt = task.repair
    assert rt is not None and rt.windows is not None
    fw: FollowerWindows = ray.get(rt.windows)
    return distill_fits(
        model, fits, task.layers, torch.from_numpy(fw.windows).long(),
        torch.from_numpy(fw.held).long(), epochs=rt.distill, lr=rt.distill_lr,
        batch_size=min(fw.batch_size, DEFAULT_BATCH),
        say=lambda line: log.info("%s %s: %s", task.model.label, task.name, line),
    )  # fmt: skip


def _save_checkpoint(
    task: PointTask, lm: Any, scratch: Path, provenance: dict[str, Any], fits: list[Any]
) -> Path | None:
    """The saved checkpoint's local directory: in a filesystem storage itself (written
    atomically), else in this node's scratch, uploaded (marker last) before evaluation.
    A streamed model's variant is written from the dense model's files, the fold applied
    there (`lorp.file_surgery`): the model in this process has no weights to save."""
    if not (task.checkpoint and task.layers):
        return None
    maybe_fail("point", task.checkpoint)  # dies mid-checkpoint in tests
    storage = Storage(task.storage)
    local = storage.local_path(task.checkpoint) or scratch / "checkpoint"
    if task.model.streamed:  # in the checkpoint's own dtype: a bf16 model's stay bf16
        from lorp.file_surgery import write_pruned_files

        write_pruned_files(lm.path, local, task.layers, provenance, fits=fits, overwrite=True)
    else:
        from lorp.surgery import save_pruned

        save_pruned(lm.model, lm.tokenizer, local, provenance, overwrite=True)
    if storage.remote:
        storage.put_dir(local, task.checkpoint)
    return local


def _evaluate(task: PointTask, lm: Any, model_dir: Path) -> dict[str, Any]:
    """The point's figures: from the model in memory (transformers), or from `model_dir`,
    the local checkpoint (or the dense model's directory on this node) for vLLM (with
    its serving rounds under `serving` when the spec asks for them)."""
    from pipeline.evaluation.backends import (
        TransformersBackend,
        VLLMBackend,
        evaluate,
        open_backend,
    )

    ev = task.evaluation
    if task.backend == "none":
        return {}
    if task.backend == "transformers":
        with open_backend(TransformersBackend(lm.model, lm.tokenizer, ev.batch_size)) as be:
            return evaluate(be, lm.tokenizer, ev)
    tokenizer = lm.tokenizer
    lm.model = None  # the transformers copy goes before the engine comes
    from pipeline.evaluation.vllm_engine import free_memory

    free_memory()
    max_len = ev.seq_len + 8
    if ev.serving is not None:
        max_len = max(max_len, ev.serving.prompt_len + ev.serving.output_len + 8)
    engine = VLLMBackend(
        str(model_dir), task.model.dtype, max_len, ev.tensor_parallel_size,
        task.model.trust_remote_code,
    )  # fmt: skip
    with open_backend(engine) as be:
        return evaluate(be, tokenizer, ev)


def _zero_shot_info(ev: EvaluationSpec, metrics: dict[str, float]) -> dict[str, dict[str, Any]]:
    from pipeline.evaluation.zero_shot import task_split

    return {
        t: {"split": task_split(t), "n": int(metrics[f"n_{t}"])}
        for t in ev.zero_shot
        if f"n_{t}" in metrics
    }


@ray.remote(max_retries=2)
def run_point(task: PointTask) -> PointResult:
    """A grid point as a Ray task (the transformers backend)."""
    return execute_point(task)


@ray.remote
class PointEvaluator:
    """One per GPU, reused across checkpoints: runs whole grid points whose evaluation
    starts a vLLM engine, so one actor owns its GPU end to end and no second task ever
    waits for that GPU; the process (and its imports) outlives each engine."""

    def __init__(self) -> None:
        from pipeline.evaluation.vllm_engine import prepare_vllm

        prepare_vllm()

    def run(self, task: PointTask) -> PointResult:
        return execute_point(task)


# -- the speed pass ----------------------------------------------------------------------


@dataclass(frozen=True)
class SpeedTask:
    """Every variant of one model, timed against the dense model in one process."""

    model: ModelSource
    storage: str
    """The job's storage location, where saved checkpoints are."""
    variants: tuple[tuple[str, tuple[int, ...], str | None], ...]
    """(grid key, pruned blocks, saved checkpoint below `storage` or None); () is dense."""
    seq_len: int
    min_rounds: int = 6
    """Rounds of dense + every variant at least before a figure may resolve."""
    budget_s: float = 300.0
    """Seconds of timing for the whole model (every group), warm-ups included."""
    half_width: float = 0.02
    """The 95% interval's half-width, relative, a published speed-up needs."""
    resources: Resources = field(default_factory=Resources)
    n_blocks: int = 1
    """The dense model's blocks (the speed-up's bound N / (N - k))."""


MAX_SPEED_ROUNDS = 60
"""Rounds at most per group of variants (the budget usually ends them first)."""


def measure_speed(task: SpeedTask) -> dict[str, dict[str, float]]:
    """Per grid key: the dense/pruned prefill timing (`timed_speedups` in
    `pipeline.evaluation.speed`: the median of paired dense/variant ratios over rounds
    that time the dense model once for a group of variants, published once its 95%
    interval is narrow enough; unresolved figures marked) and the variant's peak memory
    in a fresh process. Variants are timed in groups whose pruned copies fit half the
    memory free; the groups share the model's time budget."""
    import copy

    from lorp.surgery import drop_layers
    from pipeline.evaluation.speed import timed_speedups

    _pin_threads(task.resources.num_cpus)
    lm = load_checked(task.model, _device(task.resources))
    # Both sides of a timing are private copies: weights read from a memory-mapped file
    # run measurably slower than a copy's, which would flatter every pruned variant.
    dense, dense_dir = copy.deepcopy(lm.model), lm.path
    del lm
    n = task.n_blocks
    pruned = [(k, layers) for k, layers, _ in task.variants if layers]
    per_block = _bytes(dense) / max(n, 1)
    groups = _groups(pruned, lambda layers: per_block * (n - len(layers)), _free_bytes(dense) / 2)
    timing: dict[str, dict[str, float]] = {}
    deadline = time.monotonic() + task.budget_s
    for i, group in enumerate(groups or [[]]):
        copies = {}
        for key, layers in group:  # a pruned copy shares nothing with the dense model
            pruned_copy = copy.deepcopy(dense)
            drop_layers(pruned_copy, layers)
            copies[key] = (pruned_copy, len(layers))
        figures = timed_speedups(
            dense,
            copies,
            task.seq_len,
            n_blocks=n,
            min_runs=task.min_rounds,
            max_runs=MAX_SPEED_ROUNDS,
            # what is left, shared by the groups left: no group spends the others' time
            budget_s=max(deadline - time.monotonic(), 0.0) / (max(len(groups), 1) - i),
            half_width=task.half_width,
        )
        del copies
        dense_alone = figures.pop("")
        timing.setdefault("", dense_alone)
        timing |= figures
    out = {}
    for key, layers, checkpoint in task.variants:
        figures = timing[key] if layers else timing[""]
        out[key] = figures | _peak_memory(task, dense_dir, layers, checkpoint)
    return out


def _bytes(model: Any) -> float:
    return float(sum(p.numel() * p.element_size() for p in model.parameters()))


def _free_bytes(model: Any) -> float:
    """Memory free where the model lives: the GPU's, else the machine's available RAM."""
    import torch

    device = device_of(model)
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        import psutil

        return float(psutil.virtual_memory().available)
    except ImportError:
        return 4 * _bytes(model)


def _groups(items: list[Any], size: Any, budget: float) -> list[list[Any]]:
    """Consecutive groups whose sizes add up to at most `budget` (at least one each)."""
    groups: list[list[Any]] = []
    total = 0.0
    for item in items:
        cost = size(item[1])
        if groups and total + cost <= budget:
            groups[-1].append(item)
            total += cost
        else:
            groups.append([item])
            total = cost
    return groups


def _peak_memory(
    task: SpeedTask, dense_dir: Path, layers: tuple[int, ...], checkpoint: str | None
) -> dict[str, float]:
    """A saved checkpoint (fetched to this node when storage is remote) loads only the
    kept weights; without one, the dense model loads and drops the blocks."""
    from pipeline.evaluation.speed import peak_memory_fresh

    device, dtype = _device(task.resources), task.model.dtype
    if not checkpoint:
        return peak_memory_fresh(str(dense_dir), layers, dtype, device, task.seq_len)
    with Storage(task.storage).fetched(checkpoint) as local:
        return peak_memory_fresh(str(local), (), dtype, device, task.seq_len)


@ray.remote(max_retries=1)
def run_speed(task: SpeedTask) -> dict[str, dict[str, float]]:
    with span("speed", model=task.model.label, variants=len(task.variants)):
        return measure_speed(task)
