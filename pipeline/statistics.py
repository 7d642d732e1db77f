"""A model's similarity statistics S: calibration shards, the content-keyed cache, and
the distributed capture when the cache misses. Once per model, whatever the grid.

The cache key covers the weights (fingerprint), the calibration set (corpus content,
sampling, BOS policy), the capture dtype and the statistics format, so the same checkpoint
under two names shares one S and any change that would alter S captures anew.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorp.cache import cache_root
from lorp.similarity import SimilarityStats
from pipeline.calibration import CalibrationShards, write_shards
from pipeline.plan import ModelPlan
from pipeline.spec import JobSpec
from pipeline.workers import CaptureTask, distributed_capture


@dataclass(frozen=True)
class ModelStats:
    stats: SimilarityStats
    file: Path
    """The cached .npz (the catalog's `stats_file`)."""
    source: str
    """"cache" or "computed"."""
    seconds: float


def stats_cache_dir(spec: JobSpec) -> Path:
    return Path(spec.cache_dir) if spec.cache_dir else cache_root() / "stats"


def model_statistics(spec: JobSpec, plan: ModelPlan, run_dir: Path, force: bool) -> ModelStats:
    """S of `plan`'s model on the job's calibration set: from the cache, else captured."""
    shards = _shards(spec, plan, run_dir)
    cache_file = stats_cache_dir(spec) / f"{plan.stats_key(shards.fingerprint)}.npz"
    if cache_file.is_file() and not force:
        return ModelStats(_cached(cache_file, plan), cache_file.resolve(), "cache", 0.0)
    start = time.perf_counter()
    task = CaptureTask(
        model_path=str(plan.path),
        fingerprint=plan.fingerprint,
        dtype=plan.spec.dtype,
        calibration=shards.fingerprint,
        resources=spec.resources.capture,
        trust_remote_code=plan.spec.trust_remote_code,
        batch_size=spec.calibration.batch_size,
        skip_prefix=int(shards.bos is not None),
    )
    stats = distributed_capture(
        task, [str(p) for p in shards.paths], spec.resources.capture_workers
    )
    seconds = time.perf_counter() - start
    stats.extra.update({"capture_seconds": seconds, "dtype": plan.spec.dtype})
    stats.to_file(cache_file)
    return ModelStats(stats, cache_file.resolve(), "computed", seconds)


def _shards(spec: JobSpec, plan: ModelPlan, run_dir: Path) -> CalibrationShards:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(plan.path), trust_remote_code=plan.spec.trust_remote_code
    )
    return write_shards(tokenizer, spec.calibration, run_dir / "calibration")


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
        "file": str(ms.file),
        "seconds": round(ms.seconds, 3),
        "tokens": ms.stats.tokens,
    }
