"""Ray workers: distributed capture of S and its tree reduction, grid-point execution, and
the speed pass.

Everything crossing a Ray boundary is plain data (paths, tuples, frozen dataclasses,
numpy-backed `SimilarityStats`, `PointResult`). Pitfalls, where they bite:

- A capture worker is an actor so the model loads once and serves many shards; each shard
  returns its own partial statistics (nothing accumulates in the actor), so when Ray
  restarts a dead actor and retries a shard, that shard still contributes exactly once.
- torch in a Ray worker would use every core of the node; each worker pins its thread
  count to the CPUs the spec gave it.
- Partials merge pairwise in a tree of small tasks, so the driver never holds all of them.
- Every worker loads through `lorp.sources.load_model` and refuses a model whose content
  fingerprint is not the one the driver planned with.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import ray

from lorp.similarity import SimilarityStats
from pipeline.faults import maybe_fail
from pipeline.records import PointResult
from pipeline.spec import EvaluationSpec, Resources


def _pin_threads(num_cpus: float) -> None:
    import torch

    torch.set_num_threads(max(1, int(num_cpus)))


def _device(resources: Resources) -> str:
    return "cuda" if resources.num_gpus > 0 else "cpu"


def load_checked(path: str, fingerprint: str, dtype: str, device: str, trust: bool) -> Any:
    """`load_model`, refusing weights other than the ones the driver planned with."""
    from lorp.sources import load_model

    lm = load_model(path, dtype=dtype, device=device, trust_remote_code=trust)
    if fingerprint and lm.fingerprint != fingerprint:
        raise ValueError(
            f"model {path!r} on this node has fingerprint {lm.fingerprint}, "
            f"the driver planned with {fingerprint}"
        )
    return lm


# -- capture -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CaptureTask:
    """One model's capture: where it is, how to run it, what to call the result."""

    model_path: str
    fingerprint: str
    dtype: str
    calibration: str
    resources: Resources = field(default_factory=Resources)
    trust_remote_code: bool = False
    batch_size: int = 1
    skip_prefix: int = 0
    """Leading positions of every window left out of S (1 when windows start with BOS)."""


@ray.remote
class CaptureWorker:
    """Holds one loaded model; turns calibration shards into partial statistics."""

    def __init__(self, task: CaptureTask) -> None:
        _pin_threads(task.resources.num_cpus)
        device = _device(task.resources)
        lm = load_checked(
            task.model_path, task.fingerprint, task.dtype, device, task.trust_remote_code
        )
        self.model, self.task = lm.model, task

    def capture(self, shard_path: str) -> SimilarityStats:
        from lorp.capture import capture_stats
        from pipeline.calibration import read_shard

        maybe_fail("capture", shard_path)
        windows = read_shard(shard_path)
        size = self.task.batch_size
        batches = [windows[i : i + size] for i in range(0, len(windows), size)]
        return capture_stats(
            self.model,
            batches,
            model_fingerprint=self.task.fingerprint,
            calibration_fingerprint=self.task.calibration,
            skip_prefix=self.task.skip_prefix,
            progress=False,
        )


@ray.remote(num_cpus=0)
def merge_pair(a: SimilarityStats, b: SimilarityStats) -> SimilarityStats:
    return a.merge(b)


def tree_reduce(refs: list[Any]) -> SimilarityStats:
    """Merge partial statistics pairwise in Ray; the driver fetches only the result."""
    if not refs:
        raise ValueError("no partial statistics to merge")
    while len(refs) > 1:
        merged = [merge_pair.remote(refs[i], refs[i + 1]) for i in range(0, len(refs) - 1, 2)]
        refs = merged + ([refs[-1]] if len(refs) % 2 else [])
    return ray.get(refs[0])


def capture_workers(task: CaptureTask, n_shards: int, workers: int | None) -> int:
    """How many capture workers: the spec's count, else what the cluster fits now."""
    if workers:
        return max(1, min(n_shards, workers))
    res, available = task.resources, ray.cluster_resources()
    fits = int(available.get("CPU", 1) // max(res.num_cpus, 1e-9))
    if res.num_gpus > 0:
        fits = min(fits, int(available.get("GPU", 0) // res.num_gpus))
    return max(1, min(n_shards, fits))


def distributed_capture(
    task: CaptureTask, shard_paths: list[str], workers: int | None = None
) -> SimilarityStats:
    """S over all shards, spread over capture workers (SPREAD: across nodes where it can)."""
    n = capture_workers(task, len(shard_paths), workers)
    actors = [
        CaptureWorker.options(
            num_cpus=task.resources.num_cpus,
            num_gpus=task.resources.num_gpus,
            max_restarts=3,
            max_task_retries=3,
            scheduling_strategy="SPREAD",
        ).remote(task)
        for _ in range(n)
    ]
    try:
        partials = [actors[i % n].capture.remote(path) for i, path in enumerate(shard_paths)]
        return tree_reduce(partials)
    finally:
        for actor in actors:
            ray.kill(actor)


# -- grid points -------------------------------------------------------------------------


@dataclass(frozen=True)
class PointTask:
    """One grid point's surgery, saving and evaluation, as plain data."""

    grid_key: str
    model_path: str
    fingerprint: str
    dtype: str
    layers: tuple[int, ...]
    checkpoint_dir: str | None
    provenance: dict[str, Any] = field(default_factory=dict)
    evaluation: EvaluationSpec = field(default_factory=EvaluationSpec)
    resources: Resources = field(default_factory=Resources)
    trust_remote_code: bool = False
    backend: str = "transformers"
    """none, transformers (the model in memory) or vllm (an engine over the checkpoint)."""


def execute_point(task: PointTask) -> PointResult:
    """Drop the blocks, save the checkpoint atomically, evaluate; `layers=()` is dense."""
    from lorp.surgery import drop_layers, save_pruned
    from pipeline.speed import count_params

    _pin_threads(task.resources.num_cpus)
    start = time.perf_counter()
    lm = load_checked(
        task.model_path,
        task.fingerprint,
        task.dtype,
        _device(task.resources),
        task.trust_remote_code,
    )
    params_dense = count_params(lm.model)
    kept = drop_layers(lm.model, task.layers) if task.layers else list(range(lm.n_blocks))
    params = count_params(lm.model)
    if task.checkpoint_dir and task.layers:
        maybe_fail("point", task.checkpoint_dir)  # dies mid-checkpoint in tests
        save_pruned(lm.model, lm.tokenizer, task.checkpoint_dir, task.provenance, overwrite=True)
    metrics = _evaluate(task, lm)
    seconds = time.perf_counter() - start
    info = _zero_shot_info(task.evaluation, metrics)
    return PointResult(task.grid_key, kept, int(params), int(params_dense), metrics, seconds, info)


def _evaluate(task: PointTask, lm: Any) -> dict[str, float]:
    from pipeline.backends import TransformersBackend, VLLMBackend, evaluate, open_backend

    ev = task.evaluation
    if task.backend == "none":
        return {}
    if task.backend == "transformers":
        with open_backend(TransformersBackend(lm.model, lm.tokenizer, ev.batch_size)) as be:
            return evaluate(be, lm.tokenizer, ev)
    model_dir = task.checkpoint_dir if task.layers else task.model_path
    tokenizer = lm.tokenizer
    lm.model = None  # the transformers copy goes before the engine comes
    from pipeline.vllm_engine import free_memory

    free_memory()
    max_len = ev.seq_len + 8
    engine = VLLMBackend(str(model_dir), task.dtype, max_len, ev.tensor_parallel_size)
    with open_backend(engine) as be:
        return evaluate(be, tokenizer, ev)


def _zero_shot_info(ev: EvaluationSpec, metrics: dict[str, float]) -> dict[str, dict[str, Any]]:
    from pipeline.zero_shot import task_split

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
        from pipeline.vllm_engine import prepare_vllm

        prepare_vllm()

    def run(self, task: PointTask) -> PointResult:
        return execute_point(task)


# -- the speed pass ----------------------------------------------------------------------


@dataclass(frozen=True)
class SpeedTask:
    """Every variant of one model, timed against the dense model in one process."""

    model_path: str
    fingerprint: str
    dtype: str
    variants: tuple[tuple[str, tuple[int, ...], str | None], ...]
    """(grid key, pruned blocks, saved checkpoint or None); () is the dense model."""
    seq_len: int
    pairs: int = 5
    resources: Resources = field(default_factory=Resources)
    trust_remote_code: bool = False


def measure_speed(task: SpeedTask) -> dict[str, dict[str, float]]:
    """Per grid key: interleaved dense/pruned prefill timing and the variant's peak memory
    in a fresh process."""
    import copy

    from lorp.surgery import drop_layers
    from pipeline.speed import interleaved_speedup, peak_memory_fresh

    _pin_threads(task.resources.num_cpus)
    device = _device(task.resources)
    trust = task.trust_remote_code
    lm = load_checked(task.model_path, task.fingerprint, task.dtype, device, trust)
    # Both sides of a timing are private copies: weights read from a memory-mapped file
    # run measurably slower than a copy's, which would flatter every pruned variant.
    dense = copy.deepcopy(lm.model)
    del lm
    out = {}
    for key, layers, checkpoint in task.variants:
        pruned = None
        if layers:  # a pruned copy shares nothing with the dense model it is timed against
            pruned = copy.deepcopy(dense)
            drop_layers(pruned, layers)
        timing = interleaved_speedup(dense, pruned, task.seq_len, pairs=task.pairs)
        del pruned
        # A saved checkpoint loads only the kept weights; otherwise load dense and drop.
        source, drop = (checkpoint, ()) if checkpoint else (task.model_path, layers)
        mem = peak_memory_fresh(source, drop, task.dtype, device, task.seq_len)
        out[key] = timing | mem
    return out


@ray.remote(max_retries=1)
def run_speed(task: SpeedTask) -> dict[str, dict[str, float]]:
    return measure_speed(task)
