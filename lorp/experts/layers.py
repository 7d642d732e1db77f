"""Where a model keeps its routed experts: every mixture-of-experts layer, read from the
blocks as `lorp.models.blocks` reads them (the MoE branch, its `experts` module holding the
banks, its router), whatever the family.

A routed-experts module is called as `experts(x [T, d], top_k_index [T, k],
top_k_weights [T, k])` in every MoE family transformers 5.19 has (the router's weights
after the family's own normalisation and scaling), and returns `sum_j w_j E_j(x)`: the
saliency (`lorp.experts.saliency`) reads those three arguments, and runs the module's own
forward to get each expert's output, so no family's expert arithmetic is written here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lorp.models.architectures import architecture_of, decoder_blocks, text_config
from lorp.models.blocks import find_bank, router_of

EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""The config fields a family states its routed experts per layer in."""
TOP_K = ("num_experts_per_tok", "moe_k", "moe_topk", "top_k")
"""The config fields a family states how many experts a token is routed to in."""


@dataclass(frozen=True)
class MoeLayer:
    """One mixture-of-experts layer: the block it sits in and its modules."""

    block: int
    branch: str
    """The MoE branch's name in its block (`mlp`, `block_sparse_moe`, `feed_forward`)."""
    experts: nn.Module
    router: nn.Module | None
    n_experts: int


def moe_layers(model: nn.Module) -> list[MoeLayer]:
    """Every MoE layer of `model`, bottom first (empty for a dense model)."""
    arch = architecture_of(model)
    out = []
    for i, block in enumerate(decoder_blocks(model)):
        for branch in arch.layout(block).branches:
            if branch.kind != "moe":
                continue
            module = block.get_submodule(branch.name)
            bank = find_bank(module)
            if bank is None:
                continue
            experts = module.get_submodule(bank.experts)
            out.append(MoeLayer(i, branch.name, experts, router_of(module), bank.n_experts))
    return out


def expert_count_field(config: Any) -> str:
    """The field of `config`'s text config that states its routed experts per layer;
    ValueError (one line) where none does."""
    text = text_config(config)
    for name in EXPERT_COUNTS:
        if isinstance(getattr(text, name, None), int) and not isinstance(getattr(text, name), bool):
            return name
    family = type(text).__name__.removesuffix("Config")
    raise ValueError(f"{family}: no config field states its routed experts ({EXPERT_COUNTS})")


def top_k(config: Any) -> int:
    """How many experts each token is routed to (0 where the config does not say)."""
    text = text_config(config)
    for name in TOP_K:
        value = getattr(text, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return 0


def expert_groups(config: Any) -> int:
    """How many groups the router first chooses among (DeepSeek's `n_group`; 1 where the
    family routes over all experts at once): a cut keeps as many experts in each group."""
    value = getattr(text_config(config), "n_group", None)
    return value if isinstance(value, int) and value > 1 else 1


def expert_outputs(experts: nn.Module, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """E_{index[t, s]}(x_t) for every token t and slot s, [k, T, d]: the module's own
    forward, one slot at a time at weight 1 (`forward`, so no hook runs again)."""
    ones = torch.ones(index.shape[0], 1, dtype=x.dtype, device=x.device)
    return torch.stack(
        [experts.forward(x, index[:, s : s + 1], ones) for s in range(index.shape[1])]
    )
