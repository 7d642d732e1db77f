"""What a model's driver-side stages read of the job: where S, repair sums, selections and
losses are cached, the stages' resources and evaluation, the repair settings, the
corpora's domains. The model's preparation (`pipeline.driver.model_stages`) reads them
from the job once; the stages take this value, not the whole job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from lorp.cache import cache_root
from pipeline.spec.evaluation import EvaluationSpec
from pipeline.spec.repair import RepairSettings
from pipeline.spec.resources import ResourcesSpec
from pipeline.storage.store import Storage


def stats_store(cache_dir: str | None, storage: str | None) -> Storage:
    """Where S files (and loss-guided selections) are cached: the job's `cache_dir`, else
    `stats/` in its `storage`, else lorp's cache."""
    if cache_dir:
        return Storage(cache_dir)
    if storage:
        return Storage(storage).sub("stats")
    return Storage(cache_root() / "stats")


@dataclass(frozen=True)
class StageSettings:
    """The job as its driver-side stages see it."""

    run_dir: Path
    """The driver's run directory: calibration shards and working copies go there."""
    cache: Storage
    """Where S, repair sums, selections and losses are cached (`stats_store`)."""
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)
    evaluation: EvaluationSpec = field(default_factory=EvaluationSpec)
    repair: RepairSettings = field(default_factory=RepairSettings)
    domains: Mapping[str, str] = field(default_factory=dict)
    """Corpus -> its domain, for corpora that are not packaged (`JobSpec.domains`)."""
    sublayers: bool = False
    """Capture S over the 2N + 1 sub-layer boundaries (the job removes sub-layers)."""
    experts: bool = False
    """Capture the routed experts' sums with S, for a model that has experts (the job
    removes experts)."""
    force: bool = False
    """Compute again what the caches hold (`lorp run --force`)."""
