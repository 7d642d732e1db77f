"""What a grid point's MLflow run and its log line say: its params, metrics and tags, its
memory against its plan (its `point` event), and the headline figure of its line."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from lorp.models.surgery import kept_layers
from pipeline.driver.rows import sublayer_labels
from pipeline.messages import PointResult
from pipeline.plan.grid import GridPoint


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
    `evaluate` decision said the mode it chose needs (a job checks its plan with them):
    without what a repair keeps (`kept_bytes`) for a point that does not repair."""
    decision = point.model.decision("evaluate")
    if result.peak_gib is None or decision is None:
        return {}
    kept = decision.kept_bytes if point.repair == "none" else 0
    planned = (decision.need_bytes - kept) / 2**30
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


def headline(row: dict[str, Any], corpora: tuple[str, ...]) -> str:
    """The figure a log line shows for a point: the first perplexity, else accuracy."""
    from pipeline.evaluation.corpora import metric_name

    for name in [metric_name(c) for c in corpora] + ["acc_avg"]:
        value = row.get(name)
        if isinstance(value, float) and math.isfinite(value):
            return f"{name} {value:,.2f}"
    if row.get("sublayers"):
        return f"{len(row['sublayers'])} sub-layers removed"
    return f"{len(row.get('pruned_layers') or [])} blocks pruned"
