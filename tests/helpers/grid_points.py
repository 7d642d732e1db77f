"""Grid points made by hand for the driver's tests: the points a chosen selection makes on a
planned model (`pipeline.plan.points.ModelGrid`, one per repair of the job), without a
capture or a selection method; and a model's S and profile to record them under."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lorp import Selection
from lorp.locality.profile import Profile
from pipeline.plan.grid import GridPoint, ModelPlan, evaluation_key
from pipeline.plan.points import ModelGrid
from pipeline.spec.job import JobSpec
from pipeline.stages.statistics import ModelStats
from tests.helpers.dashboard_data import similarity_stats

CALIBRATION = "hand-made"
"""The calibration fingerprint the points' model key is made from."""


def model_grid(spec: JobSpec, plan: ModelPlan, backend: str = "transformers") -> ModelGrid:
    """The model's grid as the job's preparation makes it (the dense point only where the
    job evaluates)."""
    ev = spec.evaluation
    evaluation = evaluation_key(ev, backend) if ev.enabled else None
    key = plan.model_key(CALIBRATION)
    return ModelGrid(plan, key, evaluation, spec.repair_settings, spec.saves_checkpoints)


def selected(
    spec: JobSpec,
    plan: ModelPlan,
    layers: tuple[int, ...],
    method: int = 0,
    seconds: float = 0.0,
    **details: Any,
) -> list[GridPoint]:
    """The points of `spec.methods[method]` removing `layers`: one per repair of the job."""
    m = spec.methods[method]
    sel = Selection(layers, m.name, len(layers), plan.n_blocks, details=details)
    made, refused = model_grid(spec, plan).points(m, sel, seconds, "block")
    assert not refused, refused
    return made


def model_stats(plan: ModelPlan, where: Path) -> tuple[ModelStats, Profile]:
    """An S over the model's blocks (residual-like states, not the model's) as a capture
    returns it, saved under `where`, and its profile."""
    from lorp import profile

    stats = similarity_stats(plan.n_blocks)
    file = stats.to_file(where / "S.npz")
    return ModelStats(stats, file, "computed", 1.5, str(file)), profile(stats.matrix())
