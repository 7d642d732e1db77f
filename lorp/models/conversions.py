"""A checkpoint's tensors by the names the model gives them, as transformers loads them.

transformers 5.19 renames some of a checkpoint's tensors as it loads them (Mixtral's
`block_sparse_moe.` becomes `mlp.`, Nemotron-H's `backbone.` becomes `model.`) and builds
others from several (`transformers.conversion_mapping`): a mixture of experts' files keep
one tensor per expert (`mlp.experts.<j>.gate_proj.weight`, Mixtral's `w1`) where the model
holds one bank per projection (`mlp.experts.gate_up_proj` [E, 2I, d]), which a
`WeightConverter` builds with its operations (`MergeModulelist` stacks the experts,
`Concatenate` joins gate and up). Code that reads the files one module at a time
(`lorp.models.streaming`) and the memory plan that counts what it holds
(`lorp.models.memory`) ask here: each file key gets the name `from_pretrained` gives it
(transformers' own `rename_source_key`, `load_names`), and a tensor built from several is
a `FusedEntry`, which `assemble` builds with the converter's own operations from its parts
read in the order and at the dtype `from_pretrained` reads them in: the same values.
gpt-oss's files keep its banks fused, so they load as they are.

This is the forward direction of `lorp.models.disk_names`, which names a model's tensors
as the files do with transformers' reverse conversion.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from lorp.models.safetensors_index import DTYPE_BYTES, FLOATS, TORCH_DTYPES, TensorEntry


class Loaded(NamedTuple):
    """Where `from_pretrained` puts one of the files' tensors."""

    name: str
    """The model's name for the tensor it loads into."""
    pattern: str | None = None
    """The source pattern of the converter that builds that tensor from this one and
    others; None where it loads as it is (renamed or not)."""
    converter: Any = None
    """That converter (transformers' `WeightConverter`), a template never given tensors."""


@dataclass(frozen=True)
class FusedEntry:
    """A model tensor transformers builds from several of the files' tensors (an expert
    bank): read as `TensorEntry`s are (`key`, `shape`, `dtype`, `nbytes_as`)."""

    key: str
    """The model's name for it (a streamed model's override is kept under it)."""
    shape: tuple[int, ...]
    parts: tuple[tuple[str, TensorEntry], ...]
    """(the converter's source pattern, a file's tensor), in the order transformers
    gathers them (experts by number, gate before up)."""
    group: str
    """The name transformers gathers the parts under (the converter's first target)."""
    converter: Any = field(compare=False, repr=False)

    @property
    def dtype(self) -> str:
        """The parts' dtype in the files (safetensors name)."""
        return self.parts[0][1].dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def nbytes_as(self, itemsize: int) -> int:
        """Bytes once built: a floating bank at the load dtype, others as the files keep them."""
        return self.numel * (itemsize if self.dtype in FLOATS else DTYPE_BYTES[self.dtype])


Entry = TensorEntry | FusedEntry


def load_names(model: nn.Module, keys: Iterable[str]) -> dict[str, Loaded]:
    """Each of the files' `keys` -> where `from_pretrained` loads it into `model` (built
    from the checkpoint's config, on the meta device or not), in the order transformers
    reads them (`dot_natural_key`). A key the model has no tensor for keeps its name."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    state = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    out = {}
    for key in sorted(keys, key=dot_natural_key):
        # As `convert_and_load_state_dict_in_model` renames: every renaming, then at most
        # one converter; a key the model has as it is keeps its name.
        name, pattern = rename_source_key(key, renamings, converters, prefix, state)
        if name not in state and key in state:
            name, pattern = rename_source_key(key, [], [], prefix, state)
        out[key] = Loaded(name, pattern, by_pattern[pattern] if pattern is not None else None)
    return out


def model_entries(model: nn.Module, index: Mapping[str, TensorEntry]) -> dict[str, Entry]:
    """The checkpoint `index`'s tensors by `model`'s names for them: a file's tensor, or a
    `FusedEntry` for one transformers builds from several. A file's tensor the model has
    no place for keeps its own name (its reader refuses it, or skips it as legacy)."""
    out: dict[str, Entry] = {}
    groups: dict[str, list[tuple[str, TensorEntry]]] = {}
    converters: dict[str, Any] = {}
    for key, loaded in load_names(model, index).items():
        if loaded.pattern is None:
            out[loaded.name] = index[key]
            continue
        groups.setdefault(loaded.name, []).append((loaded.pattern, index[key]))
        converters[loaded.name] = loaded.converter
    for group, parts in groups.items():
        template = FusedEntry(group, (), tuple(parts), group, converters[group])
        built = assemble(template, _meta_part, model)  # the names and shapes it builds
        for name, t in built.items():
            out[name] = FusedEntry(name, tuple(t.shape), tuple(parts), group, converters[group])
    return out


def assemble(
    entry: FusedEntry, read: Callable[[TensorEntry], torch.Tensor], model: nn.Module
) -> dict[str, torch.Tensor]:
    """Every tensor `entry`'s converter builds from its parts, each part read by `read`,
    by the model's name: the converter's operations, applied as `from_pretrained` applies
    them (its parts read first, then stacked and joined: for a moment the parts and
    the bank they build are held together)."""
    converter = copy.deepcopy(entry.converter)  # transformers copies one per target too
    for pattern, part in entry.parts:
        converter.add_tensor(entry.group, part.key, pattern, functools.partial(read, part))
    built = converter.convert(entry.group, model=model, config=getattr(model, "config", None))
    return {k: v[0] if isinstance(v, list) else v for k, v in built.items()}


def _meta_part(part: TensorEntry) -> torch.Tensor:
    dtype = TORCH_DTYPES.get(part.dtype, torch.float32)
    return torch.empty(part.shape, dtype=dtype, device="meta")
