"""The configuration of a lorp sub-layer variant in Nemotron-NAS form (model_type
`nemotron-nas`): a Llama configuration with one `block_configs` entry per block, saying
whether its attention and its FFN are there (`no_op`), as NVIDIA's Nemotron-NAS models and
vLLM's `DeciLMForCausalLM` read it.

Written into every such checkpoint by `lorp.models.nemotron_nas` and loaded behind
`trust_remote_code`; it imports only transformers. `qkv_bias` marks a Qwen2-family source
(biases on q, k and v, none on o), as vLLM reads it.
"""

from __future__ import annotations

from typing import Any

from huggingface_hub.dataclasses import strict
from transformers.models.llama.configuration_llama import LlamaConfig


class Section(dict):
    """A `block_configs` part ("attention" or "ffn"): a dict (it serialises as one) whose
    keys read as attributes, as vLLM reads them (`block.attention.no_op`)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def block_config(entry: dict[str, Any]) -> Section:
    return Section({k: Section(v) if isinstance(v, dict) else v for k, v in entry.items()})


@strict
class DeciLMConfig(LlamaConfig):
    model_type = "nemotron-nas"

    block_configs: list | None = None
    qkv_bias: bool = False

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        blocks = (
            self.block_configs
            or [{"attention": {"no_op": False}, "ffn": {"no_op": False}}] * self.num_hidden_layers
        )
        if len(blocks) != self.num_hidden_layers:
            raise ValueError(
                f"block_configs has {len(blocks)} entries for {self.num_hidden_layers} layers"
            )
        self.block_configs = [block_config(dict(b)) for b in blocks]
