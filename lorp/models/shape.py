"""A decoder's dims, parsed once from its `config.json`: what its memory (`lorp.models.memory`)
and its serving cost (`lorp.serving_cost`) are counted from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """The dims of a decoder-only model that its memory and serving cost depend on."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    n_blocks: int
    tied: bool
    windows: tuple[int | None, ...]
    """Per block: its sliding window, None for full attention."""

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """From a whole config (a multimodal one's `text_config` is the decoder's) or its
        text part; a field a family leaves out takes the transformers default."""
        c = config.get("text_config") or config
        d = int(c["hidden_size"])
        heads = int(c.get("num_attention_heads") or 1)
        n = int(c["num_hidden_layers"])
        return cls(
            hidden=d,
            heads=heads,
            kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or d // heads),
            intermediate=int(c.get("intermediate_size") or 4 * d),
            vocab=int(c.get("vocab_size") or 0),
            n_blocks=n,
            tied=bool(c.get("tie_word_embeddings", False)),
            windows=_windows(c, n),
        )

    @property
    def attention_matmul_weights(self) -> int:
        """Weights one token multiplies through in a block's attention: q, k, v and o."""
        d, hd = self.hidden, self.head_dim
        return d * self.heads * hd * 2 + d * self.kv_heads * hd * 2

    @property
    def mlp_matmul_weights(self) -> int:
        """Weights one token multiplies through in a block's gated MLP."""
        return 3 * self.hidden * self.intermediate

    @property
    def block_matmul_weights(self) -> int:
        """Weights one token multiplies through in a block: q, k, v, o and the gated MLP."""
        return self.attention_matmul_weights + self.mlp_matmul_weights


def _windows(config: Mapping[str, Any], n: int) -> tuple[int | None, ...]:
    """`layer_types` where the config names them (Gemma 2/3, OLMo 3, Qwen); Mistral's
    `sliding_window` covers every layer; anything else attends to its whole context."""
    window = config.get("sliding_window")
    types = config.get("layer_types")
    if types and window:
        return tuple(int(window) if t == "sliding_attention" else None for t in types[:n])
    if window and config.get("model_type") == "mistral":
        return (int(window),) * n
    return (None,) * n
