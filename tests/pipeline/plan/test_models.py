"""Each model of a job resolved and checked before any work (`pipeline.plan.models`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.spec.checks import SpecError
from pipeline.spec.parse import parse_spec
from tests.helpers.job_specs import tiny_job
from tests.helpers.tiny_models import save_tiny_ptb


@pytest.mark.integration
def test_sub_layer_budgets_count_units_and_too_many_are_refused_in_planning(
    tmp_path: Path,
) -> None:
    """A fraction counts the granularity's units; a budget beyond the units a model may
    lose names the budget, the model and the granularity; Gemma 3 is marked unservable."""
    from pipeline.plan.models import plan_model

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


@pytest.mark.integration
def test_what_a_family_cannot_take_is_one_warning_line_in_the_plan(
    tmp_path: Path,
) -> None:
    """Jamba's pattern refuses removing block 1 alone; MiniMax's blocks keep its depth in
    their settings, take no repair and do not split. Each is a line naming the model; a
    Llama has none."""
    from pipeline.plan.report import plan_job, plan_lines
    from tests.helpers.family_models import save_family_ptb

    refs = {f: save_family_ptb(f, tmp_path / f) for f in ("jamba", "minimax")}
    llama = save_tiny_ptb("llama", tmp_path / "llama")
    spec = tiny_job(tmp_path, llama, budgets=[1], repair=["none", "linear"])
    spec["methods"] = [{"name": "shortgpt"}]
    spec["granularity"] = ["block", "mlp"]
    spec["models"] = [{"ref": str(ref), "name": f} for f, ref in refs.items()]
    spec["models"].append({"ref": str(llama), "name": "llama"})
    outline = plan_job(parse_spec(spec))
    assert outline.ok, outline.problems
    warned = [w for w in outline.warnings if w.split(":")[0] in (*refs, "llama")]
    assert [w.split(":")[0] for w in warned] == ["jamba", "minimax", "minimax", "minimax"]
    assert warned[0].startswith(
        "jamba: removing block 1 alone is refused (Jamba: kept block 2 would reload as "
        "another block at 1 (its modules differ"
    )
    assert "(its settings differ: ('self_attn', 'num_hidden_layers', 4)" in warned[1]
    assert warned[2] == (
        "minimax: MiniMax takes no linear repair (its residual stream carries the normed "
        "state scaled by alpha and beta (DeepNorm-like), not input + the branches' outputs); "
        "its linear points fail (repair: [none] prunes it unrepaired)"
    )
    assert all("\n" not in w for w in warned)
    assert warned[3].startswith("minimax: MiniMax cannot lose sub-layers (its residual")
    assert sum(line.startswith("warning: minimax:") for line in plan_lines(outline, 1)) == 3


@pytest.mark.integration
def test_expert_budgets_count_experts_per_layer_and_must_leave_top_k(tmp_path: Path) -> None:
    """A fraction counts a layer's routed experts; a budget that leaves fewer than top-k
    names the budget and the model; a dense model of the job is a warning line."""
    from pipeline.plan.models import plan_model
    from pipeline.plan.report import plan_job
    from tests.helpers.family_models import save_family_ptb

    moe = save_family_ptb("qwen3_moe", tmp_path / "moe")  # 4 experts, top-2
    llama = save_tiny_ptb("llama", tmp_path / "llama")
    spec = tiny_job(tmp_path, moe, budgets=[1], methods=[{"name": "shortgpt"}])
    spec["models"] = [{"ref": str(moe), "name": "moe"}, {"ref": str(llama), "name": "llama"}]
    good = parse_spec(spec | {"experts": {"budgets": [0.25, 2], "methods": ["reap"]}})
    plan = plan_model(good, 0, good.models[0])
    assert (plan.n_experts, plan.expert_budgets, plan.expert_groups) == (4, (1, 2), 1)
    assert plan_model(good, 1, good.models[1]).expert_budgets == ()
    outline = plan_job(good)
    warned = [w for w in outline.warnings if w.startswith("llama")]
    assert warned == ["llama: Llama has no routed experts; the expert budgets skip it"]
    moe_points, llama_points = (m.points for m in outline.models)
    assert (moe_points["reap-experts"], moe_points["shortgpt&reap-experts"]) == (2, 2)
    assert not any("experts" in label for label in llama_points)
    bad = parse_spec(spec | {"experts": {"budgets": [1, 0.75]}})
    with pytest.raises(SpecError) as exc:
        plan_model(bad, 0, bad.models[0])
    assert str(exc.value) == (
        "experts.budgets[1]: expert budget 0.75 (= 3 experts) leaves 1 of 4 experts per "
        "layer, fewer than the 2 each token is routed to (moe)"
    )
