"""A model's grid points, made from its selections (`pipeline.plan.points`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorp.methods.registry import Selection
from pipeline.plan.grid import ModelPlan
from pipeline.plan.points import ModelGrid, selection_order
from pipeline.spec.models import MethodSpec
from pipeline.spec.parse import parse_spec
from tests.helpers.job_specs import tiny_job
from tests.helpers.tiny_models import save_tiny_ptb


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

    m = spec.methods[0]
    sel = Selection(picks[2], m.name, 2, 6)
    points, refused = ModelGrid(plan, "key", None, spec.repair_settings, True).points(
        m, sel, 0.0, "block"
    )
    assert [p.label for p in points] == ["shortgpt"]
    assert [p.label for p, _ in refused] == ["shortgpt+linear"]
    assert "run 0-1 starts at block 0" in refused[0][1] and "ties its embeddings" in refused[0][1]

    untied = ModelPlan(spec.models[0], model, "fp", 6, "gemma3", (2,), str(model), "local", False)
    both, none = ModelGrid(untied, "key", None, spec.repair_settings, True).points(
        m, sel, 0.0, "block"
    )
    assert none == []
    assert [p.label for p in both] == ["shortgpt", "shortgpt+linear"]
    assert both[0].key != both[1].key and both[1].runs == [(0, 1)]


def test_a_grid_keys_each_repair_and_says_where_each_variant_is_stored() -> None:
    """One point per repair, with distinct keys; the dense point only where the job
    evaluates; a pruned point's checkpoint path is decided here, once, and none where the
    job stores no variant."""
    spec = parse_spec(tiny_job(Path("/x"), Path("/m"), budgets=[2], repair=["none", "linear"]))
    plan = ModelPlan(spec.models[0], Path("/m"), "fp", 6, "llama", (2,), "/m", "local")
    m = MethodSpec("shortgpt")
    sel = Selection((2, 3), "shortgpt", 2, 6)
    grid = ModelGrid(plan, "key", {"seq_len": 8}, spec.repair_settings, True)
    dense = grid.dense()
    assert dense is not None and dense.is_dense and dense.checkpoint is None
    made, refused = grid.points(m, sel, 0.5, "block")
    assert refused == [] and [p.label for p in made] == ["shortgpt", "shortgpt+linear"]
    assert len({dense.key, *(p.key for p in made)}) == 3
    assert [p.checkpoint for p in made] == [
        "checkpoints/tiny/shortgpt-b2",
        "checkpoints/tiny/shortgpt_linear-b2",
    ]
    assert all(p.select_s == 0.5 for p in made)
    unstored = ModelGrid(plan, "key", None, spec.repair_settings, False)
    assert unstored.dense() is None
    assert [p.checkpoint for p in unstored.points(m, sel, 0.0, "block")[0]] == [None, None]


def test_selections_on_the_loss_actors_come_last() -> None:
    """SLEB scores candidate models on the loss actors: its selections wait until every
    similarity-only selection is made, whatever the job's order."""
    methods = (MethodSpec("sleb"), MethodSpec("shortgpt"), MethodSpec("streamline"))
    order = [(g, m.name) for g, m in selection_order(("block",), methods)]
    assert order == [("block", "shortgpt"), ("block", "streamline"), ("block", "sleb")]


def test_an_expert_cut_is_a_point_alone_and_with_each_unrepaired_depth_point() -> None:
    """The cut alone counts experts (granularity `experts`), and beside each unrepaired
    block point it keeps the block selection: every point its own key and checkpoint, the
    repaired twin left alone; `random`'s seed is part of its key, not `reap`'s."""
    from lorp.experts.selection import ExpertSelection

    spec = parse_spec(tiny_job(Path("/x"), Path("/m"), budgets=[2], repair=["none", "linear"]))
    plan = ModelPlan(spec.models[0], Path("/m"), "fp", 6, "qwen3_moe", (2,), "/m", "local")
    grid = ModelGrid(plan, "key", {"seq_len": 8}, spec.repair_settings, True)
    depth, _ = grid.points(MethodSpec("shortgpt"), Selection((2, 3), "shortgpt", 2, 6), 0, "block")
    cut = ExpertSelection("reap", {1: (0, 3), 2: (1, 2)}, 8)
    dense = grid.dense()
    assert dense is not None
    alone, both = grid.expert_points(cut, 0, [dense, *depth])
    assert (alone.label, alone.name, alone.budget) == ("reap-experts", "reap-experts-e2", 2)
    assert (alone.granularity, alone.layers, alone.is_dense, alone.pruned) == (
        "experts",
        (),
        False,
        True,
    )
    assert (both.label, both.name, both.layers) == (
        "shortgpt&reap-experts",
        "shortgpt&reap-experts-b2-e2",
        (2, 3),
    )
    assert (both.budget, both.expert_budget, both.repair, both.sublayer) == (2, 2, "none", False)
    assert both.checkpoint == "checkpoints/tiny/shortgpt_reap-experts-b2-e2"
    keys = {p.key for p in (*depth, alone, both)}
    assert len(keys) == 4
    assert grid.expert_points(cut, 7, depth)[0].key == alone.key
    rand = ExpertSelection("random", cut.removed, 8)
    assert grid.expert_points(rand, 0, [])[0].key != grid.expert_points(rand, 1, [])[0].key
