"""Capture on tiny models of every family equals brute force from transformers' own hidden
states (padding and BOS left out), without running the LM head."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from lorp import NonFiniteActivationError
from lorp.locality.capture import capture_stats
from lorp.models.architectures import decoder_stack
from tests.helpers.model_checks import batch
from tests.helpers.states import brute_force_S, brute_last_token, last_positions
from tests.helpers.tiny_models import FAMILIES, N_BLOCKS, tiny_model

FAMILY_IDS = list(FAMILIES)


def independent_states(model: nn.Module, b: dict[str, torch.Tensor]) -> np.ndarray:
    """Block inputs from transformers' own output_hidden_states, and the last block's
    output with the final norm swapped for the identity: no lorp hook involved."""
    stack = decoder_stack(model)
    norm = stack.norm
    stack.norm = nn.Identity()
    try:
        with torch.no_grad():
            hs = model(**b, output_hidden_states=True).hidden_states
    finally:
        stack.norm = norm
    assert len(hs) == N_BLOCKS + 1
    return torch.stack(hs).double().numpy()


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_capture_equals_brute_force(family: str) -> None:
    model = tiny_model(family)
    batches = [batch(0), batch(1)]
    stats = capture_stats(model, batches, progress=False)
    states = np.concatenate([independent_states(model, b) for b in batches], axis=1)
    states = states.reshape(N_BLOCKS + 1, -1, states.shape[-1])
    mask = torch.cat([b["attention_mask"] for b in batches]).reshape(-1).numpy().astype(bool)
    expected = brute_force_S(states, mask)
    np.testing.assert_allclose(stats.matrix(include_output=True), expected, rtol=1e-5, atol=1e-5)
    assert stats.tokens == int(mask.sum()) == 2 * (24 + 17)
    # Real structure, not a degenerate matrix: neighbours differ from each other.
    assert np.ptp(expected[np.triu_indices(N_BLOCKS + 1, 1)]) > 0.05


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_last_token_gram_equals_brute_force(family: str) -> None:
    """Right padding on the second sequence: its last real token is position 16, not 23."""
    model = tiny_model(family)
    batches = [batch(0), batch(1)]
    stats = capture_stats(model, batches, progress=False)
    parts = [
        brute_last_token(independent_states(model, b), last_positions([23, 16], 24))
        for b in batches
    ]
    cos, ang = ((parts[0][i] + parts[1][i]) / 2 for i in (0, 1))
    assert stats.sequences == 4
    np.testing.assert_allclose(stats.last_gram / 4, cos, rtol=0, atol=1e-6)
    np.testing.assert_allclose(stats.last_token_matrix(), cos, rtol=0, atol=1e-6)
    np.testing.assert_allclose(stats.last_token_angular(), ang, rtol=0, atol=1e-5)


def test_capture_skips_the_bos_position_from_S_only() -> None:
    model = tiny_model("llama")
    b = batch(0)
    ids = torch.cat([torch.ones(2, 1, dtype=torch.long), b["input_ids"]], dim=1)
    mask = torch.cat([torch.ones(2, 1, dtype=torch.long), b["attention_mask"]], dim=1)
    bos = {"input_ids": ids, "attention_mask": mask}
    stats = capture_stats(model, [bos], progress=False, skip_prefix=1)
    states = independent_states(model, bos)
    keep = mask.bool().clone()
    keep[:, 0] = False
    flat = states.reshape(N_BLOCKS + 1, -1, states.shape[-1])
    expected = brute_force_S(flat, keep.reshape(-1).numpy())
    np.testing.assert_allclose(stats.matrix(include_output=True), expected, rtol=1e-5, atol=1e-5)
    assert stats.tokens == 24 + 17
    np.testing.assert_allclose(
        stats.last_token_matrix(),
        brute_last_token(states, last_positions([24, 17], states.shape[2]))[0],
        rtol=0,
        atol=1e-6,
    )


def test_capture_never_runs_the_lm_head() -> None:
    model = tiny_model("llama")
    calls = []
    model.lm_head.register_forward_hook(lambda *a: calls.append(1))
    decoder_stack(model).norm.register_forward_hook(lambda *a: calls.append(2))
    capture_stats(model, [batch()["input_ids"]], progress=False)
    assert calls == []  # neither the vocabulary projection nor the final norm ran
    assert not model.model.layers[0]._forward_pre_hooks  # hooks removed afterwards


def test_capture_names_the_layer_on_overflow() -> None:
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[3].mlp.down_proj.weight.fill_(float("inf"))
    with pytest.raises(NonFiniteActivationError, match="layer 4 \\(the input of block 4\\)"):
        capture_stats(model, [batch()["input_ids"]], progress=False)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text", "olmo2"])
def test_sublayer_capture_equals_brute_force(family: str) -> None:
    """Boundary 2i + 1 is block i's output with its MLP removed (transformers' own
    hidden states of that model); the even boundaries are the block capture's."""
    from lorp.methods.sublayer_selection import block_similarity
    from lorp.models.sublayers import sublayers_removed

    model = tiny_model(family)
    batches = [batch(0), batch(1)]
    stats = capture_stats(model, batches, progress=False, sublayers=True)
    assert stats.n_blocks == 2 * N_BLOCKS
    blocks = np.concatenate([independent_states(model, b) for b in batches], axis=1)
    mid = []
    for i in range(N_BLOCKS):
        with sublayers_removed(model, [2 * i + 1]):
            mid.append(np.concatenate([independent_states(model, b)[i + 1] for b in batches]))
    states = np.empty((2 * N_BLOCKS + 1, *blocks.shape[1:]))
    states[0::2], states[1::2] = blocks, np.stack(mid)
    states = states.reshape(2 * N_BLOCKS + 1, -1, states.shape[-1])
    mask = torch.cat([b["attention_mask"] for b in batches]).reshape(-1).numpy().astype(bool)
    np.testing.assert_allclose(
        stats.matrix(include_output=True), brute_force_S(states, mask), rtol=1e-5, atol=1e-5
    )
    whole = capture_stats(model, batches, progress=False).similarity()
    halves = block_similarity(stats.similarity())
    np.testing.assert_allclose(halves.matrix, whole.matrix, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(halves.last_token, whole.last_token, rtol=1e-6, atol=1e-6)


def test_the_block_stats_inside_a_sub_layer_capture_are_a_block_captures() -> None:
    """What a job with sub-layer granularities selects its block points from: the sums,
    counts and last-token matrices of a block capture of the same batches (to float32
    rounding: each batch's Gram is one float32 GEMM, over 2N + 1 states here)."""
    model = tiny_model("llama")
    batches = [batch(0), batch(1)]
    units = capture_stats(model, batches, progress=False, sublayers=True, skip_prefix=1)
    whole = capture_stats(model, batches, progress=False, skip_prefix=1)
    blocks = units.block_stats()
    assert units.sublayers and not blocks.sublayers and not whole.sublayers
    assert (blocks.n_blocks, blocks.tokens, blocks.sequences) == (
        whole.n_blocks,
        whole.tokens,
        whole.sequences,
    )
    np.testing.assert_allclose(blocks.gram, whole.gram, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(blocks.last_token_angular(), whole.last_token_angular(), atol=1e-6)
    with pytest.raises(ValueError, match="reads sub-layer statistics"):
        whole.block_stats()
