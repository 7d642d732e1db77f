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

sys.path.insert(0, str(REPO))

from benchmarks.sublayers import (  # noqa: E402
    compare,
    decode_bytes,
    grid,
    matched_budget,
    matched_mixed,
    merged,
    page,
)

DENSE = {
    "ppl": {"prose": 10.0, "code": 4.0},
    "zero_shot": {"acc_arc_easy": 50.0, "acc_copa": 60.0, "acc_avg": 55.0, "n_copa": 100.0},
}


def row(granularity: str, method: str, budget: int, prose: float, code: float, decode: float):  # type: ignore[no-untyped-def]
    return {
        "granularity": granularity, "method": method, "budget": budget,
        "sublayers": ["attn.1", "mlp.1"] if granularity == "block" else ["attn.2"],
        "ppl": {"prose": prose, "code": code}, "unrepaired": {"prose": 2 * prose, "code": 2 * code},
        "kv_bytes_per_token": 256.0, "decode_bytes_4k": decode, "decode_bytes_4k_dense": 100.0,
    }  # fmt: skip


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
    points = grid(model, shape, "float32")
    assert ("block", "shortgpt", 4) in points and ("attention", "lorp", 4) in points
    assert ("mlp", "shortgpt", 4) in points  # 4 blocks' decode cost needs every MLP (4 of 4)


def test_the_comparison_takes_the_best_sub_block_variant_no_costlier_than_the_block() -> None:
    rows = [
        row("block", "shortgpt", 4, 35.0, 9.0, 80.0),
        row("block", "lorp", 4, 25.0, 12.0, 80.0),  # worst 3.0 (code): the best block
        row("attention", "shortgpt", 6, 14.0, 5.0, 79.0),  # worst 1.4: the best sub-block
        row("mixed", "lorp", 6, 11.0, 4.2, 81.0),  # better, but costlier: not compared
        row("block", "shortgpt", 8, 60.0, 20.0, 60.0),
        row("block", "lorp", 8, 70.0, 16.0, 60.0),
    ]
    result = {"rows": rows, "dense": DENSE}
    out = compare(result)
    assert len(out) == 1  # nothing sub-block is as cheap as 8 blocks here
    c = out[0]
    assert c["block"] == ["block", "lorp", 4] and c["sub_block"] == ["attention", "shortgpt", 6]
    assert (c["block_worst"], c["sub_block_worst"]) == (3.0, 1.4)
    assert (c["block_decode"], c["sub_block_decode"]) == (0.8, 0.79)
    c["block_zero_shot"] = {"acc_arc_easy": 40.0, "acc_copa": 60.0, "acc_avg": 50.0}  # 90%
    c["sub_block_zero_shot"] = {"acc_arc_easy": 50.0, "acc_copa": 54.0, "acc_avg": 52.0}  # 95%
    result |= {"model": "m", "n_blocks": 6, "dtype": "float32", "seconds": 1,
               "max_windows": 16, "loss_samples": 8, "comparison": out}  # fmt: skip
    text = page([result], SimpleNamespace(zero_shot=["arc_easy", "copa"], zero_shot_limit=200))
    line = next(x for x in text.splitlines() if x.startswith("| 4 blocks"))
    assert "| 3.000x | 90.0% |" in line and "| 1.400x | 95.0% | yes |" in line
    assert (
        "| attention | shortgpt | 6 | 1.400x | 1.250x | 2.800x | 256 B | 0.790 | 1.266x |" in text
    )


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
        assert ("mixed", method, k) in grid(model, shape, "float32", (2,), S)
    with pytest.raises(SystemExit, match="max_windows differs"):
        merged({"max_windows": 8, "dense": {}}, {"max_windows": 16, "dense": {}}, "b")


def test_runs_at_other_block_budgets_merge_into_one_model_result() -> None:
    settings = {"model": "m", "dtype": "float32", "max_windows": 8, "loss_samples": 8,
                "sequential": False, "distill_epochs": 0, "zero_shot_limit": 50,
                "dense": DENSE, "seconds": 5}  # fmt: skip
    a = settings | {"rows": [row("block", "lorp", 4, 25.0, 12.0, 80.0)],
                    "comparison": [{"blocks": 4}]}  # fmt: skip
    b = settings | {"rows": [row("block", "lorp", 4, 99.0, 99.0, 80.0),
                             row("block", "lorp", 2, 15.0, 6.0, 90.0)],
                    "comparison": [{"blocks": 4, "x": 1}, {"blocks": 2}]}  # fmt: skip
    out = merged(a, b, "b")
    assert [(r["budget"], r["ppl"]["prose"]) for r in out["rows"]] == [(4, 25.0), (2, 15.0)]
    assert out["comparison"] == [{"blocks": 2}, {"blocks": 4}] and out["seconds"] == 10
    assert out["parts"] == [[4], [2, 4]]  # each run's block budgets, for its command line
    near = {**b, "dense": {**DENSE, "ppl": {"prose": 10.0000001, "code": 4.0}}}
    assert merged(a, near, "b")["dense"] == DENSE  # the 7th digit: the same run
    far = {**b, "dense": {**DENSE, "ppl": {"prose": 10.01, "code": 4.0}}}
    with pytest.raises(SystemExit, match="dense differs"):
        merged(a, far, "b")
