"""Experts removed in memory and on files: the pruned model routes as the dense one would
without them, reloads in transformers, and the files written without loading the model
(a full checkpoint, or a manifest of what the cut slices) give the same logits."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lorp.experts.layers import moe_layers
from lorp.experts.surgery import ExpertCutRefused, drop_experts
from lorp.models.file_surgery import write_pruned_files
from lorp.models.surgery import drop_layers
from lorp.models.variant_manifest import (
    BaseRef,
    materialize_variant,
    variant_bytes,
    write_manifest,
)
from tests.helpers.family_models import family_model

FAMILIES = {
    "qwen3_moe": {},
    "mixtral": {},
    "olmoe": {},
    "deepseek_v3": {"n_routed_experts": 8},  # two groups of 4: one expert from each
    "gpt_oss": {},
}


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


@pytest.mark.parametrize("family", list(FAMILIES))
def test_memory_files_and_manifest_give_the_same_variant(family: str, tmp_path: Path) -> None:
    model = family_model(family, **FAMILIES[family])
    model.save_pretrained(tmp_path / "dense")
    layers = moe_layers(model)
    n = layers[0].n_experts
    removed = {layer.block: [0, n // 2] for layer in layers}
    dense = logits(model, ids())
    assert drop_experts(model, removed) == n - 2
    drop_layers(model, [2])
    pruned = logits(model, ids())
    assert (pruned - dense[..., :]).abs().max() > 1e-3  # the cut changed something
    model.save_pretrained(tmp_path / "memory")
    write_pruned_files(tmp_path / "dense", tmp_path / "files", [2], {}, experts=removed)
    base = BaseRef(str(tmp_path / "dense"), "local", "x")
    write_manifest(tmp_path / "dense", tmp_path / "v", base, [2], {}, experts=removed)
    materialize_variant(tmp_path / "v", tmp_path / "pulled", base_dir=tmp_path / "dense")
    for made in ("memory", "files", "pulled"):
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / made).eval()
        assert reloaded.config.num_hidden_layers == 3
        torch.testing.assert_close(logits(reloaded, ids()), pruned, rtol=1e-5, atol=1e-5)
    if family != "gpt_oss":  # per-expert files: the manifest stores the routers only
        assert variant_bytes(tmp_path / "v") < variant_bytes(tmp_path / "dense") / 50


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
