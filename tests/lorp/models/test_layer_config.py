"""A config's per-layer fields rewritten for the kept blocks, and the meta-device check that
the rewritten config describes them."""

from __future__ import annotations

import pytest

from lorp.models.layer_config import (
    CutRefused,
    check_cut,
    per_layer_fields,
    rewrite_layers,
    text_config,
)
from tests.helpers.family_models import family_config, multimodal_model


def test_lists_index_lists_and_bottom_counts_are_rewritten_over_the_kept_blocks() -> None:
    config = family_config("dots1")  # first_k_dense_replace 1, layer_types, max_window 2
    config.layer_types = [
        "full_attention",
        "sliding_attention",
        "full_attention",
        "sliding_attention",
    ]
    changed = rewrite_layers(config, [0, 2, 3], 4)
    assert config.layer_types == ["full_attention", "full_attention", "sliding_attention"]
    assert (config.first_k_dense_replace, config.max_window_layers) == (1, 1)
    assert config.num_hidden_layers == 3
    assert {"layer_types", "first_k_dense_replace", "max_window_layers"} <= set(changed)
    qwen = family_config("qwen3_next", mlp_only_layers=[0, 2])
    rewrite_layers(qwen, [0, 1, 3], 4)
    assert qwen.mlp_only_layers == [0] and len(qwen.layer_types) == 3
    ernie = family_config("ernie4_5_moe", moe_layer_start_index=1, moe_layer_end_index=2)
    rewrite_layers(ernie, [0, 2, 3], 4)
    assert (ernie.moe_layer_start_index, ernie.moe_layer_end_index) == (1, 1)


def test_a_sparse_step_becomes_the_explicit_list_its_family_also_takes() -> None:
    config = family_config("qwen2_moe", decoder_sparse_step=2, mlp_only_layers=[])
    rewrite_layers(config, [0, 1, 3], 4)  # MoE were 1 and 3 ((i + 1) % 2 == 0)
    assert config.decoder_sparse_step == 1 and config.mlp_only_layers == [0]
    assert check_cut(family_config("qwen2_moe", decoder_sparse_step=2), [0, 1, 3]) is not None


def test_nemotron_h_and_smollm3_lists_are_found_by_their_length() -> None:
    nemotron = family_config("nemotron_h")
    assert per_layer_fields(nemotron, 4) == ["layers_block_type"]
    new = check_cut(nemotron, [0, 1, 3])
    assert new.layers_block_type == ["linear_attention", "moe", "mlp"]
    smol = family_config("smollm3")
    assert "no_rope_layers" in per_layer_fields(smol, 4)


def test_a_cut_the_config_cannot_describe_is_refused_and_one_that_keeps_the_phase_is_not() -> None:
    jamba = family_config("jamba")
    with pytest.raises(CutRefused) as refused:
        check_cut(jamba, [0, 2, 3])
    message = str(refused.value)
    assert message.startswith("Jamba: kept block 2 would reload as another block at 1")
    assert message.count("\n") == 0
    new = check_cut(jamba, [0, 3])  # attention and experts every 2nd layer, still
    assert new.num_hidden_layers == 2 and jamba.num_hidden_layers == 4


def test_a_multimodal_cut_rewrites_its_text_config_and_leaves_its_vision_config() -> None:
    config = multimodal_model("gemma3").config
    new = check_cut(config, [0, 3])
    assert text_config(new).num_hidden_layers == 2 and len(text_config(new).layer_types) == 2
    assert new.vision_config.to_dict() == config.vision_config.to_dict()
    assert text_config(config).num_hidden_layers == 4  # the original is left as it was


def test_in_memory_a_derived_field_is_left_as_it_is_but_a_saved_cut_refuses_it() -> None:
    jamba = family_config("jamba")
    rewrite_layers(jamba, [0, 3], 4, strict=False)
    assert jamba.num_hidden_layers == 2
