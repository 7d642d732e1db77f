"""A model's tensors by the names its checkpoint's files give them."""

from __future__ import annotations

from pathlib import Path

from lorp.models.disk_names import DiskLayout, disk_layout, disk_names, model_of
from lorp.models.safetensors_index import tensor_index
from tests.helpers.family_models import family_config, family_model, multimodal_model


def test_a_bank_is_named_one_tensor_per_expert_as_save_pretrained_writes_it(
    tmp_path: Path,
) -> None:
    model = family_model("mixtral")
    model.save_pretrained(tmp_path)
    name = "model.layers.1.mlp.experts.down_proj"
    keys = disk_names(model_of(model.config), [name])[name]
    assert keys == [f"model.layers.1.block_sparse_moe.experts.{j}.w2.weight" for j in range(4)]
    assert set(keys) <= set(tensor_index(tmp_path))


def test_where_each_family_keeps_its_text_blocks() -> None:
    assert disk_layout(model_of(family_config("llama"))) == DiskLayout("model.layers.", 4)
    assert disk_layout(model_of(family_config("nemotron_h"))).block_prefix == "backbone.layers."
    gemma = disk_layout(model_of(multimodal_model("gemma3").config))
    assert gemma.block_prefix == "language_model.model.layers."
    assert gemma.split("vision_tower.encoder.layers.0.mlp.fc1.weight") is None
    assert gemma.split("language_model.model.layers.3.mlp.down_proj.weight") == (
        "language_model.model.layers.",
        3,
        "mlp.down_proj.weight",
    )
    assert gemma.split("language_model.model.layers.4.mlp.down_proj.weight") is None
