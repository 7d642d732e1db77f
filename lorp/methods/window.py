"""Repair-aware window (new here; none of the anchors has it): prune the contiguous window
of n = budget blocks whose linear repair does best.

Streamline keeps the window whose input and output agree most, then (in its original
form) trains a layer to replace it; ReplaceMe (Shopkhoev et al., NeurIPS 2025) picks the
window by cosine distance and then fits a linear map. Both choose before knowing how well
the map will do. Here every candidate window [s, s+n) gets its map fitted from one pass
of repair statistics (`lorp.repair.stats`), and the window kept is the one whose repaired
variant does best by `score`:

- `residual` (default): the error the map leaves at the window's end, relative to the
  dense state there, ||Y + X T - H_e||^2 / ||H_e||^2 (`lorp.scoring.window_scores.window_scores`).
  No model is run: the statistics decide.
- `loss`: the calibration loss of each repaired variant on the held-out calibration
  windows (`lorp.scoring.window_scores.window_losses`): one forward pass per candidate. Measured
  here (docs: Linear repair), the residual is dominated by a few outlier tokens (the first
  position carries ~97% of the state's energy in SmolLM2-135M) and chose windows 6-7%
  worse on held-out news than the loss did.

Ties go to the shallower window. Windows: s >= 1, as Streamline's (block 0 stays, and
with it every model whose embeddings are tied stays repairable), and by default ending
before block N-1 (`last_block=True` allows the window that includes it). The selection
is meant for `repair: linear`; unrepaired, a window is usually worse than a spread-out set.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lorp.locality.similarity import LayerSimilarity
from lorp.methods.registry import (
    RepairScores,
    Selection,
    best_window,
    check_choice,
    register_method,
)
from lorp.methods.streamline import window_starts

SCORES = ("residual", "loss")


def _check(options: Mapping[str, Any], n_blocks: int | None) -> None:
    check_choice("score", options["score"], SCORES)


@register_method("window", needs_repair=True, check=_check)
def repair_window(
    similarity: LayerSimilarity,
    budget: int,
    *,
    last_block: bool = False,
    score: str = "residual",
    repair_scores: RepairScores | None = None,
) -> Selection:
    """Repair-aware window: the contiguous blocks whose linear repair does best."""
    assert repair_scores is not None  # select_layers hands it over or refuses
    starts = window_starts(similarity.n_blocks, budget, 1, last_block)
    s, scores = best_run(starts, budget, repair_scores, score)
    return Selection(
        layers=tuple(range(s, s + budget)),
        details={"window_start": s, f"window_{score}": dict(zip(starts, scores, strict=True))},
    )


def best_run(
    starts: list[int], budget: int, repair_scores: RepairScores, score: str
) -> tuple[int, list[float]]:
    """The start of the run [s, s + budget) that `repair_scores` scores lowest (ties: the
    shallower), and every start's score; runs of blocks or of sub-layer units alike."""
    runs = [(s, s + budget - 1) for s in starts]
    scores = [float(x) for x in repair_scores(runs, score)]
    if len(scores) != len(runs):
        raise RuntimeError(f"repair_scores returned {len(scores)} values for {len(runs)} runs")
    return best_window([-x for x in scores], starts), scores
