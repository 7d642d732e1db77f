"""A lorp sub-layer variant in transformers: a Llama decoder whose blocks may lack their
attention or their MLP (`block_configs[i].attention.no_op`, `.ffn.no_op`), which then
builds neither the module nor its input norm and adds nothing to the residual stream; a
block without attention keeps no KV cache. The same checkpoint loads in vLLM as its
native `DeciLMForCausalLM`.

Written into every such checkpoint by `lorp.models.nemotron_nas` and loaded behind
`trust_remote_code`; it imports only transformers and torch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    LlamaRMSNorm,
)

try:  # the checkpoint's own module, as transformers loads remote code
    from .configuration_decilm import DeciLMConfig
except ImportError:  # lorp's copy, imported as a package module
    from lorp.models.nemotron_nas_code.configuration_decilm import DeciLMConfig


class DeciLMDecoderLayer(nn.Module):
    def __init__(self, config: DeciLMConfig, layer_idx: int) -> None:
        super().__init__()
        block = config.block_configs[layer_idx]
        self.has_attention = not block.attention.no_op
        self.has_mlp = not block.ffn.no_op
        if self.has_attention:
            self.self_attn = LlamaAttention(config=config, layer_idx=layer_idx)
            if config.qkv_bias:  # Qwen2: biases on q, k and v only
                for name in ("q_proj", "k_proj", "v_proj"):
                    old = getattr(self.self_attn, name)
                    new = nn.Linear(old.in_features, old.out_features, bias=True)
                    setattr(self.self_attn, name, new)
            self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if self.has_mlp:
            self.mlp = LlamaMLP(config)
            self.post_attention_layernorm = LlamaRMSNorm(
                config.hidden_size, eps=config.rms_norm_eps
            )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Any = None,
        position_ids: Any = None,
        past_key_values: Any = None,
        use_cache: bool | None = False,
        position_embeddings: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if self.has_attention:
            residual = hidden_states
            hidden_states, _ = self.self_attn(
                hidden_states=self.input_layernorm(hidden_states),
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **kwargs,
            )
            hidden_states = residual + hidden_states
        if self.has_mlp:
            hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states


class DeciLMModel(LlamaModel):
    config_class = DeciLMConfig

    def __init__(self, config: DeciLMConfig) -> None:
        super().__init__(config)
        self.layers = nn.ModuleList(
            [DeciLMDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.post_init()


class DeciLMForCausalLM(LlamaForCausalLM):
    config_class = DeciLMConfig

    def __init__(self, config: DeciLMConfig) -> None:
        super().__init__(config)
        self.model = DeciLMModel(config)
        self.post_init()
