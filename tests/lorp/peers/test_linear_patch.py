"""LinearPatch: the Hadamard matrix, the scales s_c (Eq. 7) and P = H^T diag(s) H
(Eq. 8) against numpy, padding included; the fold into block i's o_proj and down_proj."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from lorp.models.surgery import drop_layers
from lorp.peers.linear_patch import hadamard, patch_matrix, patch_scales, repair_linear_patch
from lorp.repair.maps import RepairRefused
from tests.helpers.peer_states import attention_rows, hidden_rows
from tests.helpers.tiny_models import tiny_model
from tests.helpers.windows import token_windows

H4 = 0.5 * np.array([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]])


def test_the_normalised_hadamard_matrix() -> None:
    np.testing.assert_allclose(hadamard(4).numpy(), H4, atol=1e-15)
    H = hadamard(64).numpy()
    np.testing.assert_allclose(H @ H.T, np.eye(64), atol=1e-12)
    with pytest.raises(ValueError, match="power of two, got 6"):
        hadamard(6)


def test_scales_and_patch_by_hand_with_d_padded_from_3_to_4() -> None:
    g = np.random.default_rng(1)
    h_in, h_out = g.normal(size=(50, 3)), 2.0 * g.normal(size=(50, 3)) + 0.5
    pad = lambda h: np.hstack([h, np.zeros((len(h), 1))])  # noqa: E731
    rms = lambda h: np.sqrt(np.mean((pad(h) @ H4.T) ** 2, axis=0))  # RMS_c(H h) over tokens  # noqa: E731
    s_hand = rms(h_out) / rms(h_in)
    s = patch_scales(torch.from_numpy(h_in), torch.from_numpy(h_out)).numpy()
    np.testing.assert_allclose(s, s_hand, rtol=1e-12)
    P_hand = (H4.T @ np.diag(s_hand) @ H4)[:3, :3]
    np.testing.assert_allclose(patch_matrix(torch.from_numpy(s), 3).numpy(), P_hand, atol=1e-12)


def test_p_folds_into_what_block_i_writes() -> None:
    """The pruned model's state leaving block i is x + MLP_i(norm(x)) P, x = h_{i-1} +
    A_i P, with P from transformers' hidden states by numpy (d = 64: no padding)."""
    dense = tiny_model("llama")
    w = token_windows(6, 24)
    hs = hidden_rows(dense, w)  # hs[k]: block k's input
    s, e = 2, 3
    H = hadamard(64).numpy()
    rms = lambda h: np.sqrt(np.mean((h @ H.T) ** 2, axis=0))  # noqa: E731
    P = H.T @ np.diag(rms(hs[e + 1]) / rms(hs[s])) @ H
    model = copy.deepcopy(dense)
    record = repair_linear_patch(model, [s, e], w)
    drop_layers(model, [s, e])
    block = dense.model.layers[s - 1]
    A = attention_rows(dense, w, s - 1)
    x = torch.from_numpy(hs[s - 1] + A @ P).float()
    with torch.no_grad():
        m = block.mlp(block.post_attention_layernorm(x)).double().numpy()
    want = x.double().numpy() + m @ P
    np.testing.assert_allclose(hidden_rows(model, w)[s], want, rtol=1e-4, atol=1e-4)
    assert record["padded_to"] == 64 and record["run"] == [s, e]


def test_distillation_keeps_p_where_no_epoch_beats_it_or_trains_it() -> None:
    dense = tiny_model("llama")
    w = token_windows(4, 24)
    record = repair_linear_patch(dense, [2, 3], w, {"": w[:2]}, options={"distill": 1, "lr": 1e-3})
    assert record["distilled"]["epochs"] == 1 and len(record["distilled"]["held_kl"]) == 2


def test_a_norm_after_the_branches_is_refused_in_one_line() -> None:
    with pytest.raises(RepairRefused, match="hadamard-patch: family 'gemma3_text', block 1"):
        repair_linear_patch(tiny_model("gemma3_text"), [2, 3], token_windows(2, 24))
