"""Planning (`pipeline.plan`): grid keys (evaluation settings, distillation) and grid points
(a repaired twin left out where it cannot be repaired)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.plan import GridPoint, ModelPlan, grid_key, plan_points
from pipeline.spec.checks import SpecError
from pipeline.spec.parse import parse_spec
from tests.helpers.job_specs import tiny_job
from tests.helpers.tiny_models import save_tiny_ptb


def test_how_long_the_speed_pass_times_leaves_grid_keys_alone() -> None:
    """A catalog's points stay done when only the speed pass's budget or interval
    changes (`--force-speed` re-times); asking for serving changes the figures, so the key.
    The key of a job without serving is what it was before serving existed."""
    from pipeline.plan import evaluation_key
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


@pytest.mark.integration
def test_a_run_from_block_0_is_not_repaired_where_embeddings_are_tied(tmp_path: Path) -> None:
    """Planning leaves the repaired twin out, with the reason; the pruned variant stays."""
    from lorp.methods.registry import Selection

    model = save_tiny_ptb("gemma3_text", tmp_path / "gemma3")
    spec = parse_spec(
        tiny_job(
            tmp_path, model, budgets=[2], methods=[{"name": "shortgpt"}], repair=["none", "linear"]
        )
    )
    plan = ModelPlan(spec.models[0], model, "fp", 6, "gemma3", (2,), str(model), "local", True)
    picks = {2: (0, 1)}

    def select(m, budget):  # type: ignore[no-untyped-def]
        return Selection(picks[budget], m.name, budget, 6), 0.0

    refused: list[tuple[GridPoint, str]] = []
    points = plan_points(spec, plan, "key", "none", select, lambda p, why: refused.append((p, why)))
    assert [p.label for p in points] == ["shortgpt"]
    assert [p.label for p, _ in refused] == ["shortgpt+linear"]
    assert "run 0-1 starts at block 0" in refused[0][1] and "ties its embeddings" in refused[0][1]

    untied = ModelPlan(spec.models[0], model, "fp", 6, "gemma3", (2,), str(model), "local", False)
    both = plan_points(spec, untied, "key", "none", select)
    assert [p.label for p in both] == ["shortgpt", "shortgpt+linear"]
    assert both[0].key != both[1].key and both[1].runs == [(0, 1)]


@pytest.mark.integration
def test_sub_layer_budgets_count_units_and_too_many_are_refused_in_planning(
    tmp_path: Path,
) -> None:
    """A fraction counts the granularity's units; a budget beyond the units a model may
    lose names the budget, the model and the granularity; Gemma 3 is marked unservable."""
    from pipeline.plan import plan_model

    model = save_tiny_ptb("llama", tmp_path / "llama")  # 6 blocks: 4 removable attentions
    one = {"methods": [{"name": "shortgpt"}]}
    spec = parse_spec(
        tiny_job(tmp_path, model, budgets=[2, 0.5], granularity=["block", "mixed"], **one)
    )
    plan = plan_model(spec, 0, spec.models[0])
    assert plan.budgets_for("block") == (2, 3) and plan.budgets_for("mixed") == (2, 6)
    assert plan.not_servable is None
    too_many = parse_spec(
        tiny_job(tmp_path, model, budgets=[4, 5], granularity=["attention"], **one)
    )
    with pytest.raises(SpecError) as exc:
        plan_model(too_many, 0, too_many.models[0])
    assert "budgets[1]: 5 attention units, but a 6-block model has 4" in str(exc.value)
    assert "(tiny, granularity attention)" in str(exc.value)
    gemma = save_tiny_ptb("gemma3_text", tmp_path / "gemma3")
    g = parse_spec(tiny_job(tmp_path, gemma, budgets=[2], granularity=["attention"], **one))
    assert "gemma3" in str(plan_model(g, 0, g.models[0]).not_servable)


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
