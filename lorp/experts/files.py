"""An expert cut as the checkpoint's files name it, so `lorp.models.file_surgery` writes it
without loading the model: which file tensors go, which are renamed, which are sliced.

A bank the model holds fused ([E, ...]) is kept by the files either one tensor per expert
(`...experts.<e>.gate_proj.weight`: transformers converts at load time; Qwen3-MoE,
Mixtral, DeepSeek) or fused as the model holds it (gpt-oss, Granite-MoE's
`input_linear`); `lorp.models.disk_names` says which. A removed expert's tensors are not
written, a kept one's are renumbered (expert e becomes its rank among the kept); a fused
bank and the router's tensors (its weight, bias, score correction) are sliced along their
expert dimension. Everything else is copied as it is.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from lorp.experts.layers import moe_layers
from lorp.experts.surgery import kept_experts
from lorp.models.disk_names import disk_names
from lorp.models.safetensors_index import TensorEntry

EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


@dataclass(frozen=True)
class ExpertFiles:
    """What an expert cut does to a checkpoint's tensors, by their source names."""

    drop: frozenset[str] = frozenset()
    rename: Mapping[str, str] = field(default_factory=dict)
    """Source key -> the key with its expert renumbered (its block index as the source's)."""
    slices: Mapping[str, tuple[int, tuple[int, ...], int]] = field(default_factory=dict)
    """Source key -> (its expert dimension, the experts kept, the experts before the cut)."""
    kept: int = 0
    """Routed experts each MoE layer keeps."""

    def name(self, key: str) -> str:
        return self.rename.get(key, key)

    def shape(self, key: str, shape: Sequence[int]) -> tuple[int, ...]:
        """The tensor's shape once cut."""
        if key not in self.slices:
            return tuple(shape)
        dim, kept, _ = self.slices[key]
        return tuple(len(kept) if d == dim else s for d, s in enumerate(shape))

    def cut(self, key: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """The slice of `key` along its expert dimension; a tensor already cut (a variant's
        stored change) passes as it is."""
        dim, kept, n = self.slices[key]

        def fn(t: torch.Tensor) -> torch.Tensor:
            if t.shape[dim] != n:
                return t
            return t.index_select(dim, torch.tensor(kept, device=t.device))

        return fn


def expert_files(
    model: nn.Module, index: Mapping[str, TensorEntry], removed: Mapping[int, Sequence[int]]
) -> ExpertFiles:
    """The file side of removing `removed` (block -> routed experts) from the checkpoint of
    `model` (on the meta device, `lorp.models.disk_names.model_of`) whose tensors are
    `index`."""
    layers = moe_layers(model)
    kept = kept_experts(layers, removed)
    names = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
    drop: set[str] = set()
    rename: dict[str, str] = {}
    slices: dict[str, tuple[int, tuple[int, ...], int]] = {}
    for layer in layers:
        n, keep = layer.n_experts, kept[layer.block]
        rank = {e: i for i, e in enumerate(keep)}
        owners = [
            m for top in (layer.experts, layer.router) if top is not None for m in top.modules()
        ]
        tensors = [
            t for m in owners for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        ]
        wanted = [names[id(t)] for t in tensors if n in t.shape]
        for name, files in disk_names(model, wanted).items():
            if len(files) == 1:
                shape = list(index[files[0]].shape)
                if n not in shape:
                    raise ValueError(f"file tensor {files[0]!r} has no dimension of {n} experts")
                slices[files[0]] = (shape.index(n), tuple(keep), n)
                continue
            for key in files:
                found = EXPERT_INDEX.search(key)
                if found is None:
                    raise ValueError(f"cannot tell the expert of file tensor {key!r} of {name!r}")
                e = int(found.group(1))
                if e not in rank:
                    drop.add(key)
                elif rank[e] != e:
                    rename[key] = key[: found.start()] + f".experts.{rank[e]}." + key[found.end() :]
    return ExpertFiles(frozenset(drop), rename, slices, len(next(iter(kept.values()))))
