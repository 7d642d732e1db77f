"""benchmarks/sublayers/losses.py: the loss-guided methods' candidates scored once each,
on a copy in the selection dtype, and their points matched on the units they remove."""

from __future__ import annotations

import pytest

from benchmarks.sublayers.costs import decode_bytes
from benchmarks.sublayers.losses import SelectionLosses
from benchmarks.sublayers.points import choose, grid, matched_mixed
from lorp.models.shape import ModelShape
from lorp.models.sublayers import block_units, sublayer_parameters
from tests.helpers.tiny_models import tiny_model
from tests.helpers.windows import token_windows


def test_sleb_points_are_scored_once_and_matched_on_their_own_units(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """SLEB's points: candidate losses on a copy of the model in the selection dtype, each
    candidate scored once across budgets (SLEB at 3 replays SLEB at 2's steps), its mixed
    budget matched on the units it removes, and a budget of every eligible unit taken
    without scoring."""
    import torch

    from lorp.locality.capture import capture_stats
    from lorp.methods.sublayer_selection import select_units
    from lorp.models.sublayers import eligible_units
    from lorp.scoring.removal_loss import LossEvaluator

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
