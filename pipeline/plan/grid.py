"""The grid's values: a planned model (`ModelPlan`), a grid point (`GridPoint`), and the
keys that name exactly what a figure depends on, so a rerun skips what is done and redoes
what changed. `pipeline.plan.models` makes the model plans, `pipeline.plan.points` the
points.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lorp import Selection
from lorp.experts.selection import ExpertSelection
from lorp.locality.similarity_stats import FORMAT_VERSION
from lorp.models.disk_names import DiskLayout
from lorp.models.loading import Kind, hub_revision
from lorp.models.memory import Decision
from lorp.repair.maps import MAX_ROUNDS
from lorp.repair.stats import FORMAT_VERSION as REPAIR_FORMAT
from lorp.repair.stats import contiguous_runs
from pipeline.cluster.model_source import ModelSource
from pipeline.spec.calibration import CalibrationSpec
from pipeline.spec.evaluation import EvaluationSpec
from pipeline.spec.models import MethodSpec, ModelSpec
from pipeline.spec.names import safe_name


def content_key(*parts: Any) -> str:
    """A short, stable hash of JSON-able parts."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


@dataclass(frozen=True)
class FamilyLimits:
    """What a model's family cannot take, each one line or None (`lorp.models.coverage`),
    read from its config on the meta device."""

    cut: str | None = None
    """Why removing block 1 alone is refused: its config states its layers as a pattern
    a cut breaks (Jamba), or a block's settings depend on its depth."""
    repair: str | None = None
    """Why some block takes no linear repair."""
    sublayers: str | None = None
    """Why some block cannot be split into token and channel mixing."""


@dataclass(frozen=True)
class ModelPlan:
    """One model of the job, resolved to a local directory of the driver and checked.
    Workers get its reference (`pipeline.cluster.model_source`), never `path`."""

    spec: ModelSpec
    path: Path
    """The driver's materialised directory (its HF cache or GGUF conversion)."""
    fingerprint: str
    n_blocks: int
    family: str
    budgets: tuple[int, ...]
    ref: str
    """The reference as parsed (a local path expanded), what every worker resolves."""
    kind: Kind
    tied_embeddings: bool = False
    """The LM head is the embedding matrix (a repair run from block 0 cannot fold)."""
    memory: tuple[tuple[str, Decision], ...] = ()
    """Per stage (capture, evaluate): held whole or streamed (`pipeline.plan.memory`);
    empty until Ray is up, and then every stage is held whole."""

    tensor_parallel: int = 1
    """GPUs one vLLM engine of this model spans (`pipeline.plan.memory`); 1 on CPUs."""
    unit_budgets: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """Per sub-layer granularity of the job, its budgets as unit counts."""
    not_servable: str | None = None
    """Why its sub-layer variants cannot be written in the Nemotron-NAS form vLLM serves
    (`lorp.models.nemotron_nas.check_servable`): they are evaluated in transformers and
    not stored. None: they can (or the job has no sub-layer granularity)."""
    calibration: CalibrationSpec = field(default_factory=CalibrationSpec)
    """What the model is calibrated on: the job's calibration, with the model's own text
    where it names one (`JobSpec.calibration_for`)."""
    block_prefix: str = "model.layers."
    """Where its checkpoint's files keep its text blocks (`lorp.models.disk_names`)."""
    limits: FamilyLimits = field(default_factory=FamilyLimits)
    """What its family cannot take: some cuts, a linear repair, sub-layer removal."""
    n_experts: int = 0
    """Routed experts per mixture-of-experts layer (0: a dense model)."""
    expert_groups: int = 1
    """Groups its router first chooses among (DeepSeek's `n_group`): a cut removes as
    many experts from each."""
    expert_budgets: tuple[int, ...] = ()
    """The job's expert budgets as experts removed per MoE layer (empty: the job has
    none, or the model has no experts)."""

    def disk_layout(self) -> DiskLayout:
        return DiskLayout(self.block_prefix, self.n_blocks)

    def warnings(self, repair: Sequence[str], sublayers: bool, experts: bool = False) -> list[str]:
        """One line for each kind of point of the job its family cannot take: it runs,
        and those points fail with the same line (`FamilyLimits`)."""
        label, family, limits = self.spec.label, self.family, self.limits
        out = []
        if limits.cut is not None:
            out.append(
                f"{label}: removing block 1 alone is refused ({limits.cut}); a point "
                "whose cut its config cannot describe fails with such a line"
            )
        if limits.repair is not None and "linear" in repair:
            out.append(
                f"{label}: {family} takes no linear repair ({limits.repair}); its "
                "linear points fail (repair: [none] prunes it unrepaired)"
            )
        if limits.sublayers is not None and sublayers:
            out.append(
                f"{label}: {family} cannot lose sub-layers ({limits.sublayers}); its "
                "sub-layer points fail"
            )
        if experts and not self.n_experts:
            out.append(f"{label}: {family} has no routed experts; the expert budgets skip it")
        return out

    def budgets_for(self, granularity: str) -> tuple[int, ...]:
        """The budgets of `granularity`: block counts, or its unit counts."""
        return self.budgets if granularity == "block" else dict(self.unit_budgets)[granularity]

    def decision(self, stage: str) -> Decision | None:
        """The plan's decision for `stage` (capture, evaluate), None before it is made."""
        return dict(self.memory).get(stage)

    def streamed(self, stage: str) -> bool:
        d = self.decision(stage)
        return d is not None and d.mode == "streamed"

    def copies(self, stage: str) -> int:
        """Whole copies of the model a worker of `stage` may hold (2 unless planned less)."""
        d = self.decision(stage)
        return 2 if d is None else d.copies

    def batch(self, stage: str, default: int) -> int:
        """Windows per forward in `stage`: the spec's, or a streamed stage's larger one."""
        d = self.decision(stage)
        return d.batch if d is not None and d.mode == "streamed" else default

    def repair_bytes(self, default: int) -> int:
        """The repair sums one capture pass may hold (held-out sums aside): the spec's
        bound, or less where the plan found less room beside a streamed model."""
        d = self.decision("capture")
        if d is not None and d.mode == "streamed" and d.kept_bytes:
            return min(default, d.kept_bytes // 2)
        return default

    def source(self, stage: str = "evaluate") -> ModelSource:
        """The model as a worker of `stage` (capture, evaluate) receives it: its
        reference, pinned where it is a hub id, streamed where the plan says so."""
        return ModelSource(
            ref=self.ref,
            kind=self.kind,
            revision=hub_revision(self.path) if self.kind == "hub" else None,
            fingerprint=self.fingerprint,
            dtype=self.spec.dtype,
            trust_remote_code=self.spec.trust_remote_code,
            allow_pickle=self.spec.allow_pickle,
            label=self.label,
            streamed=self.streamed(stage),
            pristine=self.copies(stage) >= 2,
        )

    def memory_record(self) -> dict[str, dict[str, object]]:
        out = {s: d.record() for s, d in self.memory}
        if self.tensor_parallel > 1 and "evaluate" in out:
            out["evaluate"] = out["evaluate"] | {"tensor_parallel_size": self.tensor_parallel}
        return out

    @property
    def label(self) -> str:
        return self.spec.label

    def stats_key(self, calibration: str, sublayers: bool = False, experts: bool = False) -> str:
        """The S cache key: the same weights, calibration and dtype share one S (the
        sub-layer S, over 2N + 1 boundaries, is another file; so is S with the experts'
        sums)."""
        parts = (self.fingerprint, calibration, self.spec.dtype, FORMAT_VERSION)
        return content_key(
            *parts, *(["sublayers"] if sublayers else []), *(["experts"] if experts else [])
        )

    def model_key(self, calibration: str) -> str:
        return content_key(self.fingerprint, calibration, self.spec.dtype)


@dataclass(frozen=True)
class GridPoint:
    """One (model, method, budget) of the grid; the dense point has no selection."""

    key: str
    model: ModelPlan
    method: MethodSpec | None
    selection: Selection | None
    select_s: float = 0.0
    """Wall time of the selection (loss-guided methods: their candidate evaluations)."""
    repair: str = "none"
    """none, or linear: the variant's gaps closed by `lorp.repair` (fitted in its task)."""
    granularity: str = "block"
    """What the selection removes: blocks, or sub-layer units (`lorp.models.sublayers`:
    then `selection.layers` are units and `layers` is empty)."""
    checkpoint: str | None = None
    """Where its checkpoint goes below the job's storage (`stored_at`, decided once when
    the point is made); None: not stored."""
    experts: ExpertSelection | None = None
    """The routed experts the point removes (`lorp.experts`): alone (its granularity is
    `experts` and it has no `selection`), or with the blocks of its `selection`."""

    @property
    def sublayer(self) -> bool:
        return self.granularity not in ("block", EXPERTS)

    @property
    def expert_only(self) -> bool:
        return self.granularity == EXPERTS

    @property
    def servable(self) -> bool:
        """A sub-layer variant vLLM serves (stored as a Nemotron-NAS checkpoint)."""
        return self.sublayer and self.model.not_servable is None

    @property
    def is_dense(self) -> bool:
        return self.selection is None and self.experts is None

    @property
    def method_name(self) -> str:
        """The block selection's method; an expert-only point's, its expert selector."""
        if self.method:
            return self.method.name
        return self.experts.method if self.experts else "dense"

    @property
    def label(self) -> str:
        """The catalog's `method_label`: the method's key, `+linear` when repaired, so a
        variant and its repaired twin are two slots side by side; `<selector>-experts`
        for an expert cut, after `&` where the point removes blocks too."""
        cut = f"{self.experts.method}-{EXPERTS}" if self.experts else None
        if not self.method:
            return cut or "dense"
        key = self.method.key if not self.sublayer else f"{self.method.key}-{self.granularity}"
        key = key if cut is None else f"{key}&{cut}"
        return key if self.repair == "none" else f"{key}+{self.repair}"

    @property
    def runs(self) -> list[tuple[int, int]]:
        """The maximal runs of removed blocks, or of a sub-layer point's units (what a
        linear repair fits one map for)."""
        if self.sublayer:
            return contiguous_runs(self.units, 2 * self.model.n_blocks)
        return contiguous_runs(self.layers, self.model.n_blocks) if self.layers else []

    @property
    def budget(self) -> int:
        """Blocks (or units) removed; an expert-only point's, experts per MoE layer."""
        if self.selection:
            return self.selection.budget
        return self.expert_budget

    @property
    def expert_budget(self) -> int:
        """Routed experts removed from each MoE layer (0: none)."""
        return self.experts.per_layer if self.experts else 0

    @property
    def layers(self) -> tuple[int, ...]:
        """The whole blocks the point removes (none at a sub-layer granularity)."""
        return self.selection.layers if self.selection and not self.sublayer else ()

    @property
    def units(self) -> tuple[int, ...]:
        """The sub-layer units the point removes (none at block granularity)."""
        return self.selection.layers if self.selection and self.sublayer else ()

    @property
    def pruned(self) -> bool:
        return bool(self.layers or self.units or self.expert_budget)

    @property
    def bound_blocks(self) -> int:
        """The k of a speed-up's bound N / (N - k): the blocks removed, or those whose
        sub-layers a point removes (no sub-layer's removal is faster than its block's)."""
        return len({u // 2 for u in self.units}) if self.sublayer else len(self.layers)

    @property
    def options(self) -> dict[str, Any]:
        return self.selection.to_dict()["options"] if self.selection else {}

    @property
    def n_evals(self) -> int:
        """Candidate models the selection evaluated (0 for similarity-only methods)."""
        return int(self.selection.details.get("n_evals", 0)) if self.selection else 0

    @property
    def name(self) -> str:
        """Run and checkpoint name: `<label>-b<budget>`, `-e<experts>` for an expert cut."""
        cut = f"-e{self.expert_budget}" if self.experts else ""
        if self.selection:
            return f"{self.label}-b{self.budget}{cut}"
        return f"{self.label}{cut}" if self.experts else "dense"


EXPERTS = "experts"
"""The granularity of a point that removes routed experts only (its budget counts them)."""


CHECKPOINTS = "checkpoints"


def checkpoint_rel(point: GridPoint) -> str:
    """A point's checkpoint below the job's storage: `checkpoints/<model>/<point>`."""
    return f"{CHECKPOINTS}/{safe_name(point.model.label)}/{safe_name(point.name)}"


def stored_at(point: GridPoint, saves_checkpoints: bool) -> str | None:
    """Where the point's checkpoint goes below the storage (`checkpoint_rel`); None when
    it is not stored: the dense point, a job that stores none, or a sub-layer variant
    vLLM cannot serve."""
    if not (saves_checkpoints and point.pruned) or (point.sublayer and not point.servable):
        return None
    return checkpoint_rel(point)


def evaluation_key(spec: EvaluationSpec, backend: str) -> dict[str, Any]:
    """The evaluation settings that change a point's figures: not batch sizes or
    parallelism, nor how long the speed pass times (it re-times on its own terms:
    `lorp run --force-speed`). No serving leaves the key as it was before serving
    existed, so earlier catalogs stay valid."""
    fields = asdict(spec)
    for name in (
        "batch_size",
        "tensor_parallel_size",
        "backend",
        "degraded_ratio",
        "speed_budget_s",
        "speed_half_width",
    ):
        fields.pop(name, None)
    if fields.get("serving") is None:
        fields.pop("serving", None)
    return {**fields, "backend": backend}


def grid_key(
    model_key: str,
    point: str,
    options: Mapping[str, Any],
    budget: int,
    ev: Any,
    repair: str = "none",
    rounds: int = MAX_ROUNDS,
    ridge: float | str = "auto",
    followers: int = 0,
    distill: tuple[int, float] = (0, 0.0),
    gate: bool = True,
    granularity: str = "block",
    experts: Mapping[str, Any] | None = None,
) -> str:
    """A point's key; an unrepaired point's key is what it was before repair existed, so
    catalogs and caches of earlier runs stay valid, and a block point's what it was
    before sub-layers and experts. `experts`: the expert cut's selector, count and seed
    (an expert cut is never repaired)."""
    units = [{"granularity": granularity}] if granularity != "block" else []
    if experts is not None:
        units.append({"experts": dict(experts)})
    if repair == "none":
        return content_key(model_key, point, dict(options), budget, ev, *units)
    # validated: the ridge chosen (or fixed) and the map kept only where it beats the
    # unrepaired map on held-out calibration windows drawn apart from the fit's, on every
    # domain (lorp.repair.fit.fit_runs), and the whole repair gated by the held-out loss
    # per domain (lorp.repair.domain_gate)
    fit = {
        "repair": repair,
        "ridge": ridge,
        "fit": "one-pass",
        "format": REPAIR_FORMAT,
        "validated": "heldout-apart-gated",
    }
    if rounds != MAX_ROUNDS:  # the default leaves earlier runs' keys as they were
        fit["rounds"] = rounds
    if followers:  # so do no followers
        fit["followers"] = followers
    if distill[0]:  # and no distillation (epochs, learning rate)
        fit["distill"] = {"epochs": distill[0], "lr": distill[1]}
    if not gate:  # and the gate on
        fit["gate"] = False
    return content_key(model_key, point, dict(options), budget, ev, fit, *units)
