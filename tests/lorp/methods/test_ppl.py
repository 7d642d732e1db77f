"""The one-shot perplexity criterion against a hidden damage function: the smallest
single-removal losses in one call, ties to the lower block."""

from __future__ import annotations

import numpy as np

from lorp import select_layers
from tests.helpers.loss_oracle import Recorder, damage
from tests.helpers.similarity_matrices import locality_matrix


def test_ppl_picks_the_smallest_single_removal_losses() -> None:
    true_loss = damage(12, seed=3)
    rec = Recorder(true_loss)
    S = locality_matrix((4, 4, 4))
    sel = select_layers(S, 3, "ppl", losses=rec)
    pool = list(range(4, 10))  # the released "plus heuristic": keep 0-3, N-2, N-1
    expected = sorted(sorted(pool, key=lambda b: (true_loss((b,)), b))[:3])
    assert list(sel.layers) == expected
    assert rec.calls == [[(b,) for b in pool]]  # one call, every candidate
    assert sel.details["n_evals"] == 6
    plain = select_layers(S, 3, "ppl", losses=rec, keep_first=1, keep_last=1)
    pool = list(range(1, 11))
    assert list(plain.layers) == sorted(sorted(pool, key=lambda b: (true_loss((b,)), b))[:3])


def test_ppl_ties_go_to_the_lower_index() -> None:
    sel = select_layers(np.eye(8), 2, "ppl", losses=lambda c: [1.0] * len(c), keep_first=1)
    assert sel.layers == (1, 2)
