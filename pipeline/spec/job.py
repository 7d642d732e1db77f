"""`JobSpec`, a whole job: YAML files in `jobs/` parsed (`pipeline.spec.parse`) into validated,
frozen dataclasses, one module per section.

Every field has a docstring; unknown keys, wrong types and bad values fail before any work
with a one-line ValueError naming the field path (`calibration.samples`) and the value.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

from pipeline.spec.calibration import CalibrationSpec
from pipeline.spec.checks import (
    SpecError,
    check_budgets,
    check_storage,
    is_number,
    positive,
    unique,
)
from pipeline.spec.domains import check_domains, domain_of, domains_of, uncovered
from pipeline.spec.evaluation import EvaluationSpec
from pipeline.spec.experts import ExpertsSpec
from pipeline.spec.models import MethodSpec, ModelSpec
from pipeline.spec.names import distinct_when_stored
from pipeline.spec.repair import RepairSettings
from pipeline.spec.resources import RaySpec, ResourcesSpec
from pipeline.spec.tracking import TrackingSpec

REPAIRS = ("none", "linear")
CHECKPOINT_FORMATS = ("full", "manifest")
CHECKPOINTS = ("manifest", "full", "none")


def notice(text: str) -> None:
    """One line about a spec that still runs as written (an older field's spelling)."""
    logging.getLogger("pipeline").warning("job spec: %s", text)


@dataclass(frozen=True)
class JobSpec:
    name: str
    """Job name: the MLflow experiment, the catalog's `job` column."""
    models: tuple[ModelSpec, ...]
    """Checkpoints to prune."""
    budgets: tuple[int | float, ...]
    """Blocks to remove: counts (7) or fractions of N (0.25)."""
    methods: tuple[MethodSpec, ...]
    """Selection methods and their options."""
    granularity: tuple[str, ...] = ("block",)
    """A grid dimension: what a budget removes. `block`, whole blocks; `attention` or
    `mlp`, that sub-layer of as many blocks; `mixed`, attention and MLP sub-layers ranked
    together (`lorp.models.sublayers`). A sub-layer budget counts units of its
    granularity (a fraction: of the granularity's units); the methods with a sub-layer
    form are `lorp.methods.sublayer_selection.SUBLAYER_METHODS`. Sub-layer points read
    the sub-layer S (one capture serves every granularity), are repaired by
    `lorp.repair.sublayer_repair` (no followers), and are stored, for the Llama and Qwen2
    families, as Nemotron-NAS checkpoints vLLM serves; other families are evaluated in
    transformers, unstored (docs: Sub-layers)."""
    experts: ExpertsSpec = field(default_factory=ExpertsSpec)
    """A grid dimension for mixture-of-experts models: routed experts removed from every
    MoE layer, alone and (`combine`) with each depth point (docs: Experts)."""
    calibration: CalibrationSpec = field(default_factory=CalibrationSpec)
    """Calibration data for S (a model may name its own text: `models[].calibration`)."""
    domains: dict[str, str] = field(default_factory=dict)
    """Corpus -> the domain it is text of (prose, code, or a name of the job's own), for
    corpora that are not packaged (ptb, lee, wiki: prose; code: code). A corpus not named
    is a domain of its own. The repair is validated on every calibration domain and a
    variant judged by its worst evaluated domain (docs: Domains)."""
    output_dir: str = "runs/job"
    """Run directory: catalog/ (a Delta table), mlflow.db, checkpoints/, events.jsonl."""
    storage: str | None = None
    """Where the results live for every node: a local or shared directory, or a URI that
    pyarrow.fs opens (file://, s3://bucket/prefix, gs://, hdfs://; query parameters set
    the filesystem's options, e.g. ?endpoint_override=host:9000&scheme=http; credentials
    come from the environment). Checkpoints (uploaded by the node that made them), the
    catalog, events, MLflow artifacts and, unless cache_dir is set, the cached S files go
    there; output_dir is the driver's working copy, synced after every point, and a rerun
    resumes from the catalog in storage. Default: output_dir itself."""
    catalog: str | None = None
    """The organisation's shared catalog: a local or shared directory, or a URI as for
    storage (s3://bucket/catalog), where a Delta Lake table holds every job's rows (any
    Delta reader reads it: DuckDB, Spark, Trino, pandas). Every row this job records is
    also published there, in the background, under this job's run id (many jobs write at
    once; a rerun replaces this job's rows only), and the registry's aliases rank over
    every job's rows in it. Default: none, the job's own catalog only."""
    catalog_retention_hours: int = 168
    """How far back the shared catalog can be read (`lorp catalog ls --as-of`): its
    maintenance never vacuums a file a version this recent reads."""
    catalog_maintenance_hours: float = 6.0
    """How often, at most, a job's end compacts the shared catalog's small files,
    checkpoints its log and vacuums it (whichever job ends first once it is due)."""
    checkpoints: str = "manifest"
    """How each pruned variant is stored under <storage>/checkpoints: `manifest` (the
    default), what the variant changes (`lorp.models.variant_manifest`): its base model by
    reference and fingerprint, the blocks it drops and the tensors its repair rewrote
    (SmolLM2-135M: a few KiB unrepaired, 3.5 MB a repaired run, against 540 MB a full
    copy), or for a sub-layer variant the units it removes and the projections its repair
    folded, which `lorp pull`, the registry's loading and vLLM evaluation write back as a
    standard checkpoint (a sub-layer variant's in Nemotron-NAS form); `full`, a
    standard checkpoint (safetensors, config, tokenizer) that vLLM and transformers load
    as it is; `none`, no checkpoint (the variant is measured and catalogued, not
    registered)."""
    save_checkpoints: bool | None = None
    """Before `checkpoints`: false is `checkpoints: none`, true the default. Still read,
    with a one-line notice."""
    checkpoint_format: str | None = None
    """Before `checkpoints`: `full` or `manifest`. Still read, with a one-line notice."""
    cache_dir: str | None = None
    """Where merged S files are cached by content key (default: <storage>/stats when
    storage is set, else $LORP_CACHE/stats)."""
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)
    """Ray resource requests."""
    ray: RaySpec = field(default_factory=RaySpec)
    """Which Ray to run on."""
    tracking: TrackingSpec = field(default_factory=TrackingSpec)
    """MLflow settings."""
    evaluation: EvaluationSpec = field(default_factory=EvaluationSpec)
    """What to measure on every pruned checkpoint."""
    repair: tuple[str, ...] = REPAIRS
    """A grid dimension: `none` keeps each pruned variant as it is; `linear` also makes
    its repaired twin (`lorp.repair`: one least-squares map per run of removed blocks,
    fitted from calibration statistics and folded into block s-1's weights; same
    architecture and parameter count). Both by default."""
    repair_rounds: int = 100
    """Rounds of a `normed` repair fit at most (each one d x d SVD; `lorp.repair`'s
    default, 100). Fewer trade fit quality for time (the demo's budget)."""
    repair_ridge: float | str = "auto"
    """The repair's relative ridge: auto (each run's chosen among `lorp.repair.maps.RIDGES` by
    the residual it leaves on the held-out calibration windows) or a number > 0. Either
    way a run's map is kept only where it beats the unrepaired map on those windows."""
    repair_followers: int = 1
    """Kept blocks after each cut that take a map of their own too (`lorp.repair`'s
    followers: fitted on the repaired model's states towards the dense model's, validated
    like the runs' maps). Each costs the repaired point a dense and a repaired forward of
    the calibration windows; 0 fits the runs' maps only. Measured on SmolLM2-135M at 8 of
    30 blocks: one took held-out news from 2.32x to 2.20x dense (docs: Linear repair)."""
    repair_distill: int = 0
    """Epochs of distillation of each repaired point's maps, the runs' and the followers'
    (`lorp.repair.distill`): trained together towards the dense model's next-token distribution
    on the calibration windows, the best epoch on the held-out windows kept (the
    least-squares maps where none beats them). Each epoch costs the point a dense
    forward and a pruned forward and backward of the calibration windows. 0: least
    squares only. Not for a model streamed in its grid points (larger than its worker)."""
    repair_distill_lr: float = 1e-4
    """Adam's learning rate for `repair_distill`."""
    repair_gate: bool = True
    """Keep a repaired point's maps only where its held-out loss is no worse than its
    unrepaired twin's on every calibration domain, falling back to fewer maps, then to
    none (`lorp.repair.domain_gate`). false keeps every validated map as fitted (maps a
    later finetune starts from); the row then has no `repair_gate`."""

    def calibration_for(self, model: ModelSpec) -> CalibrationSpec:
        """The calibration `model` is captured on: the job's, with the model's own text
        (`models[].calibration`) where it names one."""
        if model.calibration is None:
            return self.calibration
        return replace(self.calibration, dataset=model.calibration)

    def domain(self, corpus: str) -> str:
        """The domain of `corpus` (`pipeline.spec.domains.domain_of`)."""
        return domain_of(corpus, self.domains)

    def judged_domains(self) -> dict[str, list[str]]:
        """Domain -> the perplexity corpora judged in it."""
        return domains_of(self.evaluation.perplexity, self.domains)

    def calibration_domains(self, model: ModelSpec) -> dict[str, list[str]]:
        """Domain -> the corpora `model` is calibrated on in it."""
        return domains_of(self.calibration_for(model).corpora, self.domains)

    def warnings(self) -> list[str]:
        """Lines about a spec that runs but judges less than it seems to: every perplexity
        corpus a calibration corpus, or a model judged on a domain it is not calibrated on."""
        ev, out = self.evaluation, []
        if ev.enabled and ev.perplexity:
            fitted = {c for m in self.models for c in self.calibration_for(m).corpora}
            if set(ev.perplexity) <= fitted:
                out.append(
                    f"evaluation.perplexity: {', '.join(ev.perplexity)} is all calibration "
                    "text; variants are judged on what they were fitted on (add a held-out "
                    "corpus: lee)"
                )
            calibrated = {m.label: self.calibration_for(m).corpora for m in self.models}
            out += uncovered(calibrated, ev.perplexity, self.domains)
        return out

    @property
    def repair_settings(self) -> RepairSettings:
        """The repair fields as one value (`pipeline.spec.repair`)."""
        return RepairSettings(
            self.repair,
            self.repair_rounds,
            self.repair_ridge,
            self.repair_followers,
            self.repair_distill,
            float(self.repair_distill_lr),
            self.repair_gate,
        )

    def distill_epochs(self, method: MethodSpec | None) -> int:
        """Epochs of distillation of `method`'s repaired twins: its own, else the job's."""
        return self.repair_settings.distill_epochs(method)

    @property
    def distills(self) -> bool:
        """Whether any repaired point of the job is distilled."""
        return "linear" in self.repair and any(self.distill_epochs(m) for m in self.methods)

    @property
    def ridge_value(self) -> float | None:
        """`repair_ridge` as `lorp.repair.fit.fit_runs` takes it (None: auto)."""
        return self.repair_settings.ridge_value

    def __post_init__(self) -> None:
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            raise SpecError(f"name: letters, digits, '-', '_' and '.' only, got {self.name!r}")
        if self.name.startswith("."):
            raise SpecError(f"name: must not start with '.' (stores hide it), got {self.name!r}")
        if not self.models:
            raise SpecError("models: at least one model is needed")
        if not self.budgets:
            raise SpecError("budgets: at least one budget is needed")
        if not self.methods:
            raise SpecError("methods: at least one method is needed")
        check_budgets("budgets", self.budgets, "a block", "N")
        if self.storage is not None:
            check_storage(self.storage)
        if self.catalog is not None:
            check_storage(self.catalog, "catalog")
            self._check_catalog_table()
        unique("budgets", list(self.budgets))
        self._check_granularity()
        if not self.repair:
            raise SpecError("repair: at least one of none, linear is needed")
        for i, r in enumerate(self.repair):
            if r not in REPAIRS:
                raise SpecError(f"repair[{i}]: must be one of {', '.join(REPAIRS)}, got {r!r}")
        unique("repair", list(self.repair))
        self._read_older_checkpoint_fields()
        if self.checkpoints not in CHECKPOINTS:
            raise SpecError(
                f"checkpoints: must be one of {', '.join(CHECKPOINTS)}, got {self.checkpoints!r}"
            )
        self._check_materialize()
        positive("repair_rounds", self.repair_rounds)
        positive("repair_followers", self.repair_followers, minimum=0)
        positive("repair_distill", self.repair_distill, minimum=0)
        lr = self.repair_distill_lr
        if not (is_number(lr) and 0 < float(lr) < 1):
            raise SpecError(f"repair_distill_lr: must be a number in (0, 1), got {lr!r}")
        ridge = self.repair_ridge
        if ridge != "auto" and not (is_number(ridge) and float(ridge) > 0):
            raise SpecError(f"repair_ridge: must be auto or a number > 0, got {ridge!r}")
        self._check_labels()
        self._check_vllm()
        self._check_domains()

    def _check_granularity(self) -> None:
        from lorp.methods.sublayer_selection import check_sublayer_method
        from lorp.models.sublayers import check_granularity

        if not self.granularity:
            raise SpecError("granularity: at least one of block, attention, mlp, mixed is needed")
        for i, g in enumerate(self.granularity):
            try:
                check_granularity(g, f"granularity[{i}]")
            except ValueError as exc:
                raise SpecError(str(exc)) from None
        unique("granularity", list(self.granularity))
        for g in self.granularity:
            for i, m in enumerate(self.methods):
                try:
                    check_sublayer_method(m.name, g, f"methods[{i}]")
                except ValueError as exc:
                    raise SpecError(str(exc)) from None

    @property
    def sublayers(self) -> bool:
        """Whether any point removes sub-layers (the capture then records the 2N + 1
        sub-layer boundaries, from which the block S is read too)."""
        return any(g != "block" for g in self.granularity)

    def _check_domains(self) -> None:
        check_domains(self.domains)
        for i, m in enumerate(self.models):
            try:
                self.calibration_for(m)
            except SpecError as exc:
                raise SpecError(f"models[{i}].calibration: {exc}") from None
        rank = self.evaluation.rank_domain
        judged = self.judged_domains()
        if rank is not None and rank not in judged:
            raise SpecError(
                f"evaluation.rank_domain: no perplexity corpus is {rank!r} text, got {rank!r} "
                f"(judged: {', '.join(judged) or 'none'})"
            )

    def _check_catalog_table(self) -> None:
        from pipeline.storage.store import delta_location

        try:
            delta_location(str(self.catalog))
        except ValueError as exc:
            raise SpecError(str(exc)) from None
        hours = self.catalog_retention_hours
        if isinstance(hours, bool) or not isinstance(hours, int) or hours < 1:
            raise SpecError(f"catalog_retention_hours: a whole number of hours >= 1, got {hours!r}")
        every = self.catalog_maintenance_hours
        if isinstance(every, bool) or not isinstance(every, int | float) or every <= 0:
            raise SpecError(f"catalog_maintenance_hours: a number of hours > 0, got {every!r}")

    def _check_materialize(self) -> None:
        """`tracking.materialize` writes out the registry's stored variants: it needs both."""
        if self.tracking.materialize != "none" and not self.tracking.register:
            raise SpecError(
                "tracking.materialize: needs tracking.register: true (it writes out the "
                "registry's aliases)"
            )
        if self.tracking.materialize != "none" and self.checkpoints == "none":
            raise SpecError(
                "tracking.materialize: needs stored variants (checkpoints: manifest or full), "
                "got checkpoints: none"
            )

    def _read_older_checkpoint_fields(self) -> None:
        """`save_checkpoints` and `checkpoint_format` as `checkpoints` (once: cleared after)."""
        fields = {
            "save_checkpoints": self.save_checkpoints,
            "checkpoint_format": self.checkpoint_format,
        }
        old = {k: v for k, v in fields.items() if v is not None}
        if not old:
            return
        if self.checkpoints != "manifest":
            raise SpecError(f"checkpoints: set it alone ({', '.join(old)} is its older spelling)")
        fmt = old.get("checkpoint_format", "manifest")
        if fmt not in CHECKPOINT_FORMATS:
            raise SpecError(
                f"checkpoint_format: must be one of {', '.join(CHECKPOINT_FORMATS)}, got {fmt!r}"
            )
        value = "none" if old.get("save_checkpoints") is False else fmt
        for key in old:
            object.__setattr__(self, key, None)
        object.__setattr__(self, "checkpoints", value)
        spelled = ", ".join(f"{k}: {str(v).lower()}" for k, v in old.items())
        notice(f"{spelled}: read as `checkpoints: {value}`, the field that replaces it")

    @property
    def saves_checkpoints(self) -> bool:
        return self.checkpoints != "none"

    def _check_labels(self) -> None:
        """Each model and method label names one thing: once in the spec, and once where
        it is stored (a checkpoint directory, a registered model), repaired twins included."""
        unique("models", [m.label for m in self.models])
        unique("methods", [m.key for m in self.methods], hint="give each a distinct label")
        for i, m in enumerate(self.methods):
            if "+" in m.key:
                raise SpecError(
                    f"methods[{i}].label: {m.key!r} has a '+', which names repaired variants"
                )
        distinct_when_stored(
            "models", [m.label for m in self.models], "give one a distinct name", registered=True
        )
        twins = [r for r in self.repair if r != "none"]  # a repaired twin is `<label>+<repair>`
        slots = [
            m.key if g == "block" else f"{m.key}-{g}"  # `GridPoint.label`
            for g in self.granularity
            for m in self.methods
        ]
        unique("methods", slots, hint="a sub-layer point's label is <label>-<granularity>")
        distinct_when_stored(
            "methods",
            [label for key in slots for label in (key, *(f"{key}+{r}" for r in twins))],
            "give one a distinct label",
        )

    def _check_vllm(self) -> None:
        """vLLM scores saved checkpoints, with at most its evaluator's GPUs as shards."""
        ev = self.evaluation
        if ev.enabled and ev.backend == "vllm" and not self.saves_checkpoints:
            raise SpecError(
                "evaluation.backend: vllm scores saved checkpoints; set checkpoints: manifest "
                "or full"
            )
        tp, gpus = ev.tensor_parallel_size, self.resources.grid.num_gpus
        vllm = ev.backend == "vllm" or (ev.backend == "auto" and self.saves_checkpoints)
        if isinstance(tp, int) and ev.enabled and vllm and 0 < gpus < tp:
            raise SpecError(
                f"evaluation.tensor_parallel_size: {tp} needs as many GPUs per vLLM evaluator, "
                f"and resources.grid.num_gpus is {gpus:g}"
            )

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir)


# -- YAML -> dataclasses -----------------------------------------------------------------
