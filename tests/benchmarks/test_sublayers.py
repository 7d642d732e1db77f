"""benchmarks/sublayers.py: budgets matched to a block budget's decode cost, the equal-cost
comparison and the page, on a tiny model and scripted rows."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from lorp.models.shape import ModelShape
from lorp.models.sublayers import block_units, sublayer_parameters
from tests.helpers.paths import REPO
from tests.helpers.tiny_models import tiny_model
from tests.helpers.windows import token_windows

sys.path.insert(0, str(REPO))

METHODS = ("shortgpt", "lorp")

from benchmarks.sublayers import (  # noqa: E402
    SelectionLosses,
    choose,
    decode_bytes,
    extended,
    grid,
    matched_budget,
    matched_mixed,
)
from benchmarks.sublayers_report import merged  # noqa: E402


def test_matched_budgets_cost_at_most_the_block_variant_at_4k() -> None:
    model = tiny_model("llama")  # 6 blocks
    shape = ModelShape.from_config(model.config.to_dict())
    dense = sum(p.numel() for p in model.parameters())
    units = block_units([1])
    target = decode_bytes(shape, units, dense - sublayer_parameters(model, units), "float32", 4096)
    k = matched_budget(model, shape, "attention", target, "float32")
    cost = lambda u: decode_bytes(  # noqa: E731
        shape, u, dense - sublayer_parameters(model, u), "float32", 4096
    )
    assert cost([2 * b for b in range(1, k + 1)]) <= target < cost([2 * b for b in range(1, k)])
    # At 4k a token's KV cache outweighs a tiny model's attention weights: one attention
    # (with its cache) costs less than the block, so it takes more than one to match.
    assert k == 2
    points = grid(model, shape, "float32", methods=METHODS)
    assert ("block", "shortgpt", 4) in points and ("attention", "lorp", 4) in points
    assert ("mlp", "shortgpt", 4) in points  # 4 blocks' decode cost needs every MLP (4 of 4)


def test_a_mixed_budget_is_the_fewest_of_the_methods_own_units_that_cost_no_more() -> None:
    """Mixed units differ in cost (an MLP saves more than an attention): each method's
    mixed budget is matched on the units it would itself remove at each count."""
    import pytest

    from lorp.locality.capture import capture_stats
    from lorp.methods.sublayer_selection import select_units
    from tests.helpers.windows import token_windows

    model = tiny_model("llama")
    shape = ModelShape.from_config(model.config.to_dict())
    dense = sum(p.numel() for p in model.parameters())
    S = capture_stats(model, [token_windows(4)], sublayers=True, progress=False).similarity()
    units = block_units([1, 2])
    target = decode_bytes(shape, units, dense - sublayer_parameters(model, units), "float32", 4096)
    cost = lambda u: decode_bytes(  # noqa: E731
        shape, u, dense - sublayer_parameters(model, u), "float32", 4096
    )
    for method in ("shortgpt", "lorp"):
        k = matched_mixed(model, shape, S, method, target, "float32")
        chosen = lambda j, m=method: list(select_units(S, j, "mixed", m).layers)  # noqa: E731
        assert cost(chosen(k)) <= target
        assert k == 1 or cost(chosen(k - 1)) > target
        assert ("mixed", method, k) in grid(model, shape, "float32", (2,), S, METHODS)
    with pytest.raises(SystemExit, match="max_windows differs"):
        merged({"max_windows": 8, "dense": {}}, {"max_windows": 16, "dense": {}}, "b")


def test_sleb_points_are_scored_once_and_matched_on_their_own_units(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """SLEB's points: candidate losses on a copy of the model in the selection dtype, each
    candidate scored once across budgets (SLEB at 3 replays SLEB at 2's steps), its mixed
    budget matched on the units it removes, and a budget of every eligible unit taken
    without scoring."""
    import torch

    from lorp.locality.capture import capture_stats
    from lorp.methods.removal_loss import LossEvaluator
    from lorp.methods.sublayer_selection import select_units
    from lorp.models.sublayers import eligible_units

    model = tiny_model("llama")
    shape = ModelShape.from_config(model.config.to_dict())
    held = token_windows(4)
    S = capture_stats(model, [held], sublayers=True, progress=False).similarity()
    losses = SelectionLosses(model, held, "float32")
    two = choose(S, 2, "mixed", "sleb", losses)
    assert losses.evaluated == 8 + 7
    three = choose(S, 3, "mixed", "sleb", losses)
    assert losses.evaluated == 8 + 7 + 6 and set(two) < set(three)
    plain = LossEvaluator(model, torch.as_tensor(held), units=True)
    assert three == list(select_units(S, 3, "mixed", "sleb", losses=plain).layers)
    assert choose(S, 4, "attention", "sleb", losses) == eligible_units("attention", 6)
    assert losses.evaluated == 21  # every attention goes: nothing to rank
    finercut = choose(S, 2, "mixed", "finercut", losses)  # its own measure, its own memo
    assert len(losses.memos["js"]) == 8 + 7 and losses.evaluated == 21 + 15
    js = LossEvaluator(model, torch.as_tensor(held), units=True, measure="js")
    assert finercut == list(select_units(S, 2, "mixed", "finercut", losses=js).layers)
    some = list(losses.memos["js"])[:3]
    assert [losses.memos["js"][c] for c in some] == pytest.approx(js(some), rel=1e-5)
    dense = sum(p.numel() for p in model.parameters())
    units = block_units([1, 2])
    target = decode_bytes(shape, units, dense - sublayer_parameters(model, units), "float32", 4096)
    k = matched_mixed(model, shape, S, "sleb", target, "float32", losses)
    cost = lambda u: decode_bytes(  # noqa: E731
        shape, u, dense - sublayer_parameters(model, u), "float32", 4096
    )
    assert cost(choose(S, k, "mixed", "sleb", losses)) <= target
    assert k == 1 or cost(choose(S, k - 1, "mixed", "sleb", losses)) > target
    points = grid(model, shape, "float32", (2,), S, ("shortgpt", "sleb"), losses)
    assert ("mixed", "sleb", k) in points and ("mlp", "sleb", 4) in points
    assert not any(m == "lorp" for _, m, _ in points)


def test_an_extended_run_must_share_the_earlier_runs_settings(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    args = SimpleNamespace(
        extend=tmp_path, dtype="float32", max_windows=8, loss_samples=8, sequential=False,
        distill_epochs=0, zero_shot_limit=50,
    )  # fmt: skip
    with pytest.raises(SystemExit, match="--extend: no run of m at"):
        extended(args, "m")
    base = {"model": "m", "dtype": "float32", "max_windows": 16, "loss_samples": 8,
            "sequential": False, "distill_epochs": 0, "zero_shot_limit": 50}  # fmt: skip
    (tmp_path / "m.json").write_text(json.dumps(base))
    with pytest.raises(SystemExit, match="max_windows differs \\(16 vs 8\\)"):
        extended(args, "m")
    args.max_windows = 16
    assert extended(args, "m") == base
    assert extended(SimpleNamespace(extend=None), "m") is None
