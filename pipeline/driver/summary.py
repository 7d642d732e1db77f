"""What a job did, returned by `run_job` and printed by `lorp run`: points done, skipped
and failed, variants degraded or not repaired, and where the records are."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RunSummary:
    run_dir: Path
    catalog: Path
    """The catalog in the run directory (a working copy when `storage` is set)."""
    tracking_uri: str
    checkpoints: str
    """Where the checkpoints are: an absolute path, or a storage URI."""
    captured: int = 0
    cached: int = 0
    done: int = 0
    skipped: int = 0
    failed: list[str] = field(default_factory=list)
    degraded: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    """Repaired variants not made, with the reason (`pipeline.plan.points.repair_refusal`)."""
    storage: str | None = None
    """The job's storage when it is not the run directory."""
