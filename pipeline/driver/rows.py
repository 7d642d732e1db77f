"""A finished grid point's catalog row, the one place it is assembled (`catalog_row`): the
job's columns (`JobColumns`), the model's (`ModelFacts`), the point's selection and
planning, its result's figures, its repair's verdict and its serving costs, as a
`pipeline.catalog.row.CatalogRow`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lorp
from lorp.models.loading import read_config
from lorp.models.shape import ModelShape
from lorp.serving_cost import cost_columns
from pipeline.catalog.protocol import calibration_id, protocol_id
from pipeline.catalog.row import CatalogRow, now
from pipeline.messages import PointResult
from pipeline.plan.grid import GridPoint, ModelPlan
from pipeline.spec.calibration import CalibrationSpec
from pipeline.spec.evaluation import EvaluationSpec

if TYPE_CHECKING:
    from lorp.locality.profile import Profile


@dataclass(frozen=True)
class JobColumns:
    """What every row of a job says of it: its name and run id, where its MLflow runs and
    files are, and the evaluation its figures were measured under."""

    job: str
    run_id: str
    tracking_uri: str
    experiment_id: str
    storage: str
    """The job's storage (`Storage.uri()`): where the rows' files are."""
    evaluation: EvaluationSpec
    reference_claim: bool
    """The job claims its protocol as its models' reference (`tracking.reference`)."""


@dataclass(frozen=True)
class ModelFacts:
    """Model-level facts shared by all of a model's rows."""

    rls: float
    k: int | None
    labels: list[int] | None
    stats_file: str | None
    shape: ModelShape | None = None
    """The dims its rows' cost columns are counted from (`lorp.serving_cost`)."""
    calibration: CalibrationSpec | None = None
    """What the model was calibrated on (`ModelPlan.calibration`)."""


def model_facts(
    profile: Profile, stats_file: str | None, model_path: Path, calibration: CalibrationSpec
) -> ModelFacts:
    """A model's facts: its profile's RLS, K and cluster labels, its S file, its shape
    from the config in `model_path` and its model's blocks (on the meta device), and its
    calibration."""
    from lorp.models.disk_names import model_of
    from lorp.models.loading import load_config

    labels = list(profile.labels) if profile.labels is not None else None
    model = model_of(load_config(model_path))
    shape = ModelShape.of_model(model, read_config(model_path))
    return ModelFacts(profile.rls, profile.k, labels, stats_file, shape, calibration)


@dataclass(frozen=True)
class RowContext:
    """Where a point's own records are: its MLflow run, its checkpoint, its backend."""

    run_id: str
    """The point's MLflow run."""
    checkpoint: str | None
    """Its checkpoint's URI in the job's storage; None: not stored."""
    backend: str


def catalog_row(
    point: GridPoint, result: PointResult, facts: ModelFacts, job: JobColumns, ctx: RowContext
) -> CatalogRow:
    """The catalog row of a finished point."""
    details = dict(point.selection.details) if point.selection else {}
    repair = repair_columns(result.repair)
    return CatalogRow(
        grid_key=point.key,
        **model_columns(point.model, facts, job),
        method=point.method_name,
        method_label=point.label,
        variant=point.options.get("variant"),
        options=json.dumps(point.options, sort_keys=True),
        budget=point.budget,
        pruned_layers=list(point.layers),
        kept_layers=result.kept,
        removed_kinds=removed_kinds(point, facts),
        **expert_columns(point, facts),
        granularity=point.granularity if point.pruned else None,
        sublayers=sublayer_labels(point),
        stages=json.dumps(details["stages"]) if details.get("stages") else None,
        memory_plan=memory_plan(point),
        repair=point.repair if point.pruned else None,
        repair_fits=json.dumps(result.repair) if result.repair else None,
        repair_kept=repair.pop("repair_kept", None),
        repair_gate=repair.pop("repair_gate", None),
        repair_held_loss_ratio=repair.pop("repair_held_loss_ratio", None),
        k=_k(details.get("k", facts.k)),  # LoRP's own K (fixed or from RLS), else the model's
        zero_shot=json.dumps(result.zero_shot, sort_keys=True) if result.zero_shot else None,
        window_nll=json.dumps(result.window_nll, sort_keys=True) if result.window_nll else None,
        serving=json.dumps(result.serving, sort_keys=True) if result.serving else None,
        params=result.params,
        params_dense=result.params_dense,
        checkpoint=ctx.checkpoint,
        eval_backend=ctx.backend,
        mlflow_run_id=ctx.run_id,
        created_at=now(),
        lorp_version=lorp.__version__,
        figures=figures(point, result, facts, job.evaluation, repair),
    )


def model_columns(plan: ModelPlan, facts: ModelFacts, job: JobColumns) -> dict[str, Any]:
    """What a row says of its job and its model: which they are, the model's profile,
    what it was calibrated on and measured under, where the job's records are."""
    cal = asdict(facts.calibration or plan.calibration)
    return {
        "job": job.job,
        "run_id": job.run_id,
        "model": plan.label,
        "model_ref": plan.spec.ref,
        "family": plan.family,
        "fingerprint": plan.fingerprint,
        "dtype": plan.spec.dtype,
        "n_blocks": plan.n_blocks,
        "rls": facts.rls,
        "labels": facts.labels,
        "calibration": json.dumps(cal, sort_keys=True),
        "calibration_id": calibration_id(cal),
        "evaluation": json.dumps(asdict(job.evaluation), sort_keys=True),
        "protocol": protocol_id(asdict(job.evaluation), plan.spec.dtype),
        "reference_claim": job.reference_claim,
        "stats_file": facts.stats_file,
        "storage": job.storage,
        "tracking_uri": job.tracking_uri,
        "experiment_id": job.experiment_id,
    }


def _k(k: Any) -> int | None:
    return int(k) if k is not None else None


def figures(
    point: GridPoint,
    result: PointResult,
    facts: ModelFacts,
    evaluation: EvaluationSpec,
    repair: dict[str, Any],
) -> dict[str, float | None]:
    """The row's figures: what selecting it cost, its repair's residuals, its serving
    costs, and what its evaluation measured (NaN left out)."""
    out: dict[str, float | None] = {"n_evals": float(point.n_evals), "select_s": point.select_s}
    out |= repair
    cal = facts.calibration or point.model.calibration
    out |= costs(point, facts, result, cost_seq_len(evaluation, cal))
    measured = {k: v for k, v in result.metrics.items() if _finite_or_none(v)}
    return out | {k: None if v is None else float(v) for k, v in measured.items()}


def expert_columns(point: GridPoint, facts: ModelFacts) -> dict[str, Any]:
    """A mixture's experts per layer after the row's cut, the cut's selector and size, and
    what it removed (null for a dense model)."""
    dense = max(facts.shape.experts) if facts.shape and facts.shape.experts else None
    if dense is None:
        return {"experts": None, "expert_method": None, "expert_budget": None}
    cut = point.experts
    return {
        "experts": dense - point.expert_budget,
        "expert_method": cut.method if cut else None,
        "expert_budget": point.expert_budget,
        "experts_removed": json.dumps(cut.as_dict()) if cut else None,
    }


def removed_kinds(point: GridPoint, facts: ModelFacts) -> list[str] | None:
    """The kind of each block a block variant removes (`ModelShape.kinds`)."""
    shape = facts.shape
    if not point.layers or shape is None or not shape.kinds:
        return None
    return [shape.kinds[b] for b in point.layers]


def memory_plan(point: GridPoint) -> str | None:
    """Per stage, whether the model was held whole or streamed (JSON)."""
    if not point.model.memory:
        return None
    return json.dumps(point.model.memory_record(), sort_keys=True)


def sublayer_labels(point: GridPoint) -> list[str] | None:
    """The sub-layers a point removes (`attn.5`, `mlp.9`), None at block granularity."""
    from lorp.models.sublayers import unit_label

    return [unit_label(u) for u in point.units] if point.sublayer else None


def repair_columns(fits: list[dict[str, Any]]) -> dict[str, Any]:
    """A repaired point's figures: the worst run's share of its gap left on calibration
    (`repair_residual`; followers are counted in `repair_kept` only), and the held-out
    validation's (`repair_validation`)."""
    runs = [f for f in fits if "follower" not in f and "residual" in f]  # a peer's: none
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
    refused = sorted(
        {
            d
            for f in validated
            if f.get("kept") == "unrepaired"
            for d, v in (f.get("held_by_domain") or {}).items()
            if v["residual"] >= v["unrepaired"]
        }
    )
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
    dtype, shape = point.model.spec.dtype, facts.shape
    if point.experts:  # the dense model's costs count its own experts, the variant's its
        shape = shape.with_experts(point.experts.kept)
    out = cost_columns(shape, kept, params, dense, dtype, seq_len, mlp, facts.shape)
    out["active_params"] = float(params - shape.idle_expert_params(kept))
    for suffix, context in CONTEXTS.items():
        at = cost_columns(shape, kept, params, dense, dtype, context, mlp, facts.shape)
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
