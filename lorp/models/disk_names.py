"""A model's tensors by the names its checkpoint's files give them.

transformers 5.19 holds some tensors otherwise than its checkpoints store them: a mixture
of experts keeps its routed experts as one bank ([E, d, I]) where the files keep one
tensor per expert (`mlp.experts.<j>.down_proj.weight`, Mixtral's `w2`), Nemotron-H's
blocks sit under `backbone.` in the files, a multimodal model's text blocks under
`language_model.model.` (`save_pretrained` reverts its conversions). Code that works on
a checkpoint's files without loading it (file surgery, manifests, streaming) asks here:
the model is built on the meta device and transformers' own reverse conversion names
its tensors (`revert_weight_conversion`), so a family transformers converts is named as
transformers saves it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from lorp.models.architectures import architecture_of, decoder_blocks, model_class, skeleton


@dataclass(frozen=True)
class DiskLayout:
    """Where a checkpoint keeps its decoder blocks."""

    block_prefix: str
    """What every text block's tensors start with, up to the index (`model.layers.`)."""
    n_blocks: int

    def split(self, key: str) -> tuple[str, int, str] | None:
        """(prefix, block index, the name inside the block) of a text block's tensor, None
        for any other (embeddings, a vision tower's blocks, a multi-token-prediction
        layer stored past the last block)."""
        if not key.startswith(self.block_prefix):
            return None
        index, dot, rest = key[len(self.block_prefix) :].partition(".")
        if not dot or not index.isdigit() or int(index) >= self.n_blocks:
            return None
        return self.block_prefix, int(index), rest

    def block_of(self, key: str) -> int | None:
        parts = self.split(key)
        return parts[1] if parts is not None else None


def model_of(config: Any) -> nn.Module:
    """The model `config` describes, on the meta device, as its checkpoint loads."""
    return skeleton(config, model_class(config))


def disk_names(model: nn.Module, names: list[str]) -> dict[str, list[str]]:
    """Each of the model's tensors `names` (parameters or buffers, as the model names
    them) -> the names the files keep it under (several for a bank stored one tensor per
    expert, in expert order)."""
    from transformers.core_model_loading import revert_weight_conversion

    state = dict(model.state_dict(keep_vars=True))
    out: dict[str, list[str]] = {}
    for name in names:
        reverted = revert_weight_conversion(model, {name: state[name]})
        out[name] = sorted(reverted, key=_natural)
    return out


def _natural(key: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]


def disk_layout(model: nn.Module) -> DiskLayout:
    """Where the checkpoint of `model` (meta or loaded) keeps its text blocks: the prefix
    of block 0's first tensor as the files name it."""
    blocks = decoder_blocks(model)
    names = {id(p): n for n, p in model.named_parameters()}
    name = names[id(next(iter(blocks[0].parameters())))]
    disk = disk_names(model, [name])[name][0]
    attr = architecture_of(model).blocks_attr
    head, found, _ = disk.partition(f"{attr}.0.")
    if not found:
        raise ValueError(f"cannot find block 0 in the checkpoint name {disk!r} of {name!r}")
    return DiskLayout(f"{head}{attr}.", len(blocks))
