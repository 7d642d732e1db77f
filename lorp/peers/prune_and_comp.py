"""Prune&Comp (AAAI 2026, "Prune&Comp: Free Lunch for Layer-Pruned LLMs via Iterative
Pruning with Magnitude Compensation").

Removing blocks leaves the stream at the first kept block after the cut smaller than the
dense model had it there (the removed blocks added to its norm), and every kept block
after the cut reads a stream of the wrong magnitude. The recipe, one block at a time:

1. Block influence (their Eq. 2, ShortGPT's): BI_b = 1 - E_tokens[cos(x_b, y_b)], x_b and
   y_b block b's input and output in the model as pruned and compensated so far; the
   candidate of least BI goes (`candidates`: blocks 1..N-2, or every block).
2. Magnitude compensation (their Eq. 4): alpha = E||y_b|| / E||x_b||, the mean token norm
   the first kept block after the cut read before this removal (the model before it; at
   the first step, the dense model) over what it reads after it (block b's input, which
   the removal leaves as it was).
3. The fold (their Eq. 5): every weight that writes the residual stream before the cut
   is multiplied by alpha: the input embedding matrix, and of every block before b its
   attention's `o_proj` and its MLP's `down_proj` (weights and biases; a mixture's expert
   banks; where a norm follows a branch, as in Gemma 2/3 and OLMo 2/3, that norm's scale
   instead, (w + offset) alpha - offset). Every block reads the stream through an RMSNorm,
   which a scalar does not change, so the stream before the cut is alpha times what it
   was, exactly up to the norms' eps. Where the embeddings are tied to the LM head (the
   embedding matrix cannot change without changing the logits), 1/alpha goes instead
   into the same writers of every block after the cut: the stream after the cut is then
   1/alpha times the compensated one everywhere, which the final norm does not see, so
   the logits are the same.
4. Measure again on the compensated model before the next removal.

The selection needs the model (`needs_model`): `model_steps` runs the loop on a copy and
returns each step's block, BI and alpha; `apply_steps` folds the alphas into the dense
model the checkpoint is made from (scalars commute, so the steps replay exactly).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from lorp.locality.similarity import LayerSimilarity
from lorp.methods.registry import ModelSteps, Selection, check_choice, register_method
from lorp.methods.shortgpt import CANDIDATES, candidate_blocks
from lorp.models.architectures import (
    architecture_of,
    decoder_blocks,
    forward_until_stopped,
    input_embeddings,
)
from lorp.models.architectures import tied_embeddings as ties
from lorp.models.blocks import Stage
from lorp.models.surgery import blocks_dropped
from lorp.peers.states import block_input, first, model_device, rows

REPAIR = "magnitude-comp"


def _check(options: Mapping[str, Any], n_blocks: int | None) -> None:
    check_choice("candidates", options["candidates"], CANDIDATES)


@register_method("prune-comp", needs_output_state=True, needs_model=True, peer=REPAIR, check=_check)
def prune_comp(
    similarity: LayerSimilarity,
    budget: int,
    *,
    candidates: Literal["inner", "all"] = "inner",
    model_steps: ModelSteps | None = None,
) -> Selection:
    """Prune&Comp: one block at a time by block influence, each removal compensated."""
    assert model_steps is not None
    details = model_steps(budget, {"candidates": candidates})
    return Selection(layers=tuple(sorted(details["order"])), details=details)


@torch.no_grad()
def block_stats(
    model: nn.Module, windows: torch.Tensor, *, batch_size: int = 8, skip_prefix: int = 0
) -> dict[str, torch.Tensor]:
    """Per current block: the token means of cos(x, y), ||x|| and ||y|| (x its input, y
    its output), float64 [blocks] each."""
    blocks = decoder_blocks(model)
    sums = torch.zeros(3, len(blocks), dtype=torch.float64)
    count = 0

    def hook(j: int) -> Callable[..., None]:
        def run(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            x = rows(block_input(args, kwargs), skip_prefix).double()
            y = rows(first(output), skip_prefix).double()
            cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
            sums[:, j] += torch.stack([cos.sum(), x.norm(dim=-1).sum(), y.norm(dim=-1).sum()]).cpu()

        return run

    handles = [b.register_forward_hook(hook(j), with_kwargs=True) for j, b in enumerate(blocks)]
    try:
        device = model_device(model)
        for batch in windows.split(batch_size):
            forward_until_stopped(model, batch.to(device), None)  # the stack, no LM head
            count += batch.shape[0] * (batch.shape[1] - skip_prefix)
    finally:
        for h in handles:
            h.remove()
    mean = sums / count
    return {"cos": mean[0], "norm_in": mean[1], "norm_out": mean[2]}


def scale_writers(block: nn.Module, factor: float, arch: Any) -> None:
    """Multiply by `factor` every tensor with which `block` writes the stream (a branch's
    output projection, or the norm after it where there is one)."""
    for branch in arch.layout(block).branches:
        stage = Stage(block, (branch,), arch.norm_offset)
        norm = stage.post_norm
        if norm is not None:
            norm.weight.mul_(factor).add_((factor - 1) * arch.norm_offset)
            continue
        for target in stage.fold_targets():
            getattr(target.module, target.attr).mul_(factor)


@torch.no_grad()
def fold_alpha(model: nn.Module, cut: int, alpha: float) -> str:
    """Fold the compensation of removing block `cut` (original index) into the dense-depth
    `model`, in place (module docstring, step 3). Returns where: "before" or "after"."""
    arch, blocks = architecture_of(model), decoder_blocks(model)
    if not ties(model):
        input_embeddings(model).weight.mul_(alpha)
        for j in range(cut):
            scale_writers(blocks[j], alpha, arch)
        return "before"
    for j in range(cut + 1, len(blocks)):
        scale_writers(blocks[j], 1.0 / alpha, arch)
    return "after"


def iterate(
    model: nn.Module,
    windows: torch.Tensor,
    budget: int,
    *,
    candidates: str = "inner",
    batch_size: int = 8,
    skip_prefix: int = 0,
) -> dict[str, Any]:
    """The recipe's loop on the dense `model`, compensating it in place (blocks dropped
    only while measuring). Returns the details: `order`, and per step block, BI, alpha."""
    n = len(decoder_blocks(model))
    pool, removed, steps = list(candidate_blocks(n, candidates)), [], []
    for _ in range(budget):
        with blocks_dropped(model, removed) as kept:
            st = block_stats(model, windows, batch_size=batch_size, skip_prefix=skip_prefix)
        at = {b: k for k, b in enumerate(kept)}
        bi = {b: 1.0 - float(st["cos"][at[b]]) for b in pool if b not in removed}
        b = min(bi, key=lambda c: (bi[c], c))
        alpha = float(st["norm_out"][at[b]] / st["norm_in"][at[b]])
        where = fold_alpha(model, b, alpha)
        removed.append(b)
        steps.append({"block": b, "influence": round(bi[b], 6), "alpha": alpha, "fold": where})
    return {"order": removed, "steps": steps}


def model_steps(
    model: nn.Module, windows: torch.Tensor, *, batch_size: int = 8, skip_prefix: int = 0
) -> ModelSteps:
    """`model_steps=` for `select_layers`: the loop on a copy of `model` (left as it is)."""

    def run(budget: int, options: Mapping[str, Any]) -> dict[str, Any]:
        work = copy.deepcopy(model)
        return iterate(
            work, windows, budget, batch_size=batch_size, skip_prefix=skip_prefix, **options
        )

    return run


def apply_steps(model: nn.Module, steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Fold every step's alpha into the dense `model` the checkpoint is made from, in
    place (the caller drops the blocks). Returns the record."""
    where = [fold_alpha(model, int(s["block"]), float(s["alpha"])) for s in steps]
    return {"repair": REPAIR, "steps": [dict(s) for s in steps], "fold": sorted(set(where))}
