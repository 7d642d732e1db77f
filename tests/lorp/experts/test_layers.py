"""Where a mixture's experts are, read from the model and its config: the MoE layers of
families that name them differently, their routed experts, top-k and router groups, and
each expert's own output as the family's module computes it."""

from __future__ import annotations

import pytest
import torch

from lorp.experts.layers import expert_count_field, expert_groups, expert_outputs, moe_layers, top_k
from tests.helpers.family_models import family_model

EXPECTED = {
    # family: (blocks with experts, routed experts, count field, top-k, groups); the
    # field is the first the config answers to (aliases included: a write goes through)
    "qwen3_moe": ([1, 2, 3], 4, "num_experts", 2, 1),  # the test's mlp_only_layers [0]
    "mixtral": ([0, 1, 2, 3], 4, "num_experts", 2, 1),
    "deepseek_v3": ([1, 2, 3], 4, "num_local_experts", 2, 2),  # first_k_dense_replace 1
    "gpt_oss": ([0, 1, 2, 3], 4, "num_experts", 2, 1),
}


@pytest.mark.parametrize("family", list(EXPECTED))
def test_layers_counts_and_routing_come_from_the_family(family: str) -> None:
    model = family_model(family)
    blocks, n, field, k, groups = EXPECTED[family]
    layers = moe_layers(model)
    assert [layer.block for layer in layers] == blocks
    assert {layer.n_experts for layer in layers} == {n}
    assert (expert_count_field(model.config), top_k(model.config)) == (field, k)
    assert expert_groups(model.config) == groups


def test_a_dense_model_has_none_and_says_which_field_is_missing() -> None:
    model = family_model("llama")
    assert moe_layers(model) == []
    assert top_k(model.config) == 0
    with pytest.raises(ValueError, match=r"^Llama: no config field states its routed experts"):
        expert_count_field(model.config)


def test_each_experts_output_is_the_modules_own_at_weight_one() -> None:
    """Routing every token to experts 0 and 2 at weights 0.25 and 0.75 through the module
    gives the weighted sum of the two outputs expert_outputs reports."""
    layer = moe_layers(family_model("qwen3_moe"))[0]
    x = torch.randn(5, layer.experts.hidden_dim, generator=torch.Generator().manual_seed(0))
    index = torch.tensor([[0, 2]] * 5)
    weights = torch.tensor([[0.25, 0.75]] * 5)
    with torch.no_grad():
        each = expert_outputs(layer.experts, x, index)
        mixed = layer.experts(x, index, weights)
    assert each.shape == (2, 5, x.shape[1])
    torch.testing.assert_close(0.25 * each[0] + 0.75 * each[1], mixed, rtol=1e-5, atol=1e-6)
    assert (each[0] - each[1]).abs().max() > 1e-3  # two experts, two outputs
