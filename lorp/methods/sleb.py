"""SLEB (Song et al., 2024, "SLEB: Streamlining LLMs through Redundancy Verification and
Elimination of Transformer Blocks", ICML).

Rule: greedy iterative elimination. At each of `budget` steps, every remaining candidate
block is scored by the calibration loss of the model without it and without all blocks
removed so far; the block of lowest loss goes (ties, to 12 decimals: lower index). One
step is one `losses` call holding all its candidates, so a step's evaluations run in
parallel where the caller can; the budget costs sum_t (C - t) evaluations for C
candidates.

The released code (github.com/jiwonsong-dev/SLEB, `sleb.py`, function `sleb`) scores a
candidate by the summed NLL of its calibration windows (`get_loss`); with every window of
the same length that is monotone in the mean NLL per token that `losses` returns. Its
candidates are `alive_list[early_barrier : len(alive_list) - latter_barrier]` with
`early_barrier = latter_barrier = 1` by default: the first and last remaining blocks are
never scored. Since those are always the original blocks 0 and N-1, the barriers are the
fixed protected sets 0..keep_first-1 and N-keep_last..N-1 here, `keep_first` and
`keep_last` defaulting to the code's 1 and 1. Its `if loss < min_loss` keeps the first
(lowest-index) of equal losses, as the tie rule here does.

Details: `order` (pick order), `step_losses` (per step, each candidate's loss), `picked_loss`
(the loss after each step), `candidates`, `n_evals`.
"""

from __future__ import annotations

from typing import Any

from lorp.locality.similarity import LayerSimilarity
from lorp.methods.loss_guided import CountedLosses, argmin_block, candidate_blocks, check_keep
from lorp.methods.registry import Losses, Selection, register_method


def sleb_order(
    n_blocks: int, budget: int, losses: Losses, *, keep_first: int = 1, keep_last: int = 1
) -> tuple[list[int], dict[str, Any]]:
    """SLEB's removal order and the per-step losses, from a `Losses` callable alone."""
    pool = candidate_blocks(n_blocks, keep_first, keep_last, budget)
    return greedy_removal(pool, budget, losses)


def greedy_removal(
    pool: list[int], budget: int, losses: Losses
) -> tuple[list[int], dict[str, Any]]:
    """SLEB's greedy elimination over `pool`, blocks or sub-layer units alike: at each of
    `budget` steps the candidate whose removal, with those removed so far, gives the lowest
    loss goes (ties, to 12 decimals: the lower index)."""
    if budget > len(pool):
        raise ValueError(f"budget {budget} exceeds the {len(pool)} candidates")
    counted = CountedLosses(losses)
    removed: list[int] = []
    step_losses: list[dict[int, float]] = []
    picked: list[float] = []
    for _ in range(budget):
        cands = [b for b in pool if b not in removed]
        values = counted([(*removed, b) for b in cands])
        best = argmin_block(cands, values)
        removed.append(best)
        step_losses.append(dict(zip(cands, values, strict=True)))
        picked.append(step_losses[-1][best])
    details = {
        "order": list(removed),
        "step_losses": step_losses,
        "picked_loss": picked,
        "candidates": list(pool),
        "n_evals": counted.n_evals,
    }
    return removed, details


@register_method("sleb", needs_evaluator=True, check=check_keep)
def sleb(
    similarity: LayerSimilarity,
    budget: int,
    *,
    keep_first: int = 1,
    keep_last: int = 1,
    losses: Losses | None = None,
) -> Selection:
    """SLEB: greedily remove the block whose removal gives the lowest calibration loss."""
    return greedy_selection(similarity.n_blocks, budget, losses, keep_first, keep_last)


def greedy_selection(
    n_blocks: int, budget: int, losses: Losses | None, keep_first: int, keep_last: int
) -> Selection:
    """SLEB's search as a `Selection`, by whatever `losses` measures (FinerCut's too)."""
    assert losses is not None  # select_layers refuses a loss-guided method without one
    order, details = sleb_order(
        n_blocks, budget, losses, keep_first=keep_first, keep_last=keep_last
    )
    return Selection(layers=tuple(sorted(order)), details=details)
