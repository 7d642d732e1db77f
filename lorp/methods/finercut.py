"""FinerCut (Zhang et al., 2024, "FinerCut: Finer-grained Interpretable Layer Pruning for
Large Language Models", arXiv:2405.18218).

Rule: greedy removal by the change in the model's output. At each of `budget` steps every
remaining candidate is scored by how far the model without it, and without all removed so
far, moves its next-token distributions from the dense model's on the calibration
windows; the candidate that moves them least goes (ties, to 12 decimals: lower index). The
distance is the Jensen-Shannon divergence, averaged over positions: `losses` is registered
with ``measure="js"``, so the caller scores candidates by it
(`lorp.scoring.removal_loss.LossEvaluator(measure="js")`, or the pipeline's actors). The
search is SLEB's (`lorp.methods.sleb.greedy_selection`); only the measure differs.

FinerCut's candidates are the attention and FFN layers of every block, ranked together:
that is this method at ``mixed`` granularity
(`lorp.methods.sublayer_selection.select_units`). Registered here, over whole blocks, it is
the same search with blocks for candidates, so it can be compared at every granularity.

The released code (github.com/YaNgZhAnG-V5/llm_dissect, `scripts/prune_layer.py`,
`greedy_pruning`) masks each candidate's `o_proj` or `down_proj` input, scores it with its
`Output` evaluator against logits collected from the dense model on the pruning set (the
configs name ``distance_metric: js_divergence``), and removes the argmin, first of equals.
Two departures, both deliberate:

- The measure. Here it is the Jensen-Shannon divergence as defined, 0.5 KL(P || M) +
  0.5 KL(Q || M) with M = (P + Q) / 2. The released `compare_outputs_js_divergence`
  hands ``F.kl_div`` the log-probabilities of P and Q as its input and M as its target,
  which computes 0.5 KL(M || P) + 0.5 KL(M || Q): another symmetric divergence, zero
  exactly when the outputs agree, whose ranking can differ. lorp follows the name. (Its
  ``reduction="mean"`` also divides by the vocabulary size, a constant that changes no
  pick.)
- The barriers. Its `--exclude` rate protects the first blocks until that share is pruned
  (default: block 0, until the first removal) and never the last block; here
  ``keep_first`` and ``keep_last`` protect fixed sets, 1 and 1 by default, as for SLEB and
  every sub-layer method (attn.0 cannot go: generation reads positions from its cache).

Details: as SLEB's (`order`, `step_losses` holding each step's divergences, `picked_loss`,
`candidates`, `n_evals`).
"""

from __future__ import annotations

from lorp.locality.similarity import LayerSimilarity
from lorp.methods.loss_guided import check_keep
from lorp.methods.registry import Losses, Selection, register_method
from lorp.methods.sleb import greedy_selection


@register_method("finercut", needs_evaluator=True, check=check_keep, measure="js")
def finercut(
    similarity: LayerSimilarity,
    budget: int,
    *,
    keep_first: int = 1,
    keep_last: int = 1,
    losses: Losses | None = None,
) -> Selection:
    """FinerCut: greedily remove what moves the output distribution least (JS divergence)."""
    return greedy_selection(similarity.n_blocks, budget, losses, keep_first, keep_last)
