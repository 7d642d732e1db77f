"""What a grid point's MLflow run and its log line say (`pipeline.driver.point_records`): its
params, metrics and tags, its memory against its plan, and the headline figure."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from lorp.models.memory import Decision
from pipeline.driver.point_records import (
    headline,
    point_memory,
    point_metrics,
    point_params,
    point_tags,
)
from pipeline.messages import PointResult
from pipeline.plan.grid import GridPoint, ModelPlan
from pipeline.spec.parse import parse_spec
from tests.helpers.grid_points import selected
from tests.helpers.job_specs import tiny_job

SPEC = parse_spec(
    tiny_job(Path("/runs"), Path("/model"), budgets=[2], methods=[{"name": "shortgpt"}])
    | {"repair": ["none", "linear"]}
)
PLAN = ModelPlan(SPEC.models[0], Path("/model"), "fp", 6, "llama", (2,), "/model", "dir")
PLAIN, REPAIRED = selected(SPEC, PLAN, (2, 3), seconds=0.5, n_evals=12)
GIB = 2**30


def with_decision(point: GridPoint, decision: Decision) -> GridPoint:
    return dataclasses.replace(
        point, model=dataclasses.replace(PLAN, memory=(("evaluate", decision),))
    )


def test_a_points_params_are_its_method_budget_blocks_and_repair() -> None:
    assert point_params(REPAIRED) == {
        "method": "shortgpt",
        "method_label": "shortgpt+linear",
        "options": {},
        "budget": 2,
        "pruned_layers": [2, 3],
        "kept_layers": [0, 1, 4, 5],
        "repair": "linear",
    }


def test_a_sub_layer_points_params_name_its_granularity_and_sub_layers() -> None:
    units = dataclasses.replace(PLAIN, granularity="attention")  # units 2 and 3
    params = point_params(units)
    assert (params["granularity"], params["sublayers"]) == ("attention", ["attn.1", "mlp.1"])
    assert params["pruned_layers"] == [] and params["kept_layers"] == list(range(6))


def test_a_points_metrics_are_its_figures_size_time_and_selection_cost() -> None:
    result = PointResult(PLAIN.key, [0, 1, 4, 5], 900, 1200, {"ppl_ptb": 31.5}, seconds=2.0)
    assert point_metrics(PLAIN, result) == {
        "ppl_ptb": 31.5,
        "params": 900,
        "seconds": 2.0,
        "n_evals": 12,
        "select_s": 0.5,
    }


def test_a_points_memory_is_its_peak_beside_what_its_plan_needs() -> None:
    result = PointResult(PLAIN.key, [0, 1, 4, 5], 900, 1200, peak_gib=0.2)
    assert point_memory(PLAIN, result) == {}  # no plan decided
    decision = Decision("evaluate", "streamed", GIB // 3, 4 * GIB, GIB)
    planned = with_decision(PLAIN, decision)
    expected = {"peak_gib": 0.2, "planned_gib": 0.3333, "mode": "streamed"}  # GiB, 4 places
    assert point_memory(planned, result) == expected
    unmeasured = dataclasses.replace(result, peak_gib=None)  # a vLLM engine's processes
    assert point_memory(planned, unmeasured) == {}
    # What a repair keeps (its fit, sums and maps) is planned for repaired points only.
    keeps = Decision("evaluate", "memory", GIB, GIB, 2 * GIB, 2, GIB // 4)
    assert point_memory(with_decision(PLAIN, keeps), result)["planned_gib"] == 0.75
    assert point_memory(with_decision(REPAIRED, keeps), result)["planned_gib"] == 1.0


def test_a_points_tags_are_its_checkpoint_backend_memory_plan_and_sub_layers() -> None:
    assert point_tags({}, None, "vllm") == {"checkpoint": "", "eval_backend": "vllm"}
    row = {"memory_plan": '{"evaluate": {}}', "sublayers": ["attn.1"], "granularity": "mixed"}
    assert point_tags(row, "/c/p", "transformers") == {
        "checkpoint": "/c/p",
        "eval_backend": "transformers",
        "memory_plan": '{"evaluate": {}}',
        "granularity": "mixed",
        "trust_remote_code": "true",
    }


def test_the_headline_is_the_first_finite_perplexity_else_accuracy_else_what_was_removed() -> None:
    row = {"ppl_lee": math.nan, "ppl_ptb": 1234.567, "acc_avg": 50.0, "pruned_layers": [2, 3]}
    assert headline(row, ("lee", "ptb")) == "ppl_ptb 1,234.57"
    assert headline(row, ("lee",)) == "acc_avg 50.00"
    assert headline({"pruned_layers": [2, 3]}, ("ptb",)) == "2 blocks pruned"
    assert headline({"sublayers": ["attn.1", "mlp.1", "mlp.2"]}, ()) == "3 sub-layers removed"
    assert headline({"pruned_layers": None}, ()) == "0 blocks pruned"
