"""Where each model family keeps its decoder blocks, and which config fields are per layer.

Capture and surgery touch a model only through an `Architecture`, so adding a family is
one entry in `ARCHITECTURES`. Every supported family is a Hugging Face `*ForCausalLM`
whose decoder stack is `model.model` and whose blocks are `model.model.layers`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Architecture:
    """How to find and rewrite the blocks of one family."""

    family: str
    # Config lists with one entry per block: subset by the kept indices on surgery.
    per_layer_fields: tuple[str, ...] = ()
    # Config integers that count blocks from the bottom ("the first m blocks do X"):
    # recounted over the kept blocks on surgery.
    layer_count_fields: tuple[str, ...] = ()
    decoder_path: str = "model"
    blocks_attr: str = "layers"
    final_norm_attr: str = "norm"
    # Linear repair (`lorp.repair`): the RMSNorm a block applies to its MLP output before
    # the residual add (None: the MLP output is added as it is, so a map folds into
    # `down_proj`), and the constant its weight is offset by (Gemma scales by 1 + w).
    post_mlp_norm: str | None = None
    norm_offset: float = 0.0
    # Sub-layer pruning (`lorp.models.sublayers`): the RMSNorm a block applies to its
    # attention output before the residual add (None: `self_attn`'s output is added as
    # it is, so a map folds into `o_proj`). Llama's `post_attention_layernorm` is the
    # MLP's input norm, not this.
    post_attn_norm: str | None = None


_POST_MLP, _POST_ATTN = "post_feedforward_layernorm", "post_attention_layernorm"

ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("Llama"),
    "mistral": Architecture("Mistral"),
    # Qwen2/3: layer_types mark sliding-window blocks; max_window_layers counts the full-
    # attention blocks at the bottom, from which transformers rebuilds layer_types.
    "qwen2": Architecture("Qwen2", ("layer_types",), ("max_window_layers",)),
    "qwen3": Architecture("Qwen3", ("layer_types",), ("max_window_layers",)),
    "olmo2": Architecture("OLMo2", post_mlp_norm=_POST_MLP, post_attn_norm=_POST_ATTN),
    "olmo3": Architecture(
        "OLMo3", ("layer_types",), post_mlp_norm=_POST_MLP, post_attn_norm=_POST_ATTN
    ),
    "gemma2": Architecture(
        "Gemma2",
        ("layer_types",),
        post_mlp_norm=_POST_MLP,
        norm_offset=1.0,
        post_attn_norm=_POST_ATTN,
    ),
    "gemma3_text": Architecture(
        "Gemma3",
        ("layer_types",),
        post_mlp_norm=_POST_MLP,
        norm_offset=1.0,
        post_attn_norm=_POST_ATTN,
    ),
    "phi3": Architecture("Phi3"),
}


class UnsupportedArchitectureError(ValueError):
    def __init__(self, model_type: str) -> None:
        super().__init__(
            f"unsupported model_type {model_type!r} (supported: {', '.join(sorted(ARCHITECTURES))})"
        )


def architecture_for(model_type: str) -> Architecture:
    try:
        return ARCHITECTURES[model_type]
    except KeyError:
        raise UnsupportedArchitectureError(model_type) from None


def architecture_of(model: nn.Module) -> Architecture:
    return architecture_for(getattr(model.config, "model_type", "<none>"))


def decoder_stack(model: nn.Module) -> nn.Module:
    """The embedding + blocks + final norm module, without the LM head."""
    module = model
    for name in architecture_of(model).decoder_path.split("."):
        module = getattr(module, name)
    return module


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    return getattr(decoder_stack(model), architecture_of(model).blocks_attr)


class StopForward(Exception):
    """Raised by a hook once it has every state the forward owes it: the blocks after it
    need not run (`forward_until_stopped`)."""


def forward_until_stopped(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
) -> bool:
    """One forward of the decoder stack (no LM head, no cache) until a hook raises
    `StopForward`; whether one did."""
    try:
        decoder_stack(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    except StopForward:
        return True
    return False
