"""The speed pass: every variant of one model timed against the dense model in one process
(`run_speed`), groups interleaved until each figure resolves or the time budget is spent.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import ray

from lorp.models.streaming import device_of
from pipeline.cluster.model_source import load_checked
from pipeline.events.timeline import span
from pipeline.messages import SpeedTask
from pipeline.stages.worker_setup import device_for, pin_threads
from pipeline.storage.store import Storage

MAX_SPEED_ROUNDS = 120
"""Rounds at most per group of variants (the budget usually ends them first)."""


def measure_speed(task: SpeedTask) -> dict[str, dict[str, float]]:
    """Per grid key: the dense/pruned prefill timing (`timed_speedups` in
    `pipeline.evaluation.speed`: the median of paired dense/variant ratios over rounds
    that time the dense model once for a group of variants, published once its 95%
    interval is narrow enough; unresolved figures marked) and the variant's peak memory
    in a fresh process (one per distinct kept size). Variants are timed in groups whose
    pruned copies fit half the memory free; the groups share the model's time budget."""
    import copy

    from pipeline.evaluation.speed import timed_speedups

    pin_threads(task.resources.num_cpus)
    lm = load_checked(task.model, device_for(task.resources))
    # Both sides of a timing are private copies: weights read from a memory-mapped file
    # run measurably slower than a copy's, which would flatter every pruned variant.
    dense, dense_dir = copy.deepcopy(lm.model), lm.path
    del lm
    n = task.n_blocks
    units = task.units
    pruned = [(k, layers) for k, layers, _ in task.variants if layers or k in units]
    variant = lambda key, layers: _variant(dense, layers, units.get(key, ()))  # noqa: E731
    per_block = _bytes(dense) / max(n, 1)
    groups = _groups(pruned, lambda layers: per_block * (n - len(layers)), _free_bytes(dense) / 2)
    timing: dict[str, dict[str, float]] = {}
    deadline = time.monotonic() + task.budget_s
    for i, group in enumerate(groups or [[]]):
        copies = {key: variant(key, layers) for key, layers in group}
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
    peaks = _peak_memories(task, dense, dense_dir)
    return {
        key: (timing[key] if layers or key in units else timing[""]) | peaks[key]
        for key, layers, _ in task.variants
    }


def _variant(dense: Any, layers: tuple[int, ...], units: tuple[int, ...]) -> tuple[Any, int]:
    """A pruned copy, sharing nothing with the dense model, and the k of its bound (a
    sub-layer variant's: the blocks its sub-layers are in)."""
    import copy

    from lorp.models.sublayers import remove_sublayers
    from lorp.models.surgery import drop_layers

    pruned = copy.deepcopy(dense)
    if units:
        remove_sublayers(pruned, units)
        return pruned, len({u // 2 for u in units})
    drop_layers(pruned, layers)
    return pruned, len(layers)


def _peak_memories(task: SpeedTask, dense: Any, dense_dir: Path) -> dict[str, dict[str, float]]:
    """Each variant's peak memory. Variants that keep as many blocks of the same bytes load
    the same tensors' sizes and run the same shapes: one fresh process measures them all
    (a repaired twin, or another method's blocks in a model whose blocks are alike)."""
    from lorp.models.architectures import decoder_blocks

    block_bytes = [_bytes(b) for b in decoder_blocks(dense)]
    out, peaks = {}, {}
    for key, layers, checkpoint in task.variants:
        units = task.units.get(key, ())
        size = (len(layers), sum(block_bytes[b] for b in layers), units)
        if size not in peaks:
            peaks[size] = _peak_memory(task, dense_dir, layers, checkpoint, units)
        out[key] = peaks[size]
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
    task: SpeedTask,
    dense_dir: Path,
    layers: tuple[int, ...],
    checkpoint: str | None,
    units: tuple[int, ...] = (),
) -> dict[str, float]:
    """A saved checkpoint (fetched to this node when storage is remote) loads only the
    kept weights; without one, for a manifest, or for a sub-layer variant, the dense model
    loads and drops the blocks (or removes the sub-layers) before the mark is reset."""
    from pipeline.evaluation.peak_memory import peak_memory_fresh

    device, dtype = device_for(task.resources), task.model.dtype
    if units:
        return peak_memory_fresh(str(dense_dir), (), dtype, device, task.seq_len, units)
    if not checkpoint:
        return peak_memory_fresh(str(dense_dir), layers, dtype, device, task.seq_len)
    from lorp.models.variant_manifest import is_manifest

    with Storage(task.storage).fetched(checkpoint) as local:
        if is_manifest(local):  # what it changes: the same tensors' sizes as its base's
            return peak_memory_fresh(str(dense_dir), layers, dtype, device, task.seq_len)
        return peak_memory_fresh(str(local), (), dtype, device, task.seq_len)


@ray.remote(max_retries=1)
def run_speed(task: SpeedTask) -> dict[str, dict[str, float]]:
    with span("speed", model=task.model.label, variants=len(task.variants)):
        return measure_speed(task)
