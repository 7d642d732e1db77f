"""Experts removed on files, without loading the model: a full checkpoint and a manifest
of what the cut slices both give the variant the cut makes in memory, in five families
(per-expert files and fused banks, routers with and without groups)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lorp.experts.layers import moe_layers
from lorp.experts.surgery import drop_experts
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
