"""What S is made of (Eq. 3), against brute force: float32 normalisation whatever the input's
dtype, masked and BOS tokens left out, the last-token sums, the views."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lorp import SimilarityStats
from lorp.locality.similarity import LayerSimilarity
from tests.helpers.states import brute_force_S, brute_last_token, make_states


def test_float32_and_half_inputs_normalise_in_float32(states: np.ndarray) -> None:
    """Against brute force on the very values given (rounded to the input's dtype): the
    error left is float32's. Normalising in the input's own precision would be off by
    about that precision's epsilon (bf16 ~1e-2, fp16 ~1e-3), a thousand times more."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        given = torch.from_numpy(states).to(dtype)
        stats = SimilarityStats(n_blocks=8)
        stats.update(given)
        torch.testing.assert_close(
            torch.from_numpy(stats.matrix(include_output=True)),
            torch.from_numpy(brute_force_S(given.double().numpy())),
            rtol=1e-5,
            atol=1e-5,
            msg=lambda m, dtype=dtype: f"{dtype}: {m}",
        )


def test_batched_tokens_and_mask(states: np.ndarray) -> None:
    # [L, B, T, d] with a padding mask [B, T]: masked tokens do not count.
    batched = states.reshape(9, 4, 10, 32)
    mask = np.ones((4, 10), dtype=bool)
    mask[1, 7:] = False
    mask[3, 2:] = False
    stats = SimilarityStats(n_blocks=8)
    stats.update(batched, mask=mask)
    np.testing.assert_allclose(
        stats.matrix(include_output=True), brute_force_S(states, mask.reshape(-1)), rtol=1e-12
    )
    assert stats.tokens == int(mask.sum())


def test_layer_similarity_views(states: np.ndarray) -> None:
    stats = SimilarityStats(8)
    stats.update(states)
    sim = stats.similarity()
    assert sim.has_output and sim.blocks.shape == (8, 8)
    assert sim.has_last_token and sim.last_token.shape == (9, 9)
    np.testing.assert_array_equal(sim.last_token, stats.last_token_matrix())
    np.testing.assert_array_equal(sim.last_token_angular, stats.last_token_angular())
    bare = LayerSimilarity.from_matrix(stats.matrix())
    assert not bare.has_output and bare.n_blocks == 8 and not bare.has_last_token


def padded_batch() -> tuple[np.ndarray, np.ndarray]:
    """[L=9, B=4, T=10, d=32] states; right padding, left padding, none, and all padding."""
    states = make_states(9, 40, 32, seed=5).reshape(9, 4, 10, 32)
    mask = np.ones((4, 10), dtype=bool)
    mask[0, 6:] = False  # right padding: last real token at 5
    mask[1, :3] = False  # left padding: last real token at 9
    mask[3, :] = False  # nothing real: no sequence
    return states, mask


def test_last_token_sums_match_brute_force() -> None:
    states, mask = padded_batch()
    stats = SimilarityStats(8)
    stats.update(states, mask=mask)
    cos, ang = brute_last_token(states, mask)
    assert stats.sequences == 3 and stats.has_last_token
    np.testing.assert_allclose(stats.last_token_matrix(), cos, rtol=0, atol=1e-12)
    np.testing.assert_allclose(stats.last_token_angular(), ang, rtol=0, atol=1e-7)
    np.testing.assert_array_equal(np.diag(stats.last_token_angular()), 0.0)
    # The all-token S is unchanged by the last-token bookkeeping.
    np.testing.assert_allclose(
        stats.matrix(include_output=True),
        brute_force_S(states.reshape(9, 40, 32), mask.reshape(-1)),
        rtol=1e-12,
    )


def test_skip_prefix_drops_the_first_real_token_from_S_only() -> None:
    states, mask = padded_batch()
    stats = SimilarityStats(8)
    stats.update(states, mask=mask, skip_prefix=1)
    first_real = mask & (np.cumsum(mask, axis=1) == 1)
    kept = (mask & ~first_real).reshape(-1)
    assert stats.tokens == int(mask.sum()) - 3 == int(kept.sum())
    np.testing.assert_allclose(
        stats.matrix(include_output=True), brute_force_S(states.reshape(9, 40, 32), kept)
    )
    np.testing.assert_allclose(stats.last_token_matrix(), brute_last_token(states, mask)[0])
    with pytest.raises(ValueError, match="skip_prefix must be a non-negative integer, got -1"):
        stats.update(states, mask=mask, skip_prefix=-1)
