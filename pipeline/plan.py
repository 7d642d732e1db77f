"""Planning: what a job will do, decided before any Ray task, MLflow run or file exists.

Pure: no Ray, no MLflow. `plan_models` resolves and checks every model (reference, family,
context length, budgets, method option values against N), so every input error surfaces
here, before the run directory is created. `plan_points` turns one model's statistics into
its grid points, each holding the `Selection` it will prune. Keys name exactly what a
figure depends on, so a rerun skips what is done and redoes what changed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lorp import Selection, get_method
from lorp.locality.similarity_stats import FORMAT_VERSION
from lorp.methods import resolve_budget, validate_options
from lorp.models.architectures import architecture_for
from lorp.models.loading import Kind, materialize, parse_model_ref, read_config
from lorp.models.memory import Decision
from lorp.repair.maps import MAX_ROUNDS
from lorp.repair.stats import FORMAT_VERSION as REPAIR_FORMAT
from lorp.repair.stats import contiguous_runs
from pipeline.selectors import Selector
from pipeline.spec.calibration import CalibrationSpec
from pipeline.spec.checks import SpecError
from pipeline.spec.evaluation import EvaluationSpec
from pipeline.spec.job import JobSpec
from pipeline.spec.models import MethodSpec, ModelSpec
from pipeline.spec.names import safe_name
from pipeline.storage import unwritable

BACKENDS_NEEDING_CHECKPOINTS = ("vllm",)


def content_key(*parts: Any) -> str:
    """A short, stable hash of JSON-able parts."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


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
    """Per stage (capture, evaluate): held whole or streamed (`pipeline.cluster.memory`);
    empty until Ray is up, and then every stage is held whole."""

    tensor_parallel: int = 1
    """GPUs one vLLM engine of this model spans (`pipeline.cluster.memory`); 1 on CPUs."""
    unit_budgets: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """Per sub-layer granularity of the job, its budgets as unit counts."""
    not_servable: str | None = None
    """Why its sub-layer variants cannot be written in the Nemotron-NAS form vLLM serves
    (`lorp.models.nemotron_nas.check_servable`): they are evaluated in transformers and
    not stored. None: they can (or the job has no sub-layer granularity)."""

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

    def memory_record(self) -> dict[str, dict[str, object]]:
        out = {s: d.record() for s, d in self.memory}
        if self.tensor_parallel > 1 and "evaluate" in out:
            out["evaluate"] = out["evaluate"] | {"tensor_parallel_size": self.tensor_parallel}
        return out

    @property
    def label(self) -> str:
        return self.spec.label

    def stats_key(self, calibration: str, sublayers: bool = False) -> str:
        """The S cache key: the same weights, calibration and dtype share one S (the
        sub-layer S, over 2N + 1 boundaries, is another file)."""
        parts = (self.fingerprint, calibration, self.spec.dtype, FORMAT_VERSION)
        return content_key(*parts, *(["sublayers"] if sublayers else []))

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

    @property
    def sublayer(self) -> bool:
        return self.granularity != "block"

    @property
    def servable(self) -> bool:
        """A sub-layer variant vLLM serves (stored as a Nemotron-NAS checkpoint)."""
        return self.sublayer and self.model.not_servable is None

    @property
    def is_dense(self) -> bool:
        return self.selection is None

    @property
    def method_name(self) -> str:
        return self.method.name if self.method else "dense"

    @property
    def label(self) -> str:
        """The catalog's `method_label`: the method's key, `+linear` when repaired, so a
        variant and its repaired twin are two slots side by side."""
        if not self.method:
            return "dense"
        key = self.method.key if not self.sublayer else f"{self.method.key}-{self.granularity}"
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
        return self.selection.budget if self.selection else 0

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
        return bool(self.layers or self.units)

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
        """Run and checkpoint name: `<label>-b<budget>`."""
        return f"{self.label}-b{self.budget}" if self.selection else "dense"


CHECKPOINTS = "checkpoints"


def checkpoint_rel(point: GridPoint) -> str:
    """A point's checkpoint below the job's storage: `checkpoints/<model>/<point>`."""
    return f"{CHECKPOINTS}/{safe_name(point.model.label)}/{safe_name(point.name)}"


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
) -> str:
    """A point's key; an unrepaired point's key is what it was before repair existed, so
    catalogs and caches of earlier runs stay valid, and a block point's what it was
    before sub-layers."""
    units = [{"granularity": granularity}] if granularity != "block" else []
    if repair == "none":
        return content_key(model_key, point, dict(options), budget, ev, *units)
    # validated: the ridge chosen (or fixed) and the map kept only where it beats the
    # unrepaired map on held-out calibration windows drawn apart from the fit's, on every
    # domain (lorp.repair.fit.fit_runs), and the whole repair gated by the held-out loss
    # per domain (lorp.repair.domain_gate)
    fit = {"repair": repair, "ridge": ridge, "fit": "one-pass", "format": REPAIR_FORMAT,
           "validated": "heldout-apart-gated"}  # fmt: skip
    if rounds != MAX_ROUNDS:  # the default leaves earlier runs' keys as they were
        fit["rounds"] = rounds
    if followers:  # so do no followers
        fit["followers"] = followers
    if distill[0]:  # and no distillation (epochs, learning rate)
        fit["distill"] = {"epochs": distill[0], "lr": distill[1]}
    if not gate:  # and the gate on
        fit["gate"] = False
    return content_key(model_key, point, dict(options), budget, ev, fit, *units)


def repair_refusal(plan: ModelPlan, layers: tuple[int, ...]) -> str | None:
    """Why `layers` of `plan`'s model cannot be repaired (one line), or None. Every
    supported family has an exact fold (`lorp.repair`); what remains is a run from block
    0 when the embeddings are tied to the LM head (`lorp.repair.fit.check_repairable`)."""
    if layers and min(layers) == 0 and plan.tied_embeddings:
        e = contiguous_runs(layers, plan.n_blocks)[0][1]
        return (
            f"run 0-{e} starts at block 0 and {plan.label} ties its embeddings to the LM "
            "head: no weight takes the map without changing the logits"
        )
    return None


# -- models ------------------------------------------------------------------------------


def unwritable_locations(spec: JobSpec) -> list[str]:
    """One line for each local location of the job (its output directory, storage and
    shared catalog) that this process cannot write: found before any work, not when the
    first point is recorded."""
    out = []
    for name, location in (("output_dir", spec.output_dir), ("storage", spec.storage),
                           ("catalog", spec.catalog)):  # fmt: skip
        reason = unwritable(location) if location else None
        if reason:
            out.append(f"{name}: {location!r} cannot be written: {reason}")
    return out


def plan_models(spec: JobSpec) -> list[ModelPlan]:
    """Resolve and check every model; all input errors surface here, naming the field."""
    for i, m in enumerate(spec.models):
        try:
            parse_model_ref(m.ref)
        except ValueError as exc:
            raise SpecError(f"models[{i}].ref: {exc}") from None
    return [plan_model(spec, i, m) for i, m in enumerate(spec.models)]


def plan_model(spec: JobSpec, i: int, m: ModelSpec) -> ModelPlan:
    """Resolve and check model `i` of the job; a SpecError names `models[i]`."""
    from lorp.models.fingerprint import fingerprint_checkpoint

    try:
        mref = parse_model_ref(m.ref)
        path = materialize(mref, allow_pickle=m.allow_pickle)
        config = read_config(path)
        family = architecture_for(str(config.get("model_type"))).family
        fingerprint = fingerprint_checkpoint(path)
    except ValueError as exc:
        raise SpecError(f"models[{i}].ref: {exc}") from None
    n = int(config["num_hidden_layers"])
    _check_context(
        spec.calibration_for(m), spec.evaluation, m, config.get("max_position_embeddings")
    )
    budgets = []
    for j, b in enumerate(spec.budgets if "block" in spec.granularity else ()):
        try:
            budgets.append(resolve_budget(b, n))
        except ValueError as exc:
            raise SpecError(f"budgets[{j}]: {exc} ({m.label})") from None
    for j, method in enumerate(spec.methods):
        try:
            validate_options(method.name, method.options, n_blocks=n)
        except ValueError as exc:
            raise SpecError(f"methods[{j}].options: {exc} ({m.label})") from None
    resolved = tuple(sorted(set(budgets)))
    tied = _tied_embeddings(path, m) if "linear" in spec.repair else False
    units = _unit_budgets(spec, m, n)
    return ModelPlan(
        m, path, fingerprint, n, family, resolved, mref.ref, mref.kind, tied,
        unit_budgets=units, not_servable=_not_servable(config) if spec.sublayers else None,
    )  # fmt: skip


def _not_servable(config: dict[str, Any]) -> str | None:
    from lorp.models.nemotron_nas import NotServable, check_servable

    try:
        check_servable(config)
    except NotServable as exc:
        return str(exc)
    return None


def _unit_budgets(spec: JobSpec, m: ModelSpec, n: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Each sub-layer granularity's budgets as unit counts; one line naming the budget
    where a model has fewer units to remove."""
    from lorp.methods.sublayer_selection import resolve_unit_budget

    out = []
    for g in (g for g in spec.granularity if g != "block"):
        counts = set()
        for j, b in enumerate(spec.budgets):
            try:
                counts.add(resolve_unit_budget(b, g, n))
            except ValueError as exc:
                why = str(exc).removeprefix("budget: ")
                raise SpecError(f"budgets[{j}]: {why} ({m.label}, granularity {g})") from None
        out.append((g, tuple(sorted(counts))))
    return tuple(out)


def _tied_embeddings(path: Path, m: ModelSpec) -> bool:
    """From the model's config class (config.json may leave it to the class default)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path), trust_remote_code=m.trust_remote_code)
    return bool(getattr(config, "tie_word_embeddings", False))


def _check_context(
    cal: CalibrationSpec, ev: EvaluationSpec, m: ModelSpec, max_pos: int | None
) -> None:
    """Windows (plus a BOS token where the policy may add one) must fit the context."""
    if max_pos is None:
        return
    for field, seq_len, bos in (
        ("calibration.seq_len", cal.seq_len, cal.bos),
        ("evaluation.seq_len", ev.seq_len, ev.bos),
    ):
        if field.startswith("evaluation") and not ev.enabled:
            continue
        need = seq_len + (bos != "never")
        if need > max_pos:
            raise SpecError(
                f"{field}: {seq_len} (+1 BOS unless bos: never) exceeds {m.label}'s "
                f"max_position_embeddings {max_pos}"
            )
    serving = ev.serving if ev.enabled else None
    if serving is not None and serving.prompt_len + serving.output_len > max_pos:
        raise SpecError(
            f"evaluation.serving: prompt_len {serving.prompt_len} + output_len "
            f"{serving.output_len} exceeds {m.label}'s max_position_embeddings {max_pos}"
        )


def resolve_backend(spec: JobSpec, vllm_installed: bool) -> str:
    """Decided once per job and recorded: none, transformers or vllm."""
    ev = spec.evaluation
    if not ev.enabled:
        return "none"
    if ev.backend != "auto":
        return ev.backend
    gpu = spec.resources.grid.num_gpus > 0
    return "vllm" if gpu and vllm_installed and spec.saves_checkpoints else "transformers"


# -- points ------------------------------------------------------------------------------


def on_loss_actors(method: str, granularity: str) -> bool:
    """Whether selecting with `method` at `granularity` scores candidates on the loss
    actors (`pipeline.stages.loss_evaluators.LossSelector`)."""
    from lorp.methods.sublayer_selection import LOSS_METHODS

    if granularity == "block":
        return get_method(method).needs_evaluator
    return method in LOSS_METHODS


def plan_points(
    spec: JobSpec,
    plan: ModelPlan,
    model_key: str,
    backend: str,
    select: Selector,
    refused: Callable[[GridPoint, str], None] | None = None,
    ready: Callable[[list[GridPoint]], None] | None = None,
) -> list[GridPoint]:
    """The dense point (when evaluating) and one point per budget x method x repair, each
    selection made once for all its repairs. A repaired point whose runs cannot fold is
    left out and passed to `refused` with the reason. Selections that need no candidate
    evaluations come first; `ready` gets the dense point at once and each unrepaired
    point as soon as its selection is made, so its grid point can start while slower
    selections (loss-guided ones, minutes to hours) go on."""
    ev = evaluation_key(spec.evaluation, backend) if spec.evaluation.enabled else None
    points = []
    if spec.evaluation.enabled:
        points.append(GridPoint(grid_key(model_key, "dense", {}, 0, ev), plan, None, None))
        if ready is not None:
            ready(points[:1])
    # Selections on the loss actors last: they hold the grid's slots until the last of
    # them is made, so a repair-aware one (its sums from capture workers) must come first.
    grid = [(g, m) for g in spec.granularity for m in spec.methods]
    grid.sort(key=lambda gm: on_loss_actors(gm[1].name, gm[0]))
    for g, m in grid:
        for budget in plan.budgets_for(g):
            sel, seconds = select(m, budget) if g == "block" else select(m, budget, g)
            options = sel.to_dict()["options"]
            for repair in spec.repair:
                followers = spec.repair_followers if g == "block" else 0  # units: none
                key = grid_key(
                    model_key, m.name, options, budget, ev, repair, spec.repair_rounds,
                    spec.repair_ridge, followers,
                    (spec.distill_epochs(m), float(spec.repair_distill_lr)), spec.repair_gate, g,
                )  # fmt: skip
                point = GridPoint(key, plan, m, sel, seconds, repair, g)
                why = repair_refusal(plan, point.layers) if repair != "none" else None
                if why is None:
                    points.append(point)
                    if ready is not None and repair == "none":
                        ready([point])
                elif refused is not None:
                    refused(point, why)
    return points
