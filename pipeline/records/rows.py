"""What a job records: typed point results, provenance, catalog rows, events, the summary.

`PointResult` is what crosses Ray back from a grid point; `catalog_row` is the one place a
catalog row is assembled; `provenance` is the one `lorp_pruning.json` layout (shared with
`lorp prune` through `lorp.provenance.provenance`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lorp
from lorp.models.loading import read_config
from lorp.models.shape import ModelShape
from lorp.models.surgery import kept_layers
from lorp.provenance import provenance as lorp_provenance
from lorp.serving_cost import cost_columns
from pipeline.messages import PointResult
from pipeline.plan import GridPoint
from pipeline.records.protocol import calibration_id, protocol_id
from pipeline.spec.calibration import CalibrationSpec
from pipeline.spec.evaluation import EvaluationSpec
from pipeline.spec.job import JobSpec
from pipeline.spec.models import ModelSpec

if TYPE_CHECKING:
    from lorp.locality.profile import Profile


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


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
    """Repaired variants not made, with the reason (`pipeline.plan.repair_refusal`)."""
    storage: str | None = None
    """The job's storage when it is not the run directory."""


def provenance(spec: JobSpec, point: GridPoint) -> dict[str, Any]:
    """The `lorp_pruning.json` record of a pruned checkpoint."""
    return lorp_provenance(
        source_model=point.model.spec.ref,
        source_fingerprint=point.model.fingerprint,
        method=point.method_name,
        options=point.options,
        budget=point.budget,
        n_blocks=point.model.n_blocks,
        pruned=point.layers,
        details=dict(point.selection.details) if point.selection else None,
        grid_key=point.key,
        job=spec.name,
        calibration=asdict(spec.calibration_for(point.model.spec)),
        repair=repair_record(
            point, spec.repair_rounds, spec.repair_ridge,
            (spec.distill_epochs(point.method), float(spec.repair_distill_lr)),
        ),
    )  # fmt: skip


def repair_record(
    point: GridPoint,
    rounds: int = 100,
    ridge: float | str = "auto",
    distill: tuple[int, float] = (0, 0.0),
) -> dict[str, Any] | None:
    """How a repaired point's maps are fitted (the task adds each run's fit)."""
    if point.repair == "none":
        return None
    from lorp.repair.maps import RIDGES

    out: dict[str, Any] = {
        "method": point.repair,
        "ridge": ridge,
        "ridges": list(RIDGES) if ridge == "auto" else [ridge],
        "lambda": "ridge x tr(A_s) / d per run, pulling each map towards the unrepaired one",
        "validation": "each run's ridge chosen, and its map kept only where it beats the "
        "unrepaired map, on the held-out calibration windows (seed + 1, never fitted on)",
        "fit": "one pass of calibration statistics on dense inputs (pipeline capture workers)",
        "rounds": rounds,
    }
    if distill[0]:
        out["distill"] = {
            "epochs": distill[0],
            "lr": distill[1],
            "objective": "KL(dense || pruned) of the next token at every position of the "
            "calibration windows, every map trained together (lorp.repair.distill)",
            "validation": "the best epoch's maps on the held-out calibration windows' KL, "
            "the least-squares maps where none beats them",
        }
    return out


def point_params(point: GridPoint) -> dict[str, Any]:
    """The MLflow params of a point's run."""
    return {
        "method": point.method_name,
        "method_label": point.label,
        "options": point.options,
        "budget": point.budget,
        "pruned_layers": list(point.layers),
        "kept_layers": kept_layers(point.model.n_blocks, point.layers),
        "repair": point.repair,
        **(
            {"granularity": point.granularity, "sublayers": sublayer_labels(point)}
            if point.sublayer
            else {}
        ),
    }


def granularity_columns(point: GridPoint) -> dict[str, Any]:
    """What a variant's budget counts (none for the dense row) and the sub-layers it
    removes (`attn.5`, ...; none at block granularity)."""
    granularity = point.granularity if point.selection else None
    return {"granularity": granularity, "sublayers": sublayer_labels(point)}


def sublayer_labels(point: GridPoint) -> list[str] | None:
    """The sub-layers a point removes (`attn.5`, `mlp.9`), None at block granularity."""
    from lorp.models.sublayers import unit_label

    return [unit_label(u) for u in point.units] if point.sublayer else None


def point_metrics(point: GridPoint, result: PointResult) -> dict[str, Any]:
    """The MLflow metrics of a finished point's run: its figures, its size and time, and
    what selecting its blocks cost."""
    return {
        **result.metrics,
        "params": result.params,
        "seconds": result.seconds,
        "n_evals": point.n_evals,
        "select_s": point.select_s,
    }


def point_memory(point: GridPoint, result: PointResult) -> dict[str, Any]:
    """The point's memory against its plan, for its `point` event: `peak_gib`, what its
    worker held at most above its process's own, beside `planned_gib`, what the plan's
    `evaluate` decision said the mode it chose needs (a job checks its plan with them)."""
    decision = point.model.decision("evaluate")
    if result.peak_gib is None or decision is None:
        return {}
    planned = decision.need_bytes / 2**30
    return {"peak_gib": result.peak_gib, "planned_gib": round(planned, 4), "mode": decision.mode}


def point_tags(row: Mapping[str, Any], checkpoint: str | None, backend: str) -> dict[str, str]:
    """The MLflow tags of a finished point's run: its checkpoint, its evaluation backend
    and, from its row, whether each stage held the model whole or streamed it."""
    tags = {"checkpoint": checkpoint or "", "eval_backend": backend}
    if row.get("memory_plan"):  # held whole or streamed, per stage
        tags["memory_plan"] = row["memory_plan"]
    if row.get("sublayers"):  # a Nemotron-NAS checkpoint loads with its own code
        tags |= {"granularity": str(row["granularity"]), "trust_remote_code": "true"}
    return tags


@dataclass(frozen=True)
class ModelFacts:
    """Model-level facts shared by all of a model's rows."""

    rls: float
    k: int | None
    labels: list[int] | None
    stats_file: str | None
    shape: ModelShape | None = None
    """The dims its rows' cost columns are counted from (`lorp.serving_cost`)."""


def model_facts(profile: Profile, stats_file: str | None, model_path: Path) -> ModelFacts:
    """A model's facts: its profile's RLS, K and cluster labels, its S file, and its
    shape from the config in `model_path`."""
    labels = list(profile.labels) if profile.labels is not None else None
    shape = ModelShape.from_config(read_config(model_path))
    return ModelFacts(profile.rls, profile.k, labels, stats_file, shape)


@dataclass(frozen=True)
class RowContext:
    """Where a row's records live: tracking store, experiment, run, checkpoint, backend."""

    tracking_uri: str
    experiment_id: str
    run_id: str
    checkpoint: str | None
    backend: str
    storage: str | None = None
    """The job's storage (`Storage.uri()`): where the row's files are."""


def catalog_row(
    spec: JobSpec, point: GridPoint, facts: ModelFacts, result: PointResult, ctx: RowContext
) -> dict[str, Any]:
    """The catalog row of a finished point (schema: `pipeline.records.catalog.CORE_SCHEMA`)."""
    details = dict(point.selection.details) if point.selection else {}
    k = details.get("k", facts.k)  # LoRP's own K (fixed or from RLS), else the model's
    plan = point.model
    row = {
        "grid_key": point.key,
        "job": spec.name,
        "model": plan.label,
        "model_ref": plan.spec.ref,
        "family": plan.family,
        "fingerprint": plan.fingerprint,
        "dtype": plan.spec.dtype,
        "n_blocks": plan.n_blocks,
        "method": point.method_name,
        "method_label": point.label,
        "variant": point.options.get("variant"),
        "options": json.dumps(point.options, sort_keys=True),
        "budget": point.budget,
        "pruned_layers": list(point.layers),
        "kept_layers": result.kept,
        **granularity_columns(point),
        "stages": json.dumps(details["stages"]) if details.get("stages") else None,
        "repair": point.repair if point.selection else None,
        "repair_fits": json.dumps(result.repair) if result.repair else None,
        "rls": facts.rls,
        "k": int(k) if k is not None else None,
        "labels": facts.labels,
        **protocol_columns(spec, plan.spec.dtype, plan.spec),
        "zero_shot": json.dumps(result.zero_shot, sort_keys=True) if result.zero_shot else None,
        "serving": json.dumps(result.serving, sort_keys=True) if result.serving else None,
        "stats_file": facts.stats_file,
        "params": result.params,
        "params_dense": result.params_dense,
        "checkpoint": ctx.checkpoint,
        "storage": ctx.storage,
        "eval_backend": ctx.backend,
        "tracking_uri": ctx.tracking_uri,
        "experiment_id": ctx.experiment_id,
        "mlflow_run_id": ctx.run_id,
        "created_at": now(),
        "lorp_version": lorp.__version__,
    }
    row |= planning_columns(point)
    row |= repair_columns(result.repair)
    cal = spec.calibration_for(point.model.spec)
    row |= costs(point, facts, result, cost_seq_len(spec.evaluation, cal))
    return row | {k: v for k, v in result.metrics.items() if _finite_or_none(v)}


def planning_columns(point: GridPoint) -> dict[str, Any]:
    """What planning the point cost and decided: the selection's evaluations and time,
    and per stage whether the model was held whole or streamed (`memory_plan`)."""
    out: dict[str, Any] = {"n_evals": float(point.n_evals), "select_s": point.select_s}
    if point.model.memory:
        out["memory_plan"] = json.dumps(point.model.memory_record(), sort_keys=True)
    return out


def repair_columns(fits: list[dict[str, Any]]) -> dict[str, Any]:
    """A repaired point's figures: the worst run's share of its gap left on calibration
    (`repair_residual`; followers are counted in `repair_kept` only), and the held-out
    validation's (`repair_validation`)."""
    runs = [f for f in fits if "follower" not in f]
    if not runs:
        return {}
    return {"repair_residual": max(float(f["residual"]) for f in runs)} | repair_validation(fits)


def repair_validation(fits: list[dict[str, Any]]) -> dict[str, Any]:
    """What the held-out calibration windows said of a repaired point's maps: the worst
    run's residual there (`repair_held_residual`) and how many runs, and followers, kept
    their fitted map (`repair_kept`: "2/2 runs, 1/2 followers"; "0/2 runs" with no
    follower kept is a variant equal to its unrepaired twin), then what distillation
    kept ("; distilled, epoch 2 of 2" or "; distillation not kept")."""
    validated = [f for f in fits if f.get("held_residual") is not None]
    runs = [f for f in validated if "follower" not in f]
    if not runs:
        return {}
    fitted = ("fit", "distilled")
    kept = f"{sum(f.get('kept') in fitted for f in runs)}/{len(runs)} runs"
    followers = [f for f in validated if "follower" in f]
    if followers:
        kept += f", {sum(f.get('kept') in fitted for f in followers)}/{len(followers)} followers"
    refused = sorted({
        d for f in validated if f.get("kept") == "unrepaired"
        for d, v in (f.get("held_by_domain") or {}).items() if v["residual"] >= v["unrepaired"]
    })  # fmt: skip
    if refused:
        kept += f" (not kept: worse on held-out {', '.join(refused)})"
    distilled = runs[0].get("distilled")
    if distilled:
        best, epochs = distilled["best_epoch"], distilled["epochs"]
        kept += f"; distilled, epoch {best} of {epochs}" if best else "; distillation not kept"
    out = {
        "repair_held_residual": max(float(f["held_residual"]) for f in runs),
        "repair_kept": kept,
    }
    gate = runs[0].get("gate")
    if gate:
        out |= {"repair_gate": gate["kept"], "repair_held_loss_ratio": gate["worst_loss_ratio"]}
        tried = gate.get("tried") or []
        if tried and gate["kept"] != tried[0]:  # a fallback: the row says which and why
            out["repair_kept"] = f"{kept}; gate kept {gate['kept']} (held-out loss per domain)"
    return out


def protocol_columns(spec: JobSpec, dtype: str, model: ModelSpec | None = None) -> dict[str, Any]:
    """What a row was fitted on (`model`'s calibration) and measured under
    (`pipeline.records.protocol`)."""
    cal = asdict(spec.calibration_for(model) if model is not None else spec.calibration)
    return {
        "calibration": json.dumps(cal, sort_keys=True),
        "calibration_id": calibration_id(cal),
        "evaluation": json.dumps(asdict(spec.evaluation), sort_keys=True),
        "protocol": protocol_id(asdict(spec.evaluation), dtype),
        "reference_claim": spec.tracking.reference,
    }


def costs(
    point: GridPoint, facts: ModelFacts, result: PointResult, seq_len: int
) -> dict[str, float]:
    """The row's cost columns (`lorp.serving_cost`), counted from the model's shape, the
    blocks keeping their attention and their MLP and its exact parameter count, at the
    serving dtype and `seq_len` (`cost_seq_len`); and the prefill FLOPs, decode bytes and
    predicted decode speed-up at 4k and 32k tokens of context (`_4k`, `_32k`), where a
    KV cache removed with an attention weighs most."""
    if facts.shape is None:
        return {}
    from lorp.models.sublayers import kept_attention_blocks, kept_mlp_blocks

    kept, params, dense = result.kept, result.params, result.params_dense
    mlp = None
    if point.sublayer:
        n = point.model.n_blocks
        kept, mlp = kept_attention_blocks(n, point.units), kept_mlp_blocks(n, point.units)
    dtype = point.model.spec.dtype
    out = cost_columns(facts.shape, kept, params, dense, dtype, seq_len, mlp)
    for suffix, context in CONTEXTS.items():
        at = cost_columns(facts.shape, kept, params, dense, dtype, context, mlp)
        out |= {f"{name}_{suffix}": at[name] for name in AT_CONTEXT}
    return out


CONTEXTS = {"4k": 4096, "32k": 32768}
"""The contexts besides the evaluation's that every row's costs are counted at."""
AT_CONTEXT = ("prefill_flops_per_token", "decode_bytes_per_token", "predicted_decode_speedup")


def cost_seq_len(evaluation: EvaluationSpec, calibration: CalibrationSpec) -> int:
    """The sequence length the cost columns count at: the evaluation's (its prefills and
    windows), else the calibration's."""
    return evaluation.seq_len if evaluation.enabled else calibration.seq_len


def _finite_or_none(value: Any) -> bool:
    return value is None or isinstance(value, int | float) and not math.isnan(float(value))


def headline(row: dict[str, Any], corpora: tuple[str, ...]) -> str:
    """The figure a log line shows for a point: the first perplexity, else accuracy."""
    from pipeline.evaluation.metrics import metric_name

    for name in [metric_name(c) for c in corpora] + ["acc_avg"]:
        value = row.get(name)
        if isinstance(value, float) and math.isfinite(value):
            return f"{name} {value:,.2f}"
    if row.get("sublayers"):
        return f"{len(row['sublayers'])} sub-layers removed"
    return f"{len(row.get('pruned_layers') or [])} blocks pruned"
