"""Planning (`pipeline.plan.grid`): grid keys (evaluation settings, distillation) and grid points
(a repaired twin left out where it cannot be repaired)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.plan.grid import GridPoint, ModelPlan, grid_key
from pipeline.spec.parse import parse_spec
from tests.helpers.job_specs import tiny_job


def test_how_long_the_speed_pass_times_leaves_grid_keys_alone() -> None:
    """A catalog's points stay done when only the speed pass's budget or interval
    changes (`--force-speed` re-times); asking for serving changes the figures, so the key.
    The key of a job without serving is what it was before serving existed."""
    from pipeline.plan.grid import evaluation_key
    from pipeline.spec.evaluation import EvaluationSpec, ServingSpec

    base = evaluation_key(EvaluationSpec(), "vllm")
    assert "serving" not in base and "speed_budget_s" not in base
    timed = EvaluationSpec(speed_budget_s=30.0, speed_half_width=0.05)
    assert evaluation_key(timed, "vllm") == base
    served = evaluation_key(EvaluationSpec(serving=ServingSpec()), "vllm")
    assert served != base and served["serving"]["concurrency"] == 64


@pytest.mark.integration
def test_distillation_is_part_of_a_repaired_points_key_and_nothing_else() -> None:
    """Distilled and least-squares twins are different points; without distillation a
    repaired point's key is what it was before distillation existed."""
    args = ("model", "shortgpt", {}, 2, None, "linear", 100, "auto", 1)
    plain = grid_key(*args)
    assert grid_key(*args, (0, 1e-4)) == plain
    assert grid_key(*args, (2, 1e-4)) != plain
    assert grid_key(*args, (2, 1e-4)) != grid_key(*args, (2, 3e-4)) != grid_key(*args, (3, 3e-4))
    assert grid_key("model", "shortgpt", {}, 2, None) == grid_key(
        *args[:5], "none", 100, "auto", 0, (2, 1e-4)
    )


def test_a_sub_layer_point_is_its_own_slot_and_key() -> None:
    """Its label names the granularity, its key differs from the block point's of the same
    method and budget, and its runs are of units; a block point's key is unchanged."""
    from lorp.methods.registry import Selection
    from pipeline.spec.models import MethodSpec

    spec = parse_spec(tiny_job(Path("/x"), Path("/m"), budgets=[2]))
    plan = ModelPlan(spec.models[0], Path("/m"), "fp", 6, "llama", (2,), "/m", "local")
    m = MethodSpec("shortgpt")
    unit = GridPoint("k", plan, m, Selection((4, 5, 6), "shortgpt", 3, 12), granularity="mixed")
    assert unit.label == "shortgpt-mixed" and unit.layers == () and unit.units == (4, 5, 6)
    assert unit.runs == [(4, 6)] and unit.bound_blocks == 2 and unit.pruned
    assert grid_key("mk", "shortgpt", {}, 2, None) != grid_key(
        "mk", "shortgpt", {}, 2, None, granularity="attention"
    )
    assert grid_key("mk", "shortgpt", {}, 2, None, granularity="block") == grid_key(
        "mk", "shortgpt", {}, 2, None
    )
