"""LLM-Streamline's replacement layer: the FFN the run's last block carries (attention
zeroed, its own MLP and norms), and the MSE of Eq. 3 on held-out windows by numpy."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from lorp.models.surgery import drop_layers
from lorp.peers.streamline_layer import repair_streamline_layer
from lorp.repair.maps import RepairRefused
from tests.helpers.peer_states import hidden_rows
from tests.helpers.tiny_models import tiny_model
from tests.helpers.windows import token_windows

S, E = 2, 4  # the run 2-4: block 4 carries the FFN, blocks 2 and 3 go


def _ffn_by_hand(block: torch.nn.Module, family: str, h: np.ndarray) -> np.ndarray:
    x = torch.from_numpy(h).float()
    with torch.no_grad():
        if family == "llama":
            out = x + block.mlp(block.post_attention_layernorm(x))
        else:
            out = x + block.post_feedforward_layernorm(
                block.mlp(block.pre_feedforward_layernorm(x))
            )
    return out.double().numpy()


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_the_carrier_block_is_the_ffn_of_the_runs_last_block(family: str) -> None:
    """No epoch: the pruned model's state after the carrier is f(h_i) by hand, with f
    block e's MLP between its own norms; the checkpoint has N - n + 1 blocks."""
    dense, w = tiny_model(family), token_windows(4, 24)
    hs = hidden_rows(dense, w)
    model = copy.deepcopy(dense)
    record = repair_streamline_layer(model, [S, 3, E], w, w[:2], options={"epochs": 0})
    assert record["dropped"] == [S, 3] and record["carrier"] == E
    drop_layers(model, record["dropped"])
    assert len(model.model.layers) == 6 - 3 + 1
    want = _ffn_by_hand(dense.model.layers[E], family, hs[S])
    np.testing.assert_allclose(hidden_rows(model, w)[S + 1], want, rtol=1e-4, atol=1e-4)


def test_training_lowers_the_held_out_mse_and_keeps_its_best_epoch() -> None:
    """Eq. 3: the mean of (f(h_i) - h_{i+n})^2 over tokens and channels, by numpy on the
    held-out windows, before training and at the epoch kept."""
    dense, w, held = tiny_model("llama"), token_windows(8, 24), token_windows(3, 24, seed=5)
    hs = hidden_rows(dense, held)
    before = np.mean((_ffn_by_hand(dense.model.layers[E], "llama", hs[S]) - hs[E + 1]) ** 2)
    model = copy.deepcopy(dense)
    record = repair_streamline_layer(model, [S, 3, E], w, held, options={"epochs": 3, "lr": 1e-3})
    assert record["held_mse"][0] == pytest.approx(before, rel=1e-4)
    best = record["best_epoch"]
    assert best >= 1 and record["held_mse"][best] == min(record["held_mse"])
    drop_layers(model, record["dropped"])
    after = np.mean((hidden_rows(model, held)[S + 1] - hs[E + 1]) ** 2)
    assert after == pytest.approx(record["held_mse"][best], rel=1e-4) and after < before


def test_a_run_from_block_0_is_refused_in_one_line() -> None:
    with pytest.raises(RepairRefused, match="replacement-ffn: layers must be one run after"):
        repair_streamline_layer(
            tiny_model("llama"), [0, 1], token_windows(2, 24), token_windows(1, 24)
        )


def test_the_speed_pass_skips_each_run_but_its_carrier() -> None:
    from lorp.peers.streamline_layer import skipped_blocks

    assert skipped_blocks([4, 5, 6]) == (4, 5)  # block 6 carries the FFN and still runs
    assert skipped_blocks([2, 3, 7, 8]) == (2, 7)
    assert skipped_blocks([5]) == ()
