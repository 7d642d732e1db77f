"""REAP saliency as sums: two calibration shards merged equal one pass over all tokens, and
the sums equal a hand computation from the experts' banks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lorp.experts.layers import moe_layers
from lorp.locality.capture import capture_stats
from tests.helpers.family_models import family_model


def windows(n: int = 8, T: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 120, (n, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def qwen3_moe() -> torch.nn.Module:
    return family_model("qwen3_moe")


def test_two_shards_merged_equal_one_pass(qwen3_moe: torch.nn.Module) -> None:
    x = windows()
    whole = capture_stats(qwen3_moe, x.split(4), progress=False, experts=True).experts
    a = capture_stats(qwen3_moe, x[:3].split(3), progress=False, experts=True)
    b = capture_stats(qwen3_moe, x[3:].split(5), progress=False, experts=True)
    merged = a.merge(b).experts
    assert whole is not None and merged is not None
    assert whole.layers == (1, 2, 3) and whole.n_experts == 4  # block 0 is an MLP block
    assert whole.tokens.tolist() == [x.numel()] * 3
    assert whole.routed.sum(axis=1).tolist() == [2 * x.numel()] * 3  # top-2, distinct
    np.testing.assert_array_equal(merged.routed, whole.routed)
    for name in ("gate", "saliency_sum"):  # float32 forwards of other batch shapes
        np.testing.assert_allclose(getattr(merged, name), getattr(whole, name), rtol=1e-6)
    assert np.all(whole.saliency() > 0) and np.allclose(whole.frequency().sum(axis=1), 2.0)


def test_the_sums_equal_a_hand_computation_on_a_two_expert_layer() -> None:
    """Qwen3-MoE with 2 experts routed top-1: the hook's sums against g_j(x) ||E_j(x)||
    computed here from the router's weight and the banks, for the tokens S counts (the
    BOS position of each window left out)."""
    model = family_model("qwen3_moe", num_experts=2, num_experts_per_tok=1, norm_topk_prob=False)
    x = windows(4, 12)
    inputs: list[torch.Tensor] = []
    layer = moe_layers(model)[0]
    moe = model.model.layers[layer.block].mlp
    handle = moe.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach()))
    stats = capture_stats(model, [x], progress=False, experts=True, skip_prefix=1).experts
    handle.remove()
    assert stats is not None
    h = inputs[0][:, 1:].reshape(-1, inputs[0].shape[-1]).double()  # BOS positions left out
    experts = moe.experts
    probs = torch.softmax(h @ moe.gate.weight.double().T, dim=-1)
    g, j = probs.max(dim=-1)
    routed, saliency = np.zeros(2), np.zeros(2)
    for e in (0, 1):
        xe = h[j == e]
        gate, up = (xe @ experts.gate_up_proj[e].double().T).chunk(2, dim=-1)
        out = (torch.nn.functional.silu(gate) * up) @ experts.down_proj[e].double().T
        routed[e] = len(xe)
        saliency[e] = float((g[j == e] * out.norm(dim=-1)).sum())
    assert routed.sum() == 4 * 11 and stats.tokens[0] == 4 * 11
    np.testing.assert_array_equal(stats.routed[0], routed)
    np.testing.assert_allclose(stats.saliency_sum[0], saliency, rtol=1e-5)
    np.testing.assert_allclose(stats.saliency()[0], saliency / routed, rtol=1e-5)


def test_a_dense_model_has_no_expert_statistics() -> None:
    with pytest.raises(ValueError, match="no mixture-of-experts layer"):
        capture_stats(family_model("llama"), [windows(2)], progress=False, experts=True)
