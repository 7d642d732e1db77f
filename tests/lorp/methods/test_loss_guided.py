"""What the loss-guided methods share: keep options must leave a candidate, and a bad `losses`
answer is refused (wrong length) or ranked last (NaN)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lorp import select_layers
from lorp.methods import validate_options
from tests.helpers.similarity_matrices import locality_matrix

S6 = locality_matrix((3, 3))


def test_keep_options_must_leave_a_candidate() -> None:
    assert validate_options("ppl", {}) == {"keep_first": 4, "keep_last": 2}
    with pytest.raises(ValueError, match="6 protected blocks leave no candidate among 6$"):
        validate_options("ppl", {}, n_blocks=6)
    with pytest.raises(ValueError, match=r"budget 3 exceeds the 2 candidate blocks \(keep_first"):
        select_layers(np.eye(8), 3, "ppl", losses=lambda c: [0.0] * len(c))


def test_bad_losses_answers() -> None:
    with pytest.raises(ValueError, match="losses returned 1 values for 4 candidates"):
        select_layers(S6, 2, "sleb", losses=lambda c: [0.0])
    # A NaN loss (diverged model) is the worst candidate, never the pick.
    sel = select_layers(S6, 1, "sleb", losses=lambda c: [math.nan if c == (1,) else 1.0 for c in c])
    assert sel.layers == (2,)
