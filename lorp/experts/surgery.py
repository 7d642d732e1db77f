"""Remove routed experts from a mixture-of-experts model in place: every tensor of a MoE
layer's experts module and router that has one row per expert loses the removed rows (the
fused banks along their expert dimension, the router's weight, bias and score correction),
the modules' expert counts and the config's say the new number, top-k is unchanged.

Every MoE layer keeps the same number of experts, so the config stays a valid config of
its family. Before anything changes, the cut is made on the model built on the meta device
(`lorp.models.architectures.skeleton`) and each of its blocks compared with the blocks the
new config describes (`lorp.models.layer_config.block_signature`): a family that keeps its
expert count somewhere lorp does not rewrite is refused in one line, and the model is left
as it was.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lorp.experts.layers import MoeLayer, expert_count_field, moe_layers
from lorp.models.architectures import decoder_blocks, model_class, skeleton, text_config
from lorp.models.layer_config import block_signature


class ExpertCutRefused(ValueError):
    """An expert cut the model or its config cannot take (one line)."""


def drop_experts(model: nn.Module, removed: Mapping[int, Sequence[int]]) -> int:
    """Remove `removed` (block -> routed expert indices) from `model` in place; every MoE
    layer must lose the same number. Returns the experts each layer keeps."""
    layers = moe_layers(model)
    kept = kept_experts(layers, removed)
    config = with_experts(model.config, len(next(iter(kept.values()))))
    check_expert_cut(model.config, config, removed, type(model))
    for layer in layers:
        _cut_layer(decoder_blocks(model)[layer.block], layer, kept[layer.block])
    model.config = config
    return len(next(iter(kept.values())))


def kept_experts(
    layers: Sequence[MoeLayer], removed: Mapping[int, Sequence[int]]
) -> dict[int, list[int]]:
    """Block -> the routed experts it keeps, ascending; one line for a cut that names a
    block without experts, an expert it lacks, or removes unequal numbers."""
    by_block = {layer.block: layer for layer in layers}
    unknown = sorted(set(removed) - set(by_block))
    if unknown:
        raise ExpertCutRefused(
            f"blocks {unknown} hold no routed experts (MoE layers: {sorted(by_block)})"
        )
    counts = {len(set(removed.get(b, ()))) for b in by_block}
    if len(counts) != 1:
        raise ExpertCutRefused(
            "every MoE layer must lose as many experts (the config states one count), "
            f"got {sorted(counts)}"
        )
    out = {}
    for b, layer in by_block.items():
        gone = set(int(e) for e in removed.get(b, ()))
        bad = sorted(e for e in gone if not 0 <= e < layer.n_experts)
        if bad:
            raise ExpertCutRefused(f"block {b} has experts 0..{layer.n_experts - 1}, got {bad}")
        out[b] = [e for e in range(layer.n_experts) if e not in gone]
    return out


def check_expert_cut(
    config: Any, new_config: Any, removed: Mapping[int, Sequence[int]], cls: type | None
) -> None:
    """ExpertCutRefused unless the cut, made on `config`'s model on the meta device, gives
    the blocks `new_config` describes."""
    cls = cls if cls is not None and hasattr(cls, "_from_config") else model_class(config)
    before = skeleton(config, cls)
    layers = moe_layers(before)
    kept = kept_experts(layers, removed)
    for layer in layers:
        _cut_layer(decoder_blocks(before)[layer.block], layer, kept[layer.block])
    for layer in layers:
        _route_on_meta(layer, config)
    after = decoder_blocks(skeleton(new_config, cls))
    for i, block in enumerate(decoder_blocks(before)):
        a, b = block_signature(block), block_signature(after[i])
        if a != b:
            family = type(text_config(config)).__name__.removesuffix("Config")
            raise ExpertCutRefused(
                f"{family}: block {i} without the experts would not reload as the block its "
                "config describes (it keeps its expert count where lorp does not rewrite it)"
            )


def _route_on_meta(layer: MoeLayer, config: Any) -> None:
    """Route two tokens through the cut router on the meta device (shapes only): a router
    that needs more experts than the cut leaves (DeepSeek's groups take their top 2) fails
    here, in one line, not in the first forward."""
    if layer.router is None:
        return
    width = int(text_config(config).hidden_size)
    try:
        layer.router(torch.empty(2, width, device="meta"))
    except NotImplementedError:  # an op without a meta kernel: nothing to learn here
        return
    except (RuntimeError, IndexError, ValueError) as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ExpertCutRefused(
            f"block {layer.block}: its router cannot route over the experts the cut keeps ({why})"
        ) from None


def with_experts(config: Any, n: int) -> Any:
    """A copy of `config` whose MoE layers hold `n` routed experts each."""
    import copy

    new = copy.deepcopy(config)
    setattr(text_config(new), expert_count_field(new), n)
    return new


def _cut_layer(block: nn.Module, layer: MoeLayer, kept: list[int]) -> None:
    """Keep experts `kept` of one layer: every tensor of its experts module and its router
    with a dimension of one entry per expert (the first such: a bank's [E, ...], a
    router's [E, d] weight, ERNIE's [1, E] score correction), and the counts its modules
    keep (`num_experts`, a router Linear's `out_features`)."""
    n, branch = layer.n_experts, block.get_submodule(layer.branch)
    owners = [m for top in (layer.experts, layer.router) if top is not None for m in top.modules()]
    for module in owners:
        for name, tensor in [
            *module.named_parameters(recurse=False),
            *module.named_buffers(recurse=False),
        ]:
            if n in tensor.shape:
                _put(module, name, tensor, tensor.shape.index(n), kept)
    for module in {*owners, *branch.modules()}:
        for key, value in list(vars(module).items()):
            count = isinstance(value, int) and not isinstance(value, bool) and value == n
            if count and ("expert" in key or (module in owners and key == "out_features")):
                setattr(module, key, len(kept))


def _put(module: nn.Module, name: str, tensor: torch.Tensor, dim: int, kept: list[int]) -> None:
    if tensor.is_meta:
        shape = list(tensor.shape)
        shape[dim] = len(kept)
        sliced = torch.empty(shape, dtype=tensor.dtype, device="meta")
    else:
        sliced = tensor.detach().index_select(dim, torch.tensor(kept, device=tensor.device))
    if name in module._parameters:
        module._parameters[name] = nn.Parameter(sliced, requires_grad=tensor.requires_grad)
    else:
        module._buffers[name] = sliced
