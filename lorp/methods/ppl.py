"""Shortened LLaMA's one-shot perplexity criterion (Kim et al., 2024, "Shortened LLaMA: A
Simple Depth Pruning for Large Language Models", arXiv:2402.02834; later versions "...
Depth Pruning for Large Language Models with Comparison of Retraining Methods").

Rule: score each candidate block by the calibration loss of the model without that block
alone (one `losses` call with every candidate); prune the `budget` blocks of lowest score
(ties, to 12 decimals: lower index). Loss is log-perplexity, so the order is the PPL
order.

The released code (github.com/Nota-NetsPresso/shortened-llm) computes the PPL of every
single-block removal in `src/anal_block_sensitivity_ppl.py` and sorts it ascending (a
stable sort: ties keep the lower index) into `block_order.csv`; `src/block_prune.py` then
prunes the first `num_pruned_blocks` of that order after its "plus heuristic", on by
default and in every released script (`--no_plus_heuristic` turns it off): blocks
0, 1, 2, 3, N-2 and N-1 are kept unpruned. Hence `keep_first=4`, `keep_last=2` by default
(`keep_first=keep_last=1` is the plain criterion with LoRP's boundary rule). The released
code scores the protected blocks too and discards them; here they are not scored, which
changes no pick and saves keep_first + keep_last evaluations.

Details: `scores` (block -> loss without it), `order` (candidates, best first),
`candidates`, `n_evals`.
"""

from __future__ import annotations

from lorp.locality.allocation import tie_key
from lorp.locality.similarity import LayerSimilarity
from lorp.methods.loss_guided import CountedLosses, candidate_blocks, check_keep
from lorp.methods.registry import Losses, Selection, register_method


@register_method("ppl", needs_evaluator=True, check=check_keep)
def ppl(
    similarity: LayerSimilarity,
    budget: int,
    *,
    keep_first: int = 4,
    keep_last: int = 2,
    losses: Losses | None = None,
) -> Selection:
    """Shortened LLaMA (PPL): prune the blocks whose lone removal costs the least loss."""
    assert losses is not None  # select_layers refuses a loss-guided method without one
    pool = candidate_blocks(similarity.n_blocks, keep_first, keep_last, budget)
    counted = CountedLosses(losses)
    values = counted([(b,) for b in pool])
    scores = dict(zip(pool, values, strict=True))
    order = sorted(pool, key=lambda b: (tie_key(scores[b]), b))
    return Selection(
        layers=tuple(sorted(order[:budget])),
        details={
            "scores": scores,
            "order": order,
            "candidates": pool,
            "n_evals": counted.n_evals,
        },
    )
