"""A decoder's dims parsed once from its config: the text part of a multimodal config, the
transformers defaults where a family leaves a field out, and each block's sliding window."""

from __future__ import annotations

from lorp.models.shape import ModelShape

LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
    "num_hidden_layers": 3,
    "tie_word_embeddings": True,
}


def test_a_text_config_is_read_where_a_multimodal_config_nests_it() -> None:
    flat = ModelShape.from_config(LLAMA)
    nested = ModelShape.from_config({"model_type": "gemma3", "text_config": LLAMA})
    assert flat == nested
    assert (flat.hidden, flat.heads, flat.kv_heads, flat.head_dim) == (64, 4, 2, 16)
    assert (flat.intermediate, flat.vocab, flat.n_blocks, flat.tied) == (128, 512, 3, True)
    assert flat.block_matmul_weights == 64 * 4 * 16 * 2 + 64 * 2 * 16 * 2 + 3 * 64 * 128


def test_left_out_fields_take_the_transformers_defaults() -> None:
    bare = {"hidden_size": 32, "num_hidden_layers": 2}
    shape = ModelShape.from_config(bare)
    assert (shape.heads, shape.kv_heads, shape.head_dim) == (1, 1, 32)
    assert (shape.intermediate, shape.vocab, shape.tied) == (128, 0, False)
    assert shape.windows == (None, None)


def test_sliding_windows_per_block() -> None:
    gemma = LLAMA | {
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    }
    assert ModelShape.from_config(gemma).windows == (16, None, 16)
    mistral = LLAMA | {"model_type": "mistral", "sliding_window": 8}
    assert ModelShape.from_config(mistral).windows == (8, 8, 8)
    assert ModelShape.from_config(LLAMA | {"sliding_window": 8}).windows == (None,) * 3


def test_a_hybrids_blocks_and_a_mixtures_experts_are_read_from_its_model() -> None:
    """Nemotron-H: [Mamba, MoE, attention, MLP]; its Mamba block keeps heads x head_dim x
    (state + conv window) values per sequence (4 x 32 x (8 + 4)); only block 2 attends.
    Qwen3-MoE: 4 experts routed top-2 in blocks 1-3 (block 0 dense), each expert's gate,
    up and down projections (3 x 64 x 32 values) the idle ones a token skips."""
    from lorp.models.disk_names import model_of
    from tests.helpers.family_models import family_config

    config = family_config("nemotron_h")
    shape = ModelShape.of_model(model_of(config), config.to_dict())
    assert shape.kinds == ("mamba", "moe", "attention", "mlp")
    assert shape.state == (4 * 32 * (8 + 4), 0, 0, 0)
    assert [shape.has_kv(b) for b in range(4)] == [False, False, True, False]
    config = family_config("qwen3_moe")
    moe = ModelShape.of_model(model_of(config), config.to_dict())
    assert (moe.experts, moe.top_k, moe.expert_params) == ((0, 4, 4, 4), 2, 3 * 64 * 32)
    assert moe.idle_expert_params([0, 1, 3]) == 2 * 2 * 3 * 64 * 32
