"""The job's repair settings as one value: what the stages that key, fit and record a
repair read, instead of the whole job. The YAML keeps them at the top level (`repair`,
`repair_rounds`, `repair_ridge`, `repair_followers`, `repair_distill`,
`repair_distill_lr`, `repair_gate`: `JobSpec`'s fields say what each means).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.spec.models import MethodSpec


@dataclass(frozen=True)
class RepairSettings:
    """A job's repair settings (`JobSpec.repair_settings`)."""

    repairs: tuple[str, ...] = ("none", "linear")
    """The grid's repair dimension: none, linear or both."""
    rounds: int = 100
    """A normed fit's rounds at most."""
    ridge: float | str = "auto"
    """The relative ridge: auto (chosen per run on held-out windows) or a number."""
    followers: int = 1
    """Kept blocks after each cut that take a map of their own."""
    distill: int = 0
    """The job's epochs of distillation (a method may set its own)."""
    distill_lr: float = 1e-4
    """Adam's learning rate for distillation."""
    gate: bool = True
    """Judge each repair on the held-out loss per domain."""

    def distill_epochs(self, method: MethodSpec | None) -> int:
        """Epochs of distillation of `method`'s repaired twins: its own, else the job's."""
        own = method.repair_distill if method is not None else None
        return self.distill if own is None else own

    @property
    def ridge_value(self) -> float | None:
        """`ridge` as `lorp.repair.fit.fit_runs` takes it (None: auto)."""
        return None if self.ridge == "auto" else float(self.ridge)
