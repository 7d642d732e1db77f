"""Every task and result that crosses to a Ray worker, defined once where both ends import
them: the driver's stages build the tasks (`pipeline.driver.tasks`, `.statistics`,
`.loss_evaluators`), the workers run them (`pipeline.stages.capture`, `.points`,
`.speed_pass`), and the recorder reads the results.

Everything here is plain data (frozen dataclasses, numpy arrays, object-store refs), and
none of it is a path of the driver: a model travels as its reference (`ModelSource`,
resolved on the node that loads it), calibration windows as arrays, checkpoints as
locations in the job's storage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.cluster.model_source import ModelSource
from pipeline.spec.evaluation import EvaluationSpec
from pipeline.spec.resources import Resources


@dataclass(frozen=True)
class CaptureTask:
    """One model's capture: which model, how to run it, what to call the result."""

    model: ModelSource
    calibration: str
    """The calibration fingerprint every partial carries."""
    resources: Resources = field(default_factory=Resources)
    batch_size: int = 1
    skip_prefix: int = 0
    """Leading positions of every window left out of S (1 when windows start with BOS)."""
    sublayers: bool = False
    """Record S over the 2N + 1 sub-layer boundaries (`capture_stats(sublayers=True)`)."""
    experts: bool = False
    """Record the routed experts' sums too (`capture_stats(experts=True)`)."""


@dataclass(frozen=True)
class Shard:
    """One calibration shard as data: its name (logs, fault tests) and its windows."""

    name: str
    windows: np.ndarray
    """Token ids [n, T], BOS first where the policy adds one."""


@dataclass(frozen=True)
class PointTask:
    """One grid point's surgery, saving and evaluation, as plain data."""

    grid_key: str
    model: ModelSource
    layers: tuple[int, ...]
    storage: str
    """The job's storage location (`Storage.location`)."""
    checkpoint: str | None
    """Where the pruned checkpoint goes below `storage`; None: not saved."""
    checkpoint_format: str = "full"
    """The job's `checkpoints`: manifest (`lorp.models.variant_manifest`) or full (a
    standard checkpoint); unused without a `checkpoint`."""
    provenance: dict[str, Any] = field(default_factory=dict)
    evaluation: EvaluationSpec = field(default_factory=EvaluationSpec)
    resources: Resources = field(default_factory=Resources)
    backend: str = "transformers"
    """none, transformers (the model in memory) or vllm (an engine over the checkpoint)."""
    repair: RepairTask | None = None
    """The point's linear repair; None: the blocks are only dropped."""
    name: str = ""
    """The point as log lines and the timeline name it (method, budget, repair)."""
    units: tuple[int, ...] = ()
    """The sub-layer units removed instead (`lorp.models.sublayers`); `layers` is then
    empty."""
    experts: tuple[tuple[int, tuple[int, ...]], ...] = ()
    """(block, routed experts removed) of every MoE layer, in the dense model's numbering
    (`lorp.experts.surgery`), removed before the blocks; empty: none."""


@dataclass(frozen=True)
class RepairTask:
    """What a repaired point needs: its runs' statistics (object-store refs, one per run,
    so a point fetches only the sums of its own runs, each with its held-out sums) and the
    ridge (None: chosen per run on the held-out windows, `lorp.repair.fit.fit_runs`)."""

    runs: tuple[tuple[int, int], ...]
    stats: tuple[Any, ...]
    """One ObjectRef of a one-run `RepairStats` per run, in `runs` order."""
    ridge: float | None
    rounds: int = 100
    """A normed fit's rounds at most (the job's `repair_rounds`)."""
    followers: int = 0
    """Kept blocks after each cut that take a follower map
    (`lorp.repair.followers.fit_followers`)."""
    windows: Any = None
    """An ObjectRef of the model's `FollowerWindows`: followers and distillation fit on
    them, and the repair's domain gate judges on their held-out windows."""
    distill: int = 0
    """Epochs of distillation of the point's maps (`lorp.repair.distill`); 0: none."""
    distill_lr: float = 1e-4
    gate: bool = True
    """Judge the repair on the held-out loss per domain (`lorp.repair.domain_gate`)."""
    units: bool = False
    """`runs` are of sub-layer units (`lorp.repair.sublayer_repair`)."""
    peer: Any = None
    """A peer recipe's repair (`lorp.peers.recipes.PeerRepair`), run on `windows`
    instead of the linear maps: `runs` and `stats` are then empty."""


@dataclass(frozen=True)
class FollowerWindows:
    """What a follower map is fitted on and validated on: the model's calibration windows
    (S's tokens) and its held-out calibration windows, int32 [n, T] each, put in the
    object store once per model."""

    windows: np.ndarray
    held: np.ndarray
    skip_prefix: int
    batch_size: int
    held_domains: tuple[str, ...] = ()
    """The domain of each held-out window (`pipeline.spec.domains`); empty: one domain."""

    def held_by_domain(self) -> dict[str, np.ndarray]:
        """Domain -> its held-out windows (one domain, "", when none are named)."""
        from lorp.data.windows import by_label

        return by_label(self.held, self.held_domains) if self.held_domains else {"": self.held}


@dataclass(frozen=True)
class SpeedTask:
    """Every variant of one model, timed against the dense model in one process."""

    model: ModelSource
    storage: str
    """The job's storage location, where saved checkpoints are."""
    variants: tuple[tuple[str, tuple[int, ...], str | None], ...]
    """(grid key, pruned blocks, saved checkpoint below `storage` or None); () is dense."""
    seq_len: int
    min_rounds: int = 6
    """Rounds of dense + every variant at least before a figure may resolve."""
    budget_s: float = 300.0
    """Seconds of timing for the whole model (every group), warm-ups included."""
    half_width: float = 0.02
    """The 95% interval's half-width, relative, a published speed-up needs."""
    resources: Resources = field(default_factory=Resources)
    n_blocks: int = 1
    """The dense model's blocks (the speed-up's bound N / (N - k))."""
    units: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Grid key -> the sub-layer units a sub-layer variant removes (its blocks are ())."""


@dataclass(frozen=True)
class LossTask:
    model: ModelSource
    windows: np.ndarray
    """Held-out calibration windows [n, T] (BOS first where the policy adds one): data,
    shipped with the task, never a file of the driver."""
    batch_size: int = 4
    resources: Resources = field(default_factory=Resources)


@dataclass
class PointResult:
    """A grid point's outcome, as plain data: what was kept, sizes and metrics."""

    grid_key: str
    kept: list[int]
    params: int
    params_dense: int
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    zero_shot: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per task: the split and item count scored (also `n_<task>` in `metrics`)."""
    repair: list[dict[str, Any]] = field(default_factory=list)
    """Per repaired run: `lorp.repair.maps.RunFit.record()` (form, lambda, residuals)."""
    serving: dict[str, Any] = field(default_factory=dict)
    """vLLM serving: the settings and every timed round's figures
    (`pipeline.evaluation.serving.measure_serving`)."""
    peak_gib: float | None = None
    """The most memory the point's worker held above its process's own (GiB), what the
    plan's `evaluate` decision estimates; None where an engine's processes held it (vLLM)."""
    backend: str | None = None
    """The backend that evaluated the point where it is not the job's: a sub-layer
    variant vLLM cannot serve (`lorp.models.nemotron_nas`) is evaluated in transformers."""
    window_nll: dict[str, list[float]] = field(default_factory=dict)
    """Per corpus (`ppl_<corpus>`'s name): each evaluation window's mean NLL, in order."""
