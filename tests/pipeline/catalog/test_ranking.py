"""The rule for the best variant (`pipeline.catalog.ranking`): by the held-out ratio, never a
degraded row."""

from __future__ import annotations

from pipeline.catalog.protocol import rank_column
from pipeline.catalog.ranking import best


def test_best_ranks_by_the_held_out_ratio() -> None:
    """The variant best on its calibration corpus is not best when it fails elsewhere."""
    common = {"budget": 8, "protocol": "p", "method": "m", "judged_on": "lee"}
    fits_ptb = {**common, "method_label": "a", "ppl_ptb": 25.0, "ppl_ratio": 2.9}
    general = {**common, "method_label": "b", "ppl_ptb": 31.0, "ppl_ratio": 1.9}
    assert rank_column(fits_ptb) == "ppl_ratio"
    assert best([fits_ptb, general], 8, "p") is general
    degraded = {**general, "degraded": True}
    assert best([fits_ptb, degraded], 8, "p") is fits_ptb


def test_sub_layer_budgets_rank_apart_from_block_budgets() -> None:
    """8 attention sub-layers are not 8 blocks: each granularity has its own best and
    alias; a row from before granularity existed is a block's."""
    from pipeline.catalog.ranking import best_rows, granularities

    common = {"budget": 8, "protocol": "p", "method": "m", "created_at": "t", "judged_on": "lee"}
    old_block = {**common, "method_label": "a", "ppl_ratio": 3.0}
    attention = {
        **common,
        "method_label": "a-attention",
        "ppl_ratio": 2.0,
        "granularity": "attention",
    }
    rows = [old_block, attention]
    assert best(rows, 8, "p") is old_block
    assert best(rows, 8, "p", "attention") is attention and best(rows, 8, "p", "mlp") is None
    assert granularities(rows) == ["block", "attention"]
    aliases = best_rows(rows)
    assert aliases["best-8"] is old_block and aliases["best-attention-8"] is attention
    assert aliases["best-attention-8-p"] is attention


def test_expert_cuts_rank_apart_from_depth_cuts() -> None:
    """An expert cut alone is `best-experts-<e>`; a row that removed a block and experts
    ranks among the rows that removed as many experts (`best-block-e<e>-<b>`), never
    against the blocks-only rows of `best-<b>`; a registry tag's string reads the same."""
    from pipeline.catalog.ranking import best_rows

    common = {"protocol": "p", "method": "shortgpt", "created_at": "t", "judged_on": "lee"}
    depth = {**common, "method_label": "shortgpt", "budget": 1, "ppl_ratio": 1.5}
    cut = {
        **common,
        "method": "reap",
        "method_label": "reap-experts",
        "budget": 2,
        "granularity": "experts",
        "expert_budget": 2,
        "ppl_ratio": 1.1,
    }
    both = {
        **depth,
        "method_label": "shortgpt&reap-experts",
        "granularity": "block",
        "expert_budget": "2",  # as a version's tag holds it
        "ppl_ratio": 1.4,  # better than depth alone: still not its best-1
    }
    aliases = best_rows([depth, cut, both])
    assert aliases["best-1"] is depth
    assert aliases["best-experts-2"] is cut
    assert aliases["best-block-e2-1"] is both
    assert "best-2" not in aliases
