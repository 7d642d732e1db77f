"""The peers' token rows against transformers' own hidden states and a plain MLP hook."""

from __future__ import annotations

import numpy as np

from lorp.peers.states import stream_rows
from tests.helpers.peer_states import hidden_rows, mlp_rows
from tests.helpers.tiny_models import tiny_model
from tests.helpers.windows import token_windows


def test_rows_are_the_block_outputs_and_the_mlp_output_less_the_prefix() -> None:
    model, w = tiny_model("qwen2"), token_windows(5, 24)
    hs, M = hidden_rows(model, w), mlp_rows(model, w, 2)
    got = stream_rows(model, w, [-1, 1, 3], mlp_of=2, batch_size=2, skip_prefix=1)
    keep = np.tile(np.arange(24) >= 1, 5)  # the first position of each window left out
    for j in (-1, 1, 3):
        np.testing.assert_allclose(got[f"h{j}"].numpy(), hs[j + 1][keep], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["M"].numpy(), M[keep], rtol=1e-5, atol=1e-5)
