"""A decoder's dims, parsed once from its `config.json`: what its memory (`lorp.models.memory`)
and its serving cost (`lorp.serving_cost`) are counted from.

`ModelShape.of_model` adds what the config alone does not say plainly, read from the
model's blocks (`lorp.models.blocks`; the model may be on the meta device): each block's
kind (only an attention keeps a KV cache), the recurrent state a Mamba, linear-attention
or convolution block keeps per sequence, and each block's routed experts, from which a
token's active parameters are counted."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
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
    kinds: tuple[str, ...] = ()
    """Per block: its kind (`BlockLayout.kind`: attention, mamba, attention+moe, ...);
    empty: every block an attention (a shape from the config alone)."""
    state: tuple[int, ...] = ()
    """Per block: the values of recurrent state one sequence keeps (0: none)."""
    experts: tuple[int, ...] = ()
    """Per block: its routed experts (0: a dense MLP); empty: a dense model."""
    top_k: int = 0
    """Routed experts each token runs through."""
    expert_params: int = 0
    """Parameters of one routed expert (its gate, up and down projections)."""

    def has_kv(self, block: int) -> bool:
        """Whether the block keeps a KV cache (it attends)."""
        return not self.kinds or "attention" in self.kinds[block].split("+")

    def with_experts(self, kept: int) -> ModelShape:
        """The shape after an expert cut that keeps `kept` routed experts per MoE layer."""
        return replace(self, experts=tuple(kept if e else 0 for e in self.experts))

    def idle_expert_params(self, blocks: Sequence[int]) -> int:
        """The routed experts' parameters a token does not run through, over `blocks`."""
        if not self.experts:
            return 0
        return sum(max(self.experts[b] - self.top_k, 0) for b in blocks) * self.expert_params

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

    @classmethod
    def of_model(cls, model: Any, config: Mapping[str, Any]) -> ModelShape:
        """From `config` and `model`'s blocks (module docstring)."""
        from dataclasses import replace

        from lorp.models.architectures import architecture_of, decoder_blocks
        from lorp.models.blocks import find_bank

        c = config.get("text_config") or config
        n = len(decoder_blocks(model))
        config = {**c, "num_hidden_layers": n}
        arch = architecture_of(model)
        layouts = [arch.layout(b) for b in decoder_blocks(model)]
        kinds = tuple(lay.kind for lay in layouts)
        experts, per_expert = [], 0
        for block, lay in zip(decoder_blocks(model), layouts, strict=True):
            banks = [find_bank(getattr(block, b.name)) for b in lay.branches if b.kind == "moe"]
            experts.append(sum(bank.n_experts for bank in banks if bank is not None))
            for b in lay.branches:
                if b.kind == "moe":
                    per_expert = _expert_params(getattr(block, b.name))
        state = tuple(recurrent_state(c, k) for k in kinds)
        top_k = int(c.get("num_experts_per_tok") or c.get("moe_k") or c.get("moe_topk") or 0)
        shape = cls.from_config(config)
        moe = any(experts)
        return replace(
            shape,
            kinds=kinds,
            state=state,
            experts=tuple(experts) if moe else (),
            top_k=top_k if moe else 0,
            expert_params=per_expert,
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


def _expert_params(branch: Any) -> int:
    """Parameters of one routed expert of a MoE branch: its bank's tensors over E."""
    experts = branch.experts
    total = sum(p.numel() for p in experts.parameters())
    return int(total // experts.down_proj.shape[0])


def recurrent_state(config: Mapping[str, Any], kind: str) -> int:
    """The values one sequence keeps in a recurrent block of `kind` (its SSM state and
    its convolution's window), counted from the fields the hybrid families name them by;
    0 for an attention block, or where the family names none."""
    kinds = set(kind.split("+"))
    d = int(config["hidden_size"])
    conv = _first(config, "mamba_d_conv", "conv_kernel", "mamba_conv_kernel", "conv_L_cache")
    if "conv" in kinds:  # a short convolution: its window of the stream
        return d * (conv or 0)
    if not kinds & {"mamba", "linear_attention"}:
        return 0
    heads = _first(config, "linear_num_value_heads", "mamba_num_heads", "mamba_n_heads")
    head_dim = _first(config, "linear_value_head_dim", "mamba_head_dim", "mamba_d_head")
    inner = _first(config, "mamba_d_ssm") or (heads * head_dim if heads and head_dim else 0)
    inner = inner or int(_first(config, "mamba_expand", "expand") or 2) * d
    state = _first(config, "linear_key_head_dim", "mamba_d_state", "ssm_state_size", "state_size")
    return inner * ((state or 0) + (conv or 0))


def _first(config: Mapping[str, Any], *names: str) -> int:
    for name in names:
        value = config.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool) and value:
            return int(value)
    return 0


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
