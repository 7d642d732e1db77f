"""A model's similarity statistics S: calibration windows, the content-keyed cache, and
the distributed capture when the cache misses. Once per model, whatever the grid. Then,
once the selections are known, the linear repair's sums for every run they remove, on
the same shards and the same capture workers, cached the same way.

The cache key covers the weights (fingerprint), the calibration set (corpus content,
sampling, BOS policy), the capture dtype and the statistics format, so the same checkpoint
under two names shares one S and any change that would alter S captures anew. The cache
is `cache_dir`, else the job's storage (`stats/`) when the job sets one, else
`$LORP_CACHE/stats`.

The windows are cut once on the driver and written as parquet shards into the run
directory (provenance: what S was computed on); capture workers get the windows
themselves through Ray's object store, never a path of the driver.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lorp.locality.similarity_stats import SimilarityStats
from lorp.repair.stats import RepairStats
from pipeline.messages import CaptureTask, FollowerWindows, Shard
from pipeline.plan.grid import ModelPlan, content_key
from pipeline.spec.calibration import CalibrationSpec
from pipeline.spec.resources import Resources
from pipeline.stages.calibration import (
    CalibrationShards,
    HeldOutWindows,
    read_shard,
    write_shards,
)
from pipeline.stages.capture import (
    distributed_capture,
    distributed_repair_capture,
    start_capture_workers,
    stop_workers,
)
from pipeline.stages.settings import StageSettings


@dataclass(frozen=True)
class ModelStats:
    stats: SimilarityStats
    file: Path
    """The local copy of the cached .npz."""
    source: str
    """"cache" or "computed"."""
    seconds: float
    location: str = ""
    """Where the cache keeps it (the catalog's `stats_file`): a path or a storage URI."""
    shards: CalibrationShards | None = None
    """The calibration shards S came from (the repair's sums read the same tokens)."""
    early_workers: int = 0
    """Capture workers started before the shards were cut (unused when S was cached)."""
    units: SimilarityStats | None = None
    """The sub-layer S (2N + 1 boundaries) where the job has a sub-layer granularity:
    then the file holds it and `stats` is its block S (`SimilarityStats.block_stats`)."""


def model_statistics(stage: StageSettings, plan: ModelPlan) -> ModelStats:
    """S of `plan`'s model on the job's calibration set: from the cache, else captured.

    Where the cache has no note of S for this model and calibration spec (its first
    capture, `--force`), the capture workers start before the shards are cut: the model
    loads (minutes for a large one) while the driver loads the tokenizer and cuts the
    windows. The note sits beside S in the cache, so every job sharing it knows; should
    S turn out cached anyway (a note lost), the early workers go unused.
    """
    store, force, run_dir = stage.cache, stage.force, stage.run_dir
    cal, workers = plan.calibration, stage.resources.capture_workers
    units = stage.sublayers  # one capture of the 2N + 1 boundaries serves every granularity
    experts = stage.experts and plan.n_experts > 0
    pointer = f"{plan.stats_key(content_key(asdict(cal)), units, experts)}.name"
    early: list[Any] = []
    noted = store.read_bytes(pointer) is not None
    if force or not noted:
        early = start_capture_workers(_early_task(stage, plan), cal.shards, workers)
    try:
        shards = calibration_shards(cal, plan, run_dir)
        name = f"{plan.stats_key(shards.fingerprint, units, experts)}.npz"
        local = store.local_path(name) or run_dir / "stats" / name  # remote: a working copy
        if not force and store.get_file(name, local):
            if not noted:
                store.write_bytes(pointer, name.encode())
            stop_workers(early)
            stats = _cached(local, plan)
            uri = store.uri(name)
            return _model_stats(stats, local, "cache", 0.0, uri, shards, len(early))
        start = time.perf_counter()
        task = capture_task(stage.resources.capture, cal, plan, shards, units, experts)
        stats = distributed_capture(task, load_shards(shards), workers, actors=early or None)
    except BaseException:
        stop_workers(early)
        raise
    seconds = time.perf_counter() - start
    stats.extra.update({"capture_seconds": seconds, "dtype": plan.spec.dtype})
    stats.to_file(local)
    store.put_file(local, name)
    store.write_bytes(pointer, name.encode())  # after S: a note never points at nothing
    return _model_stats(stats, local, "computed", seconds, store.uri(name), shards, len(early))


def _model_stats(stats: SimilarityStats, *args: Any) -> ModelStats:
    """`ModelStats` of S as captured: a sub-layer S also as its block S."""
    if stats.sublayers:
        return ModelStats(stats.block_stats(), *args, units=stats)
    return ModelStats(stats, *args)


@dataclass(frozen=True)
class ModelRepairStats:
    stats: RepairStats
    source: str
    """"cache" or "computed"."""
    seconds: float
    passes: int
    """Passes over the shards the capture made (0 from the cache)."""
    location: str
    file: Path
    """The local copy of the cached .npz."""


def repair_statistics(
    stage: StageSettings,
    plan: ModelPlan,
    shards: CalibrationShards,
    runs: list[tuple[int, int]],
    units: bool = False,
) -> ModelRepairStats:
    """The repair sums of every run `plan`'s repaired points need, over S's calibration
    shards, and the same sums over the held-out calibration windows (`stats.held`: the
    loss windows, which choose each run's ridge and whether its map is kept), from the
    cache or computed by capture workers: one model load per worker, as few passes as
    `resources.repair_memory_gib` allows (runs deduplicated across methods and budgets;
    runs from one start share A_s). `units`: runs of sub-layer units, summed alike."""
    from lorp.repair.stats import repair_passes

    runs = sorted(set(runs))
    cal, held = plan.calibration, _held_windows(stage, plan)
    key = repair_key(plan, shards, runs, held, units)
    store, name = stage.cache, f"repair-{key}.npz"
    local = store.local_path(name) or stage.run_dir / "stats" / name
    if not stage.force and store.get_file(name, local):
        stats = RepairStats.from_file(local)
        if stats.model_fingerprint != plan.fingerprint or stats.runs != runs:
            raise ValueError(f"cached repair statistics {str(local)!r} are not {plan.label}'s")
        return ModelRepairStats(stats, "cache", 0.0, 0, store.uri(name), local)
    start = time.perf_counter()
    hidden = _hidden_size(plan)
    budget = plan.repair_bytes(int(stage.resources.repair_memory_gib * 2**30))
    try:
        passes = repair_passes(runs, hidden, budget)
    except ValueError as exc:
        raise ValueError(f"resources.repair_memory_gib: {exc}") from None
    task = capture_task(stage.resources.capture, cal, plan, shards)
    workers = stage.resources.capture_workers
    parts = {d: Shard(f"held-out {d}", w.astype(np.int32)) for d, w in held.by_domain().items()}
    stats = distributed_repair_capture(task, load_shards(shards), passes, workers, parts, units)
    seconds = time.perf_counter() - start
    stats.extra.update(
        {"capture_seconds": seconds, "passes": len(passes), "held_out": held.fingerprint}
    )
    stats.to_file(local)
    store.put_file(local, name)
    return ModelRepairStats(stats, "computed", seconds, len(passes), store.uri(name), local)


def repair_key(
    plan: ModelPlan,
    shards: CalibrationShards,
    runs: list[tuple[int, int]],
    held: HeldOutWindows,
    units: bool,
) -> str:
    """The repair sums' cache key: S's calibration shards, the runs, the held-out windows
    and their domains (where there are several), unit runs apart."""
    from lorp.repair.stats import FORMAT_VERSION

    domains = held.domains
    return content_key(
        plan.stats_key(shards.fingerprint),
        "repair",
        FORMAT_VERSION,
        runs,
        held.fingerprint,
        *([sorted(set(domains)), list(domains)] if len(set(domains)) > 1 else []),
        *(["units"] if units else []),
    )


def follower_windows(
    stage: StageSettings, plan: ModelPlan, shards: CalibrationShards
) -> FollowerWindows:
    """The windows a repaired point fits its follower maps on (S's calibration shards, in
    shard order) and validates them, its distillation and its whole repair on (the
    held-out windows, each with its domain): tokens, not sums, since a follower's inputs
    depend on the point's own maps."""
    ev, cal = stage.evaluation, plan.calibration
    windows = np.concatenate([s.windows for s in load_shards(shards)])
    held = _held_windows(stage, plan)
    # Per forward, no more tokens than the point's evaluation takes: its memory plan
    # (`pipeline.plan.memory`) covers the follower's forwards too.
    tokens = plan.batch("evaluate", ev.batch_size) * (ev.seq_len + 1)
    batch = max(1, min(plan.batch("capture", cal.batch_size), tokens // windows.shape[1]))
    skip = int(shards.bos is not None)
    return FollowerWindows(windows, held.windows.astype(np.int32), skip, batch, held.domains)


def _held_windows(stage: StageSettings, plan: ModelPlan) -> HeldOutWindows:
    """The held-out calibration windows (`pipeline.stages.calibration.heldout_windows`)."""
    from pipeline.stages.calibration import heldout_windows

    return heldout_windows(plan_tokenizer(plan), plan.calibration, dict(stage.domains))


def plan_tokenizer(plan: ModelPlan) -> Any:
    """The tokenizer of `plan`'s model, as the driver cuts its windows with."""
    from transformers import AutoTokenizer

    trust = plan.spec.trust_remote_code
    return AutoTokenizer.from_pretrained(str(plan.path), trust_remote_code=trust)


def _hidden_size(plan: ModelPlan) -> int:
    from lorp.models.loading import read_config

    return int(read_config(plan.path)["hidden_size"])  # read_config unnests text_config


def capture_task(
    resources: Resources,
    calibration: CalibrationSpec,
    plan: ModelPlan,
    shards: CalibrationShards,
    sublayers: bool = False,
    experts: bool = False,
) -> CaptureTask:
    """What every capture worker of `plan`'s model receives (`sublayers`: S over the 2N + 1
    sub-layer boundaries; `experts`: the routed experts' sums with it)."""
    return CaptureTask(
        model=plan.source("capture"),
        calibration=shards.fingerprint,
        resources=resources,
        batch_size=plan.batch("capture", calibration.batch_size),
        skip_prefix=int(shards.bos is not None),
        sublayers=sublayers,
        experts=experts,
    )


def _early_task(stage: StageSettings, plan: ModelPlan) -> CaptureTask:
    """The capture task before the shards exist: their calibration comes with them."""
    return CaptureTask(
        model=plan.source("capture"),
        calibration="",
        resources=stage.resources.capture,
        batch_size=plan.batch("capture", plan.calibration.batch_size),
        sublayers=stage.sublayers,
        experts=stage.experts and plan.n_experts > 0,
    )


def load_shards(shards: CalibrationShards) -> list[Shard]:
    """The shards' windows as arrays, named after their files."""
    return [Shard(p.name, read_shard(p).numpy().astype(np.int32)) for p in shards.paths]


def calibration_shards(
    calibration: CalibrationSpec, plan: ModelPlan, run_dir: Path
) -> CalibrationShards:
    """The calibration windows, cut once and written as parquet shards in the run directory."""
    return write_shards(plan_tokenizer(plan), calibration, run_dir / "calibration")


def _cached(path: Path, plan: ModelPlan) -> SimilarityStats:
    stats = SimilarityStats.from_file(path)
    if stats.model_fingerprint != plan.fingerprint:
        raise ValueError(
            f"cached statistics {str(path)!r} belong to model {stats.model_fingerprint}, "
            f"not {plan.label} ({plan.fingerprint})"
        )
    return stats


def describe(ms: ModelStats) -> dict[str, Any]:
    """The capture event's fields."""
    return {
        "source": ms.source,
        "file": ms.location or str(ms.file),
        "seconds": round(ms.seconds, 3),
        "tokens": ms.stats.tokens,
        "early_workers": ms.early_workers,
    }
