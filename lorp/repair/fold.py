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

from lorp.models.architectures import (
    architecture_of,
    block_stage,
    decoder_blocks,
    input_embeddings,
)
from lorp.models.blocks import Stage
from lorp.models.file_surgery import FileChanges
from lorp.models.safetensors_index import TensorEntry
from lorp.repair.maps import RepairRefused, RunFit, tied_embeddings
from lorp.repair.stats import rms_unit


@torch.no_grad()
def fold(model: nn.Module, fits: Sequence[RunFit]) -> None:
    """Fold every fit into the dense (not yet pruned) `model`, in place: into block s-1's
    last stage (`lorp.models.blocks.Stage`), or the embeddings for a run from block 0. A
    streamed model's matrix gets an override its streamer serves (`lorp.models.streaming`),
    folded from the file's tensor in the file's dtype: what `lorp.models.file_surgery`
    writes into the variant's checkpoint, so the figures are the checkpoint's."""
    from lorp.models.streaming import streamer_of

    streamer = streamer_of(model)  # a streamed model: its matrices are overrides
    for fit in fits:
        s = fit.run[0]
        if s == 0:
            if tied_embeddings(model):
                raise RepairRefused("a run from block 0 cannot fold into tied embeddings")
            embedding = input_embeddings(model)
            if streamer is not None:  # folded as the variant's file will hold it
                weight = streamer.stored(embedding, "weight")
                folded = folded_embeddings(weight, fit).to(streamer.dtype)
                streamer.override(embedding, "weight", folded)
            else:
                embedding.weight.copy_(folded_embeddings(embedding.weight, fit))
            continue
        fold_into(streamer, block_stage(model, s - 1), fit)


@torch.no_grad()
def fold_into(streamer: Any, stage: Stage, fit: RunFit) -> None:
    """One fit folded into every tensor that writes `stage`'s output (its output
    projections, expert banks and shared experts) and, for a `normed` fit, its post-norm.
    A streamed model's matrix or expert bank gets an override its streamer serves,
    folded from the file's tensor (a bank: built from its experts' tensors) in the file's
    dtype, as the variant's files will hold it (`file_folds` folds those expert by
    expert, with the same arithmetic)."""
    for target in stage.fold_targets():
        module, attr = target.module, target.attr
        if streamer is not None and streamer.streams(module, attr):  # a matrix or a bank
            stored = streamer.stored(module, attr)
            folded = folded_tensor(stored, fit, target.how, attr).to(streamer.dtype)
            streamer.override(module, attr, folded)
            continue
        tensor = _as_stored(streamer, module, attr)
        getattr(module, attr).copy_(folded_tensor(tensor, fit, target.how, attr))
    norm = stage.post_norm if fit.form == "normed" else None
    if norm is not None:
        weight = _as_stored(streamer, norm, "weight")
        norm.weight.copy_(folded_norm_weight(weight, fit, stage.norm_offset))


def folded_tensor(t: torch.Tensor, fit: RunFit, how: str, attr: str = "weight") -> torch.Tensor:
    """`t` with the fit's map folded in, as `how` says it is laid out (`FoldTarget`)."""
    if how == "linear":
        return folded_down_weight(t, fit) if attr == "weight" else folded_down_bias(t, fit)
    if how == "bank_bias":
        return folded_bank_bias(t, fit)
    return folded_bank(t, fit, transposed=how == "bank_t")


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
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            out = output[0] if isinstance(output, tuple) else output
            x = rms_unit(module, args[0]).double() if normed else out.double()
            replaced = (x @ T.to(x.device)).to(out.dtype)
            return (replaced, *output[1:]) if isinstance(output, tuple) else replaced

        return hook

    try:
        for fit in fits:
            T = fit.matrix if fit.scale is None else fit.matrix * fit.scale
            for site in map_sites(model, blocks, fit):
                handles.append(site.register_forward_hook(replace(T, fit.form == "normed")))
        yield
    finally:
        for h in handles:
            h.remove()


def map_sites(model: nn.Module, blocks: Any, fit: RunFit) -> list[nn.Module]:
    """The modules whose outputs `fit`'s map replaces: the embeddings for a run from
    block 0, else the sites of block s-1's last stage (its post-norm for a `normed` fit).
    `blocks`: the original index -> block (a pruned model's kept blocks by their
    original indices)."""
    s = fit.run[0]
    if s == 0:
        return [input_embeddings(model)]
    arch = architecture_of(model)
    block = blocks[s - 1]
    stage = Stage(block, arch.layout(block).last_stage, arch.norm_offset)
    if fit.form == "normed":
        assert stage.post_norm is not None
        return [stage.post_norm]
    return [site for site, _ in stage.sites()]


def file_folds(fits: Sequence[RunFit]) -> FileChanges:
    """The fold of `fits` on a checkpoint's files, for `lorp.models.file_surgery`: given the
    source's tensor index, its model on the meta device and whether its embeddings are
    tied, each changed tensor's source key -> a function giving the folded tensor from
    the source's. The tensors are those `fold` changes, by the names the files give them
    (`lorp.models.disk_names`: a bank stored one tensor per expert is folded expert by
    expert)."""
    return lambda index, model, tied: _file_changes(index, fits, model, tied)


def _file_changes(
    index: Mapping[str, TensorEntry], fits: Sequence[RunFit], model: nn.Module, tied: bool
) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    from lorp.models.disk_names import disk_names

    names = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
    out: dict[str, Any] = {}
    for fit in fits:
        if fit.run[0] == 0:
            if tied:
                raise RepairRefused("a run from block 0 cannot fold into tied embeddings")
            targets = [(input_embeddings(model), "weight", "embeddings")]
        else:
            stage = block_stage(model, fit.run[0] - 1)
            targets = [(t.module, t.attr, t.how) for t in stage.fold_targets()]
            if fit.form == "normed":
                assert stage.post_norm is not None
                targets.append((stage.post_norm, "weight", f"norm {stage.norm_offset}"))
        for module, attr, how in targets:
            name = names[id(getattr(module, attr))]
            for key in disk_names(model, [name])[name]:
                if key not in index:
                    raise RepairRefused(f"the checkpoint has no tensor {key!r} to fold into")
                out[key] = _folder(fit, how, attr)
    return out


def _folder(fit: RunFit, how: str, attr: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """How one stored tensor takes `fit`'s map: as `folded_tensor` lays it out, where a
    bank stored one tensor per expert ([d, I], or [I, d] transposed) folds as a linear
    would (transposed: W T)."""

    def fold_one(t: torch.Tensor) -> torch.Tensor:
        if how == "embeddings":
            return folded_embeddings(t, fit)
        if how.startswith("norm"):
            return folded_norm_weight(t, fit, float(how.split()[1]))
        if how in ("bank", "bank_t") and t.dim() == 2:  # one expert's, as its file keeps it
            return folded_bank(t[None], fit, transposed=how == "bank_t")[0]
        if how == "bank_bias" and t.dim() == 1:
            return folded_down_bias(t, fit)
        return folded_tensor(t, fit, how, attr)

    return fold_one


def folded_bank(down: torch.Tensor, fit: RunFit, transposed: bool) -> torch.Tensor:
    """Every routed expert's down projection with the fit's map folded in: `T^T W[e]`
    for a bank stored [E, d, I] (each expert's output is `h W[e]^T`), `W[e] T` for one
    stored [E, I, d]. The router's weights are scalars per token and expert, so the
    mixture's output becomes its output times T, exactly (`lorp.models.blocks`)."""
    T = fit.matrix.to(down.device)
    out = torch.empty_like(down)
    for e in range(down.shape[0]):
        w = down[e].double()
        out[e] = (w @ T if transposed else T.T @ w).to(down.dtype)
    return out


def folded_bank_bias(bias: torch.Tensor, fit: RunFit) -> torch.Tensor:
    """Each routed expert's output bias [E, d] with the map folded in: `b[e] T`."""
    return (bias.double() @ fit.matrix.to(bias.device)).to(bias.dtype)
