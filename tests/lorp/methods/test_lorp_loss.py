"""Loss-guided LoRP against a hidden damage function: LoRP's per-cluster counts, each pick the
loss's argmin, at a fraction of SLEB's cost."""

from __future__ import annotations

import json

from lorp import allocate, cluster_layers, select_layers
from tests.helpers.loss_oracle import Recorder, argmin, damage
from tests.helpers.similarity_matrices import locality_matrix


def test_lorp_loss_counts_from_lorp_blocks_by_loss() -> None:
    sizes = (8, 8, 8)
    S = locality_matrix(sizes)
    n, budget = sum(sizes), 7
    true_loss = damage(n, seed=5)
    rec = Recorder(true_loss)
    sel = select_layers(S, budget, "lorp-loss", losses=rec, k=3)

    labels = cluster_layers(S, 3, seed=0)
    lorp_pick = allocate(S, labels, budget)
    counts = [sum(1 for b in lorp_pick if labels[b] == c) for c in range(3)]
    taken = [sum(1 for b in sel.layers if labels[b] == c) for c in range(3)]
    assert taken == counts == sel.details["counts"] == [4, 1, 2]
    assert sel.details["lorp_layers"] == lorp_pick
    assert 0 not in sel.layers and n - 1 not in sel.layers

    # Replay the rounds: each pick is its cluster's argmin given the earlier rounds.
    removed: tuple[int, ...] = ()
    for rnd in sel.details["rounds"]:
        for pick in rnd["picked"]:
            cands = [b for b in range(1, n - 1) if labels[b] == labels[pick] and b not in removed]
            given = {b: true_loss(tuple(sorted((*removed, b)))) for b in cands}
            assert pick == argmin(cands, given.__getitem__)
            assert rnd["losses"][pick] == given[pick]
        removed += tuple(rnd["picked"])
    assert list(removed) == sel.details["order"]
    assert json.loads(json.dumps(sel.to_dict()))["details"]["counts"] == [4, 1, 2]

    # Eligible sizes 7, 8, 7: (7 + 6 + 5 + 4) + 8 + (7 + 6) = 43 evaluations in 4 calls,
    # against SLEB's 22 + 21 + ... + 16 = 133 on the same problem.
    assert sel.details["n_evals"] == rec.n_evals == 43 and len(rec.calls) == 4
    sleb = Recorder(true_loss)
    select_layers(S, budget, "sleb", losses=sleb)
    assert sleb.n_evals == 133


def test_lorp_loss_reuses_a_profile_and_lorp_options() -> None:
    from lorp import profile

    S = locality_matrix((6, 6))
    rec = Recorder(damage(12))
    prof = profile(S)
    a = select_layers(S, 3, "lorp-loss", losses=rec, profile=prof)
    b = select_layers(S, 3, "lorp-loss", losses=rec)
    assert a.layers == b.layers and a.details["k"] == prof.k
    c = select_layers(S, 3, "lorp-loss", losses=rec, variant="released", k=2)
    assert sum(c.details["counts"]) == 3
