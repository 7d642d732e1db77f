"""SLEB against a hidden damage function: the greedy argmin of the loss, one batch of
candidates per step, within the barriers its options set."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lorp import select_layers
from tests.helpers.loss_oracle import Recorder, argmin, damage
from tests.helpers.similarity_matrices import locality_matrix

S6 = locality_matrix((3, 3))


def test_sleb_is_greedy_argmin_of_the_loss() -> None:
    true_loss = damage(6)
    rec = Recorder(true_loss)
    sel = select_layers(S6, 2, "sleb", losses=rec)
    pool = [1, 2, 3, 4]  # SLEB's released code never scores the first and last block
    first = argmin(pool, lambda b: true_loss((b,)))
    second = argmin([b for b in pool if b != first], lambda b: true_loss(tuple(sorted((first, b)))))
    assert sel.details["order"] == [first, second]
    assert sel.layers == tuple(sorted((first, second)))
    # One batch per step, every remaining candidate in it.
    assert [len(c) for c in rec.calls] == [4, 3]
    assert sel.details["n_evals"] == rec.n_evals == 7
    assert sel.details["picked_loss"][1] == pytest.approx(true_loss(sel.layers))
    assert sel.details["step_losses"][0] == {b: true_loss((b,)) for b in pool}
    assert json.loads(json.dumps(sel.to_dict()))["details"]["order"] == [first, second]


def test_sleb_keep_options_follow_the_barriers() -> None:
    rec = Recorder(lambda c: -float(sum(c)))  # prefers deep blocks
    sel = select_layers(np.eye(8), 3, "sleb", losses=rec, keep_last=3)
    assert sel.layers == (2, 3, 4) and sel.details["candidates"] == [1, 2, 3, 4]
    sel = select_layers(np.eye(8), 2, "sleb", losses=rec, keep_first=0, keep_last=0)
    assert sel.layers == (6, 7)
