"""Ray workers: distributed capture of S, its tree reduction, and grid-point tasks.

Everything crossing a Ray boundary is plain data (paths, tuples, dataclasses, numpy-backed
`SimilarityStats`). Pitfalls, where they bite:

- A capture worker is an actor so the model loads once and serves many shards; each shard
  returns its own partial statistics (nothing accumulates in the actor), so when Ray
  restarts a dead actor and retries a shard, that shard still contributes exactly once.
- torch in a Ray worker would use every core of the node; each worker pins its thread
  count to the CPUs the spec gave it.
- Partials merge pairwise in a tree of small tasks, so the driver never holds all of them.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from lorp.similarity import SimilarityStats
from pipeline.spec import EvaluationSpec, Resources

log = logging.getLogger(__name__)

# Test-only fault hooks: a worker exits hard on this shard / on this grid point's
# checkpoint, once per marker file.
FAULT_SHARD_ENV = "LORP_FAULT_CAPTURE_SHARD"
FAULT_POINT_ENV = "LORP_FAULT_POINT_SUFFIX"
FAULT_MARKER_ENV = "LORP_FAULT_MARKER"


def _pin_threads(num_cpus: float) -> None:
    import torch

    torch.set_num_threads(max(1, int(num_cpus)))


def _load(path: str, dtype: str, device: str, trust_remote_code: bool):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lorp.sources import parse_dtype

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=parse_dtype(dtype), trust_remote_code=trust_remote_code
    )
    model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    return model, tokenizer


def _device(resources: Resources) -> str:
    return "cuda" if resources.num_gpus > 0 else "cpu"


@ray.remote
class CaptureWorker:
    """Holds one loaded model; turns calibration shards into partial statistics."""

    def __init__(
        self,
        model_path: str,
        dtype: str,
        resources: Resources,
        fingerprint: str,
        calibration: str,
        trust_remote_code: bool = False,
    ) -> None:
        _pin_threads(resources.num_cpus)
        self.model, _ = _load(model_path, dtype, _device(resources), trust_remote_code)
        self.fingerprint = fingerprint
        self.calibration = calibration

    def capture(self, shard_path: str, batch_size: int) -> SimilarityStats:
        from lorp.capture import capture_stats
        from pipeline.calibration import read_shard

        _maybe_fail(shard_path)
        windows = read_shard(shard_path)
        batches = [windows[i : i + batch_size] for i in range(0, len(windows), batch_size)]
        return capture_stats(
            self.model,
            batches,
            model_fingerprint=self.fingerprint,
            calibration_fingerprint=self.calibration,
            progress=False,
        )


def _maybe_fail(name: str, env: str = FAULT_SHARD_ENV) -> None:
    target = os.environ.get(env)
    marker = os.environ.get(FAULT_MARKER_ENV)
    if target and marker and Path(name).name.endswith(target) and not Path(marker).exists():
        Path(marker).write_text(str(os.getpid()))
        os._exit(1)  # a hard death mid-shard, as a lost node would look


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


def distributed_capture(
    model_path: str,
    dtype: str,
    shard_paths: list[str],
    batch_size: int,
    resources: Resources,
    fingerprint: str,
    calibration: str,
    trust_remote_code: bool = False,
) -> SimilarityStats:
    """S over all shards with as many capture workers as the cluster fits (<= shards)."""
    available = ray.cluster_resources()
    fits = int(available.get("CPU", 1) // max(resources.num_cpus, 1e-9))
    if resources.num_gpus > 0:
        fits = min(fits, int(available.get("GPU", 0) // resources.num_gpus))
    n_workers = max(1, min(len(shard_paths), fits))
    workers = [
        CaptureWorker.options(
            num_cpus=resources.num_cpus,
            num_gpus=resources.num_gpus,
            max_restarts=3,
            max_task_retries=3,
        ).remote(model_path, dtype, resources, fingerprint, calibration, trust_remote_code)
        for _ in range(n_workers)
    ]
    try:
        partials = [
            workers[i % n_workers].capture.remote(path, batch_size)
            for i, path in enumerate(shard_paths)
        ]
        return tree_reduce(partials)
    finally:
        for w in workers:
            ray.kill(w)


@dataclass(frozen=True)
class PointTask:
    """One grid point's surgery, saving and evaluation, as plain data."""

    grid_key: str
    model_path: str
    dtype: str
    layers: tuple[int, ...]
    checkpoint_dir: str | None
    provenance: dict[str, Any] = field(default_factory=dict)
    evaluation: EvaluationSpec = field(default_factory=EvaluationSpec)
    resources: Resources = field(default_factory=Resources)
    trust_remote_code: bool = False
    backend: str = "transformers"


@ray.remote(max_retries=2)
def run_point(task: PointTask) -> dict[str, Any]:
    """A grid point as a Ray task (the transformers backend)."""
    return execute_point(task)


def execute_point(task: PointTask) -> dict[str, Any]:
    """Drop the blocks, measure dense then pruned speed in this process, save the checkpoint
    atomically, evaluate with transformers unless a vLLM evaluator scores it afterwards;
    returns plain results. `layers=()` is the dense model."""
    from lorp.surgery import drop_layers, save_pruned
    from pipeline.evaluation import evaluate_model
    from pipeline.speed import count_params, peak_memory_gib, prefill_latency, reset_peak_memory

    _pin_threads(task.resources.num_cpus)
    start = time.perf_counter()
    device = _device(task.resources)
    model, tokenizer = _load(task.model_path, task.dtype, device, task.trust_remote_code)
    ev = task.evaluation
    measure = ev.enabled and ev.speed
    metrics: dict[str, float] = {}
    if measure:  # the dense model first, then the pruned one, in this same process
        reset_peak_memory(model.device)
        dense = prefill_latency(model, ev.seq_len, repeats=ev.speed_repeats)
    params_dense = count_params(model)
    n = int(model.config.num_hidden_layers)
    kept = drop_layers(model, task.layers) if task.layers else list(range(n))
    params = count_params(model)
    if measure:
        reset_peak_memory(model.device)
        pruned = (
            prefill_latency(model, ev.seq_len, repeats=ev.speed_repeats) if task.layers else dense
        )
        metrics |= pruned | {
            "speedup": dense["latency_ms"] / pruned["latency_ms"],
            "peak_mem_gib": peak_memory_gib(model.device),
        }
    if task.checkpoint_dir and task.layers:
        _maybe_fail(task.checkpoint_dir, FAULT_POINT_ENV)  # dies mid-checkpoint in tests
        save_pruned(model, tokenizer, task.checkpoint_dir, task.provenance, overwrite=True)
    if ev.enabled and task.backend == "transformers":
        metrics |= evaluate_model(model, tokenizer, ev)
    del model
    return {
        "grid_key": task.grid_key,
        "kept": kept,
        "params": int(params),
        "params_dense": int(params_dense),
        "metrics": metrics,
        "seconds": time.perf_counter() - start,
    }
