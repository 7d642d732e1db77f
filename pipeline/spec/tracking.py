"""`tracking:`: where MLflow records runs and the Model Registry, and what is registered."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.spec.checks import SpecError

MATERIALIZE = ("none", "best")


@dataclass(frozen=True)
class TrackingSpec:
    mlflow_uri: str | None = None
    """MLflow tracking URI; default: sqlite in the run directory. MLFLOW_TRACKING_URI wins."""
    experiment: str | None = None
    """MLflow experiment name (default: the job name)."""
    register: bool = True
    """Register every saved checkpoint in the MLflow Model Registry when the job ends: one
    registered model per base model (`lorp-<model>`), a version per variant pointing at its
    checkpoint directory (nothing copied), aliases `best-<budget>-<protocol>`,
    `best-<budget>` and `dense`, recomputed over every job's versions of the model."""
    reference: bool = False
    """Make this job's evaluation protocol the reference of its models: the one their
    `best-<budget>` aliases rank in (default: the protocol of the first job that
    registered the model)."""
    materialize: str = "none"
    """`best`: write each `best-<budget>` alias out as a standard checkpoint at
    `<storage>/materialized/<model>/best-<budget>` when the job registers the model (a
    variant stored as a manifest is otherwise one `lorp pull` away from loadable), so a
    serving team can point vLLM at a directory; replaced when the alias moves. `none`:
    nothing written out."""

    def __post_init__(self) -> None:
        if self.materialize not in MATERIALIZE:
            raise SpecError(
                f"materialize: must be one of {', '.join(MATERIALIZE)}, got {self.materialize!r}"
            )
