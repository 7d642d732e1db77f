"""The rule for the best variant (`pipeline.records.ranking`): by the held-out ratio, never a
degraded row."""

from __future__ import annotations

from pipeline.records.protocol import rank_column
from pipeline.records.ranking import best


def test_best_ranks_by_the_held_out_ratio() -> None:
    """The variant best on its calibration corpus is not best when it fails elsewhere."""
    common = {"budget": 8, "protocol": "p", "method": "m", "judged_on": "lee"}
    fits_ptb = {**common, "method_label": "a", "ppl_ptb": 25.0, "ppl_ratio": 2.9}
    general = {**common, "method_label": "b", "ppl_ptb": 31.0, "ppl_ratio": 1.9}
    assert rank_column(fits_ptb) == "ppl_ratio"
    assert best([fits_ptb, general], 8, "p") is general
    degraded = {**general, "degraded": True}
    assert best([fits_ptb, degraded], 8, "p") is fits_ptb
