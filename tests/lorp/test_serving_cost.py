"""The cost columns (`lorp.serving_cost`) against counts worked out by hand on a tiny Llama with 2
of its 4 blocks removed: d = 64, 2 heads of 32, 1 KV head, MLP 128, vocabulary 512,
untied embeddings, prefill and decode context 48, float32."""

from __future__ import annotations

import copy

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from lorp.models.shape import ModelShape
from lorp.models.surgery import drop_layers
from lorp.serving_cost import cost_columns, mean_context
from pipeline.evaluation.speed import count_params
from tests.helpers.tiny_models import COMMON

CONFIG = AutoConfig.for_model("llama", **(COMMON | {"num_hidden_layers": 4}))

# By hand. A block's matmul weights: q 64x64 + o 64x64 + k 64x32 + v 64x32 = 12,288, the
# gated MLP 3 x 64 x 128 = 24,576: 36,864. Its parameters add two norms of 64: 36,992.
# Dense: embeddings 512 x 64 = 32,768, LM head 32,768, 4 blocks, final norm 64.
PARAMS_DENSE = 2 * 32_768 + 4 * 36_992 + 64  # 213,568
PARAMS = 2 * 32_768 + 2 * 36_992 + 64  # 139,584
# Prefill FLOPs per token at 48 tokens: per block 2 x 36,864 = 73,728 for the weights,
# plus 4 x 2 heads x 32 = 256 per key over (48 + 1) / 2 = 24.5 keys on average: 6,272;
# the LM head 2 x 64 x 512 = 65,536 once per prefill (last position only): / 48 per token.
FLOPS = 2 * (73_728 + 6_272) + 65_536 / 48  # 161,365.33
FLOPS_DENSE = 4 * (73_728 + 6_272) + 65_536 / 48  # 321,365.33
# K and V of one token: 2 x 1 KV head x 32 x 4 bytes = 256 bytes per kept block.
KV = 2 * 256
# Decode at context 48: every weight once except the untied embedding table's other
# 511 rows (511 x 64 = 32,704 parameters), plus 48 tokens of KV cache.
DECODE = (PARAMS - 32_704) * 4 + 48 * KV  # 452,096
DECODE_DENSE = (PARAMS_DENSE - 32_704) * 4 + 48 * 4 * 256  # 772,608


def test_parameter_counts_by_hand_match_the_model() -> None:
    model = AutoModelForCausalLM.from_config(copy.deepcopy(CONFIG))  # surgery edits its config
    assert count_params(model) == PARAMS_DENSE
    drop_layers(model, [1, 2])
    assert count_params(model) == PARAMS


def test_two_of_four_blocks_removed_cost_what_the_hand_count_says() -> None:
    shape = ModelShape.from_config(CONFIG.to_dict())
    got = cost_columns(shape, [0, 3], PARAMS, PARAMS_DENSE, "float32", 48)
    assert got == {
        "weight_bytes": PARAMS * 4,
        "kv_bytes_per_token": KV,
        "prefill_flops_per_token": FLOPS,
        "decode_bytes_per_token": DECODE,
        "predicted_prefill_speedup": FLOPS_DENSE / FLOPS,
        "predicted_decode_speedup": DECODE_DENSE / DECODE,
    }
    dense = cost_columns(shape, range(4), PARAMS_DENSE, PARAMS_DENSE, "bfloat16", 48)
    assert dense["predicted_prefill_speedup"] == dense["predicted_decode_speedup"] == 1.0
    assert dense["weight_bytes"] == PARAMS_DENSE * 2 and dense["kv_bytes_per_token"] == 512


def test_a_sliding_window_caps_the_keys_a_query_sees() -> None:
    # positions 1..16 see t keys, 17..48 see 16: (136 + 32 x 16) / 48 = 13.5
    assert mean_context(48, 16) == 13.5
    assert mean_context(48, None) == mean_context(48, 64) == 24.5
    types = ["sliding_attention", "full_attention"] * 2
    config = CONFIG.to_dict() | {"sliding_window": 16, "layer_types": types}
    shape = ModelShape.from_config(config)
    assert shape.windows == (16, None, 16, None)
    # block 0 slides (13.5 keys), block 3 does not (24.5): 256 x 11 fewer FLOPs
    got = cost_columns(shape, [0, 3], PARAMS, PARAMS_DENSE, "float32", 48)
    assert got["prefill_flops_per_token"] == FLOPS - 256 * 11
    # a decoded token reads block 0's last 16 keys and block 3's 48: 32 x 256 bytes fewer
    assert got["decode_bytes_per_token"] == DECODE - 32 * 256
    assert got["kv_bytes_per_token"] == KV  # what a token stores is per block
    dense = (PARAMS_DENSE - 32_704) * 4 + (16 + 48 + 16 + 48) * 256
    assert got["predicted_decode_speedup"] == dense / (DECODE - 32 * 256)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_halves_every_byte_count(dtype: str) -> None:
    shape = ModelShape.from_config(CONFIG.to_dict())
    half = cost_columns(shape, [0, 3], PARAMS, PARAMS_DENSE, dtype, 48)
    assert half["weight_bytes"] == PARAMS * 2 and half["kv_bytes_per_token"] == KV / 2
    assert half["decode_bytes_per_token"] == DECODE / 2


def test_sub_layers_cost_what_the_hand_count_says() -> None:
    """Attention removed from blocks 1 and 2, the MLP from block 3: 2 blocks keep a KV
    cache, 2 attentions and 3 MLPs multiply."""
    shape = ModelShape.from_config(CONFIG.to_dict())
    params = PARAMS_DENSE - 2 * 12_288 - 24_576
    got = cost_columns(shape, [0, 3], params, PARAMS_DENSE, "float32", 48, kept_mlp=[0, 1, 2])
    assert got["kv_bytes_per_token"] == 2 * 256
    flops = 2 * (2 * 12_288 + 6_272) + 3 * 2 * 24_576 + 65_536 / 48
    assert got["prefill_flops_per_token"] == pytest.approx(flops)
    assert got["decode_bytes_per_token"] == (params - 32_704) * 4 + 48 * 2 * 256
    assert got["predicted_decode_speedup"] == pytest.approx(
        DECODE_DENSE / ((params - 32_704) * 4 + 48 * 2 * 256)
    )
    whole = cost_columns(shape, [0, 3], PARAMS, PARAMS_DENSE, "float32", 48, kept_mlp=[0, 3])
    assert whole["prefill_flops_per_token"] == pytest.approx(FLOPS)  # both halves: a block


def test_a_hybrid_caches_keys_for_its_attention_and_a_state_for_its_mamba() -> None:
    """Two of four blocks attend: the KV cache counts those, the Mamba blocks their state
    (read and written each token); a mixture's token reads top-k of its experts."""
    from dataclasses import replace

    base = ModelShape.from_config(CONFIG.to_dict())
    shape = replace(
        base, kinds=("mamba", "attention", "mamba", "attention"), state=(1000, 0, 1000, 0)
    )
    per_key = 2 * shape.kv_heads * shape.head_dim * 4
    got = cost_columns(shape, [0, 1, 2, 3], PARAMS, PARAMS, "float32", 48)
    assert got["kv_bytes_per_token"] == 2 * per_key
    unread = (shape.vocab - 1) * shape.hidden
    assert got["decode_bytes_per_token"] == (PARAMS - unread) * 4 + 2 * 48 * per_key + 2 * 2000 * 4
    moe = replace(base, experts=(0, 8, 8, 8), top_k=2, expert_params=100)
    mixture = cost_columns(moe, [0, 1, 2, 3], PARAMS, PARAMS, "float32", 48)
    dense = cost_columns(base, [0, 1, 2, 3], PARAMS, PARAMS, "float32", 48)
    assert dense["decode_bytes_per_token"] - mixture["decode_bytes_per_token"] == 3 * 6 * 100 * 4
