"""`resources:` and `ray:`: what each stage's workers ask Ray for (CPUs, GPUs, memory), how
many grid points run at once, and the cluster a job connects to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pipeline.spec.checks import SpecError, is_number, positive


@dataclass(frozen=True)
class Resources:
    num_cpus: float = 1
    """CPUs per Ray task/actor (also its torch thread count)."""
    num_gpus: float = 0
    """GPUs per Ray task/actor (1 on a GPU cluster)."""
    memory_gib: float | None = None
    """Memory one worker of this stage may use, GiB: the model is held whole when it fits
    with the stage's activations, else streamed a module at a time (`lorp.models.memory`). Default:
    the largest Ray node's memory (its devices' memory on GPUs)."""

    def __post_init__(self) -> None:
        for name in ("num_cpus", "num_gpus"):
            value = getattr(self, name)
            if value < 0 or not math.isfinite(value):
                raise SpecError(f"{name}: must be >= 0, got {value}")
        if self.memory_gib is not None and not (is_number(self.memory_gib) and self.memory_gib > 0):
            raise SpecError(f"memory_gib: must be a number > 0, got {self.memory_gib!r}")


@dataclass(frozen=True)
class ResourcesSpec:
    capture: Resources = field(default_factory=Resources)
    """Per capture worker (one loaded model, many shards)."""
    grid: Resources = field(default_factory=Resources)
    """Per grid-point task (surgery, saving, evaluation)."""
    max_concurrent_points: int = 2
    """Grid points in flight at once (each holds one model copy)."""
    capture_workers: int | None = None
    """Capture workers per model (spread across nodes); default: one per calibration shard
    (`calibration.shards`). Fixed by the spec, not by what the cluster holds at the start,
    so an autoscaler brings up nodes for them; shards go to workers as they start, so a
    worker that never gets a node only goes unused."""
    speed: Resources | None = None
    """Per speed-pass task (one per model, after the grid); default: a whole node."""
    loss_workers: int | None = None
    """Actors scoring a loss-guided selection's candidates (each holds the dense model and
    a `grid` slot while the selection runs); default: `max_concurrent_points`."""
    max_models_in_flight: int | None = None
    """Models whose stages (capture, selections, points, speed, gate, registry) run at
    once; default: all of them, each waiting only for slots. Bounds the driver's memory
    (each model in flight holds its S and selections); 1 runs one model after another."""
    repair_memory_gib: float = 4.0
    """Memory of the repair sums one capture worker holds in a pass: one d x d float64
    per run start and per run (134 MB each at d = 4096, 2.7 MB at d = 576). Runs beyond
    it take further passes over the worker's shards, so a worker's memory stays bounded."""

    def __post_init__(self) -> None:
        positive("max_concurrent_points", self.max_concurrent_points)
        if not is_number(self.repair_memory_gib) or not self.repair_memory_gib > 0:
            value = self.repair_memory_gib
            raise SpecError(f"repair_memory_gib: must be a number > 0, got {value!r}")
        if self.capture_workers is not None:
            positive("capture_workers", self.capture_workers)
        if self.loss_workers is not None:
            positive("loss_workers", self.loss_workers)
        if self.max_models_in_flight is not None:
            positive("max_models_in_flight", self.max_models_in_flight)


@dataclass(frozen=True)
class RaySpec:
    address: str | None = None
    """Cluster to join ("auto", "ray://host:10001"); none starts a local Ray. RAY_ADDRESS wins."""
    num_cpus: int | None = None
    """CPUs of the local Ray (default: all)."""
