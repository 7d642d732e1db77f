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
