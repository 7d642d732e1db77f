"""Folding fitted maps into the weights a pruned model already has, in memory (`fold`) or on
a checkpoint's files (`file_folds`, for `lorp.models.file_surgery`), with the same
arithmetic; and the same maps applied by hooks (`applied_by_hooks`), leaving the model's
weights as they are, for scoring a candidate cut without a copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lorp.models.architectures import architecture_of, decoder_blocks, decoder_stack
from lorp.models.file_surgery import FileChanges
from lorp.models.safetensors_index import TensorEntry, split_block_key
from lorp.repair.maps import RepairRefused, RunFit, tied_embeddings
from lorp.repair.stats import mlp_site, rms_unit


@torch.no_grad()
def fold(model: nn.Module, fits: Sequence[RunFit]) -> None:
    """Fold every fit into the dense (not yet pruned) `model`, in place. A streamed
    model's matrix gets an override its streamer serves (`lorp.models.streaming`), folded from
    the file's tensor in the file's dtype: what `lorp.models.file_surgery` writes into the
    variant's checkpoint, so the figures are the checkpoint's."""
    from lorp.models.streaming import streamer_of

    streamer = streamer_of(model)  # a streamed model: its matrices are overrides
    arch = architecture_of(model)
    blocks = decoder_blocks(model)
    for fit in fits:
        s = fit.run[0]
        if s == 0:
            if tied_embeddings(model):
                raise RepairRefused("a run from block 0 cannot fold into tied embeddings")
            embedding = decoder_stack(model).embed_tokens
            if streamer is not None:  # folded as the variant's file will hold it
                weight = streamer.stored(embedding, "weight")
                folded = folded_embeddings(weight, fit).to(streamer.dtype)
                streamer.override(embedding, "weight", folded)
            else:
                embedding.weight.copy_(folded_embeddings(embedding.weight, fit))
            continue
        norm = getattr(blocks[s - 1], arch.post_mlp_norm) if fit.form == "normed" else None
        fold_into(streamer, blocks[s - 1].mlp.down_proj, norm, fit, arch.norm_offset)


@torch.no_grad()
def fold_into(
    streamer: Any, proj: nn.Module, norm: nn.Module | None, fit: RunFit, norm_offset: float
) -> None:
    """One fit folded into the output projection `proj` before its site (a block's
    `down_proj`, or a sub-layer's `o_proj`) and, for a `normed` fit, the post-norm `norm`.
    A streamed model's matrix gets an override its streamer serves, folded from the
    file's tensor in the file's dtype, as the variant's file will hold it."""
    if streamer is not None:
        weight = streamer.stored(proj, "weight")
        streamer.override(proj, "weight", folded_down_weight(weight, fit).to(streamer.dtype))
    else:
        proj.weight.copy_(folded_down_weight(proj.weight, fit))
    if proj.bias is not None:
        proj.bias.copy_(folded_down_bias(_as_stored(streamer, proj, "bias"), fit))
    if norm is not None:
        weight = _as_stored(streamer, norm, "weight")
        norm.weight.copy_(folded_norm_weight(weight, fit, norm_offset))


def _as_stored(streamer: Any, module: nn.Module, attr: str) -> torch.Tensor:
    """A resident vector as the fold starts from it: a streamed model's at the dtype its
    file stores it in (the resident copy holds the file's values exactly), so the fold
    rounds where the variant's file will; a model held whole's as it is."""
    t = getattr(module, attr)
    dtype = streamer.stored_dtype(module, attr) if streamer is not None else None
    return t if dtype is None else t.to(dtype)


FOLD_SLICE = 1 << 24
"""Float64 elements of one slice of a fold's product (128 MiB): a matrix is folded
slice by slice, so the fold holds the result and one slice, not float64 copies of a
[d, intermediate] matrix (1.1 GiB at d = 8192 each)."""


def folded_embeddings(embed: torch.Tensor, fit: RunFit) -> torch.Tensor:
    """E T: the embeddings of a run from block 0 (rows in slices)."""
    T = fit.matrix.to(embed.device)
    out = torch.empty_like(embed)
    step = max(1, FOLD_SLICE // T.shape[0])
    for i in range(0, embed.shape[0], step):
        out[i : i + step] = (embed[i : i + step].double() @ T).to(embed.dtype)
    return out


def folded_down_weight(weight: torch.Tensor, fit: RunFit) -> torch.Tensor:
    """T^T W (Q^T W): block s-1's `down_proj` weight [d, intermediate] (columns in slices)."""
    Qt = fit.matrix.to(weight.device).T
    out = torch.empty_like(weight)
    step = max(1, FOLD_SLICE // Qt.shape[0])
    for j in range(0, weight.shape[1], step):
        out[:, j : j + step] = (Qt @ weight[:, j : j + step].double()).to(weight.dtype)
    return out


def folded_down_bias(bias: torch.Tensor, fit: RunFit) -> torch.Tensor:
    return (bias.double() @ fit.matrix.to(bias.device)).to(bias.dtype)


def folded_norm_weight(weight: torch.Tensor, fit: RunFit, offset: float) -> torch.Tensor:
    """g (less the norm's offset): the post-MLP norm's weight of a `normed` run."""
    return (fit.scale.to(weight.device) - offset).to(weight.dtype)


@contextmanager
def applied_by_hooks(
    model: nn.Module, fits: Sequence[RunFit], kept: Sequence[int] | None = None
) -> Iterator[None]:
    """Inside the block, `model` applies each fitted map by a forward hook instead of
    through its weights: the reference a fold must equal, and the way to apply a map that
    does not fold (a full map after a norm). `kept`: the original indices of a pruned
    model's blocks (`drop_layers` returns them); None for the dense model."""
    current = decoder_blocks(model)
    position = {b: i for i, b in enumerate(kept if kept is not None else range(len(current)))}
    blocks = {b: current[i] for b, i in position.items()}
    handles = []

    def replace(T: torch.Tensor, normed: bool):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            x = rms_unit(module, args[0]).double() if normed else output.double()
            return (x @ T.to(x.device)).to(output.dtype)

        return hook

    try:
        for fit in fits:
            T = fit.matrix if fit.scale is None else fit.matrix * fit.scale
            site = map_site(model, blocks, fit)
            handles.append(site.register_forward_hook(replace(T, fit.form == "normed")))
        yield
    finally:
        for h in handles:
            h.remove()


def map_site(model: nn.Module, blocks: Any, fit: RunFit) -> nn.Module:
    """The module whose output `fit`'s map replaces: the embeddings for a run from block
    0, else block s-1's MLP (its post-MLP norm for a `normed` fit). `blocks`: the
    original index -> block (a pruned model's kept blocks by their original indices)."""
    s = fit.run[0]
    if s == 0:
        return decoder_stack(model).embed_tokens
    normed = fit.form == "normed"
    return mlp_site(blocks[s - 1], architecture_of(model).post_mlp_norm if normed else None)


def file_folds(fits: Sequence[RunFit]) -> FileChanges:
    """The fold of `fits` on a checkpoint's files, for `lorp.models.file_surgery`: given the
    source's tensor index, its architecture and whether its embeddings are tied, each
    changed tensor's source key -> a function giving the folded tensor from the source's."""
    return lambda index, arch, tied: _file_changes(index, fits, arch, tied)


def _file_changes(
    index: Mapping[str, TensorEntry], fits: Sequence[RunFit], arch: Any, tied: bool
) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    out: dict[str, Any] = {}
    in_block = {(p[1], p[2]): k for k in index if (p := split_block_key(k)) is not None}

    def key_of(block: int, rel: str) -> str:
        if (block, rel) not in in_block:
            raise RepairRefused(f"block {block} has no tensor {rel!r} to fold into")
        return in_block[(block, rel)]

    for fit in fits:
        s = fit.run[0]
        if s == 0:
            if tied:
                raise RepairRefused("a run from block 0 cannot fold into tied embeddings")
            embed = [k for k in index if k.endswith("embed_tokens.weight")]
            out[embed[0]] = lambda t, f=fit: folded_embeddings(t, f)
            continue
        out[key_of(s - 1, "mlp.down_proj.weight")] = lambda t, f=fit: folded_down_weight(t, f)
        if (s - 1, "mlp.down_proj.bias") in in_block:
            bias = in_block[(s - 1, "mlp.down_proj.bias")]
            out[bias] = lambda t, f=fit: folded_down_bias(t, f)
        if fit.form == "normed":
            rel = f"{arch.post_mlp_norm}.weight"
            off = arch.norm_offset
            out[key_of(s - 1, rel)] = lambda t, f=fit, o=off: folded_norm_weight(t, f, o)
    return out
