"""Loss-guided LoRP: LoRP's clusters decide how many blocks each depth region gives up,
the calibration loss decides which.

Rule: RLS of S (Eq. 5-6) picks K (Sec. 5.1) unless `k` is given; spectral clustering on
(S + 1) / 2 (Eq. 7) gives the clusters; LoRP's two-stage allocation (Eq. 8-11, `variant`
as for `lorp`) is run only for its per-cluster counts c_k (Stage 1: one block per cluster
where the paper's rule allows; Stage 2: by residual redundancy mu_k). Then, in rounds,
every cluster that still owes blocks removes, among its unpruned eligible blocks, the one
whose removal, on top of all blocks removed in earlier rounds, gives the lowest
calibration loss (ties, to 12 decimals: lower index). One round is one `losses` call
holding the candidates of every owing cluster, so a cluster's pick in a round is
conditioned on the earlier rounds, not on the other clusters' picks of the same round.
Blocks 0 and N-1 are never pruned, as in LoRP.

Cost: sum_k sum_{j < c_k} (e_k - j) evaluations for e_k eligible blocks in cluster k,
about budget x cluster size, against SLEB's about budget x N; max_k c_k calls.

`profile` (a `lorp.profile` of the same S) supplies RLS, K and the clusters as for `lorp`.

Details: `rls`, `k`, `k_from_rls`, `labels`, `variant`, `counts` (blocks per cluster),
`lorp_layers` (what LoRP's r(l) would have pruned), `order` (pick order), `rounds` (per
round: the blocks picked and each candidate's loss), `n_evals`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from lorp.locality.allocation import Variant
from lorp.locality.profile import Profile
from lorp.locality.rls import DEFAULT_KS, DEFAULT_THRESHOLDS
from lorp.locality.similarity import LayerSimilarity
from lorp.methods.lorp_method import check_lorp_options, explain
from lorp.methods.loss_guided import CountedLosses, argmin_block
from lorp.methods.registry import Losses, Selection, register_method


def cluster_counts(labels: Sequence[int], pruned: Sequence[int]) -> list[int]:
    """How many of `pruned` fall in each cluster 0..max(labels)."""
    lab = np.asarray(labels)
    return [int(sum(1 for b in pruned if lab[b] == c)) for c in range(int(lab.max()) + 1)]


def greedy_within_clusters(
    labels: Sequence[int], counts: Sequence[int], losses: CountedLosses
) -> tuple[list[int], list[dict[str, Any]]]:
    """Remove counts[c] blocks from each cluster c, in rounds, by lowest loss (module doc).

    Eligible blocks are 1..N-2. Returns the pick order and, per round, the picks and every
    candidate's loss."""
    n = len(labels)
    members = [[b for b in range(1, n - 1) if labels[b] == c] for c in range(len(counts))]
    for c, (count, eligible) in enumerate(zip(counts, members, strict=True)):
        if count > len(eligible):
            raise ValueError(f"cluster {c} owes {count} blocks but has {len(eligible)}")
    owed = list(counts)
    removed: list[int] = []
    rounds: list[dict[str, Any]] = []
    while any(owed):
        groups = [
            (c, [b for b in members[c] if b not in removed]) for c in range(len(owed)) if owed[c]
        ]
        flat = [b for _, cands in groups for b in cands]
        values = dict(zip(flat, losses([(*removed, b) for b in flat]), strict=True))
        picks = []
        for c, cands in groups:
            picks.append(argmin_block(cands, [values[b] for b in cands]))
            owed[c] -= 1
        removed.extend(picks)
        rounds.append({"picked": picks, "losses": values})
    return removed, rounds


@register_method("lorp-loss", needs_evaluator=True, check=check_lorp_options)
def lorp_loss(
    similarity: LayerSimilarity,
    budget: int,
    *,
    variant: Variant = "paper",
    k: int | None = None,
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    ks: Sequence[int] = DEFAULT_KS,
    seed: int = 0,
    losses: Losses | None = None,
    profile: Profile | None = None,
) -> Selection:
    """LoRP-loss: LoRP's per-cluster counts, blocks chosen greedily by calibration loss."""
    if losses is None:
        raise ValueError("method 'lorp-loss' scores candidate models: pass losses=")
    exp = explain(
        similarity,
        budget,
        variant=variant,
        k=k,
        thresholds=thresholds,
        ks=ks,
        seed=seed,
        profile=profile,
    )
    counts = cluster_counts(exp.labels, exp.layers)
    counted = CountedLosses(losses)
    order, rounds = greedy_within_clusters(exp.labels, counts, counted)
    return Selection(
        layers=tuple(sorted(order)),
        details={
            "rls": exp.rls,
            "k": exp.k,
            "k_from_rls": exp.k_from_rls,
            "labels": list(exp.labels),
            "variant": variant,
            "counts": counts,
            "lorp_layers": list(exp.layers),
            "order": order,
            "rounds": rounds,
            "n_evals": counted.n_evals,
        },
    )
