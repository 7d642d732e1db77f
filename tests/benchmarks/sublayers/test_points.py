"""benchmarks/sublayers/points.py: budgets matched to a block budget's decode cost, on a
tiny model."""

from __future__ import annotations

from benchmarks.sublayers.costs import decode_bytes
from benchmarks.sublayers.points import grid, matched_budget, matched_mixed
from benchmarks.sublayers.report import merged
from lorp.models.shape import ModelShape
from lorp.models.sublayers import block_units, sublayer_parameters
from tests.helpers.tiny_models import tiny_model

METHODS = ("shortgpt", "lorp")


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
