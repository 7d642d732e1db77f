"""Tiny random models of the decoder families an organisation's fleet holds (dense,
mixture-of-experts, hybrid, multimodal), built from transformers' own config classes: 4
blocks of width 64, head_dim 32, 4 experts routed top-2. Each family's entry holds only
what it needs to be small and to exercise its structure (sliding layers, dense and MoE
blocks mixed, Mamba and attention blocks mixed)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

N_BLOCKS = 4
VOCAB = 128
BASE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": N_BLOCKS,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
MOE = {
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
}
SLIDING = {"sliding_window": 16}
DENSE: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2},
    "qwen3": {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2},
    "gemma": {},
    "gemma2": SLIDING,
    "gemma3_text": {**SLIDING, "sliding_window_pattern": 2},
    "phi3": {},
    "olmo2": {},
    "olmo3": SLIDING,
    "granite": {"residual_multiplier": 0.5, "embedding_multiplier": 2.0, "logits_scaling": 4.0},
    "cohere2": {**SLIDING, "sliding_window_pattern": 2},
    "smollm3": {"no_rope_layer_interval": 2},
    "glm4": {},
    "starcoder2": {},
    "stablelm": {},
    "exaone4": {**SLIDING, "sliding_window_pattern": 2},
    "ministral": {**SLIDING, "layer_types": ["sliding_attention", "full_attention"] * 2},
    "seed_oss": {},
    "apertus": {},
    "arcee": {},
    "hunyuan_v1_dense": {},
    "ernie4_5": {},
}
MIXTURES: dict[str, dict[str, Any]] = {
    "mixtral": {"num_local_experts": 4, **MOE},
    "qwen2_moe": {"num_experts": 4, "mlp_only_layers": [0], **MOE},
    "qwen3_moe": {"num_experts": 4, "mlp_only_layers": [0], "norm_topk_prob": True, **MOE},
    "olmoe": {"num_experts": 4, **MOE},
    "deepseek_v2": {
        "n_routed_experts": 4,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 16,
        "v_head_dim": 32,
        "topk_method": "greedy",
        **MOE,
    },
    "deepseek_v3": {
        "n_routed_experts": 4,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 16,
        "v_head_dim": 32,
        "head_dim": 16,  # its rotary reads head_dim, which must be qk_rope_head_dim
        **{**MOE, "n_group": 2},
    },
    "gpt_oss": {"num_local_experts": 4, "sliding_window": 16, "num_experts_per_tok": 2},
    "granitemoe": {"num_local_experts": 4, "residual_multiplier": 0.5, **MOE},
    "phimoe": {"num_local_experts": 4, **MOE},
    "glm4_moe": {"n_routed_experts": 4, "first_k_dense_replace": 1, **MOE},
    "ernie4_5_moe": {
        "moe_num_experts": 4,
        "moe_k": 2,
        "moe_layer_start_index": 1,
        "moe_num_shared_experts": 1,
        "moe_intermediate_size": 32,
    },
    "dots1": {
        "n_routed_experts": 4,
        "first_k_dense_replace": 1,
        "sliding_window": 16,
        "max_window_layers": 2,
        **MOE,
    },
    "hunyuan_v1_moe": {"num_experts": 4, "moe_topk": 2},
    "flex_olmo": {"num_experts": 4, **MOE},
}
HYBRIDS: dict[str, dict[str, Any]] = {
    "jamba": {
        "num_experts": 4,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "mamba_d_state": 8,
        "mamba_dt_rank": 8,
        "use_mamba_kernels": False,
        "num_experts_per_tok": 2,
    },
    "bamba": {
        "attn_layer_indices": [1, 3],
        "mamba_n_heads": 4,
        "mamba_d_state": 8,
        "mamba_chunk_size": 8,
    },
    "falcon_h1": {
        "mamba_d_ssm": 128,
        "mamba_n_heads": 4,
        "mamba_d_state": 8,
        "mamba_chunk_size": 8,
    },
    "lfm2": {"full_attn_idxs": [1, 3], "block_auto_adjust_ff_dim": False},
    "nemotron_h": {
        "layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"],
        "mamba_num_heads": 4,
        "mamba_head_dim": 32,
        "ssm_state_size": 8,
        "n_groups": 1,
        "chunk_size": 8,
        "n_routed_experts": 4,
        "moe_shared_expert_intermediate_size": 32,
        "use_mamba_kernels": False,
        **MOE,
    },
    "qwen3_next": {
        "full_attention_interval": 2,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "num_experts": 4,
        "mlp_only_layers": [0],
        **MOE,
    },
}
FAMILIES = DENSE | MIXTURES | HYBRIDS
"""Every decoder family the fleet tests prune end to end, by `model_type`."""
REFUSED: dict[str, dict[str, Any]] = {"minimax": MOE | {"num_local_experts": 4}}
"""Families lorp refuses in part, which tests build to see the refusals."""
CONFIGS = FAMILIES | REFUSED


def family_config(model_type: str, **overrides: Any):  # type: ignore[no-untyped-def]
    """A tiny config of `model_type` from its transformers config class."""
    return AutoConfig.for_model(model_type, **(BASE | CONFIGS[model_type] | overrides))


def family_model(model_type: str, seed: int = 0, scale: float = 4.0, **overrides: Any):  # type: ignore[no-untyped-def]
    """A tiny random model of `model_type` in float32, eval mode. Random init leaves each
    block near the identity; its matrices scaled by `scale` give S and the repair a
    structure to find."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(model_type, **overrides))
    _scale(model, scale)
    return model.eval()


VISION = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}
PATCHES = {"num_hidden_layers": 1, "image_size": 28, "patch_size": 14}
MROPE = {"rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 1e4}}
QWEN_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2}
MULTIMODAL: dict[str, dict[str, Any]] = {
    "gemma3": {
        "text_config": BASE | {"sliding_window": 16, "sliding_window_pattern": 2},
        "vision_config": VISION | PATCHES,
        "mm_tokens_per_image": 4,
    },
    "mistral3": {"text_config": BASE, "vision_config": VISION | PATCHES | {"head_dim": 16}},
    "llama4": {
        "text_config": BASE
        | {
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "intermediate_size_mlp": 128,
            "interleave_moe_layer_step": 2,
        },
        "vision_config": VISION
        | PATCHES
        | {"vision_output_dim": 32, "projector_input_dim": 32, "projector_output_dim": 32},
    },
    "qwen2_5_vl": {
        "text_config": BASE | MROPE,
        "vision_config": QWEN_VISION | {"out_hidden_size": 64, "fullatt_block_indexes": [0]},
    },
    "qwen3_vl": {
        "text_config": BASE | MROPE,
        "vision_config": QWEN_VISION
        | {"out_hidden_size": 64, "deepstack_visual_indexes": [0], "num_position_embeddings": 16},
    },
}
"""Multimodal wrappers whose text tower is pruned: a tiny vision tower (one layer) beside
a 4-block decoder (Llama 4's text tower: experts every 2nd block)."""


def multimodal_config(model_type: str):  # type: ignore[no-untyped-def]
    """A tiny config of the multimodal wrapper `model_type` (`MULTIMODAL`)."""
    fields = copy.deepcopy(MULTIMODAL[model_type])  # transformers writes into sub-config dicts
    return AutoConfig.for_model(model_type, **fields)


def multimodal_model(model_type: str, seed: int = 0, scale: float = 4.0):  # type: ignore[no-untyped-def]
    """A tiny `model_type` with its vision tower (`AutoModelForImageTextToText`), its text
    tower's matrices scaled as `family_model`'s are."""
    from lorp.models.architectures import decoder_stack

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(multimodal_config(model_type))
    _scale(decoder_stack(model), scale)
    return model.eval()


def _scale(module: torch.nn.Module, scale: float) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim >= 2 and "embed" not in name:
                p.mul_(scale)


def save_family_ptb(model_type: str, path: Any, seed: int = 0, **overrides: Any) -> Any:
    """A tiny `model_type` model whose vocabulary is PTB's, with its tokenizer: a real
    checkpoint directory a whole job (calibration, capture, evaluation) can run on."""
    from tests.helpers.tiny_models import ptb_tokenizer

    tokenizer = ptb_tokenizer()
    model = family_model(model_type, seed, vocab_size=len(tokenizer), **overrides)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
