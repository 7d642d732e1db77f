"""Experts removed in memory: the pruned model routes as the dense one would without them,
and a cut the family's router or config cannot take is refused before anything changes
(the same cut on files: test_files)."""

from __future__ import annotations

import copy

import pytest
import torch

from lorp.experts.layers import moe_layers
from lorp.experts.surgery import ExpertCutRefused, drop_experts
from tests.helpers.family_models import family_model


def logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=x).logits


def ids() -> torch.Tensor:
    return torch.randint(3, 120, (2, 16), generator=torch.Generator().manual_seed(1))


def test_a_removed_expert_is_one_the_router_never_chooses() -> None:
    """gpt-oss routes by logits plus a bias and softmaxes the top-k: an expert whose bias
    is -1e9 is never chosen, which is what removing it means."""
    model = family_model("gpt_oss")
    masked = copy.deepcopy(model)
    with torch.no_grad():
        for layer in moe_layers(masked):
            layer.router.bias[1] = -1e9
    drop_experts(model, {layer.block: [1] for layer in moe_layers(model)})
    torch.testing.assert_close(logits(model, ids()), logits(masked, ids()), rtol=1e-5, atol=1e-5)
    assert model.config.num_local_experts == 3
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 3


def test_cuts_a_family_cannot_take_are_refused_before_anything_changes() -> None:
    model = family_model("deepseek_v3")  # two groups of 2: its router takes 2 per group
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layers = moe_layers(model)
    with pytest.raises(ExpertCutRefused, match="its router cannot route over the experts"):
        drop_experts(model, {layer.block: [0, 2] for layer in layers})
    with pytest.raises(ExpertCutRefused, match="must lose as many experts"):
        drop_experts(model, {layers[0].block: [0]})
    with pytest.raises(ExpertCutRefused, match=r"blocks \[0\] hold no routed experts"):
        drop_experts(model, {0: [1]})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.config.n_routed_experts == 4
