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
