"""Drop blocks (and fold a repair) by rewriting a checkpoint's files, never loading it.

The pruned checkpoint is written shard by shard: each kept tensor's bytes are copied from
the source file's byte range under its renumbered name (`layers.<i>.` becomes the block's
new index), except the few tensors a repair's fold changes (block s-1's `down_proj`, a
post-MLP norm's weight, the embeddings of a run from block 0), which are read, folded
with the same arithmetic as the in-memory fold (`lorp.repair.fold.folded_*`) and written.
`config.json` is rewritten exactly as `lorp.models.surgery.drop_layers` rewrites it (a
cut its config cannot describe is refused in one line), and only the text decoder's
blocks are renumbered, as the files name them (`lorp.models.disk_names`): a vision
tower's blocks and a multi-token-prediction layer stay as they are. Peak memory is
one tensor (and a copy buffer), whatever the model's size; the directory appears
atomically, like `lorp.models.surgery.save_pruned`'s.

With `dtype` set, floating tensors are written in it (the in-memory path writes the
dtype the model was loaded in); by default every tensor keeps the checkpoint's dtype.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lorp.atomic import atomic_dir
from lorp.experts.files import ExpertFiles
from lorp.models.architectures import model_class, tied_embeddings
from lorp.models.disk_names import DiskLayout, disk_layout, model_of
from lorp.models.layer_config import check_cut
from lorp.models.safetensors_index import DTYPE_BYTES, DTYPE_NAMES, TensorEntry, tensor_index
from lorp.models.surgery import PROVENANCE_FILE, check_layers, kept_layers

log = logging.getLogger(__name__)

FileChanges = Callable[
    [Mapping[str, TensorEntry], nn.Module, bool],
    dict[str, Callable[[torch.Tensor], torch.Tensor]],
]
"""Given a source's tensor index, its model on the meta device (`disk_names.model_of`) and
whether its embeddings are tied: each tensor to rewrite, by source key, with the function
that gives it from the source's."""

COPY_CHUNK = 64 * 1024**2
# What a tokenizer is made of: copied as they are, like `tokenizer.save_pretrained` would.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def renamed(key: str, new_index: Mapping[int, int], layout: DiskLayout) -> str:
    """`key` with its block index replaced by the block's index in the pruned model."""
    parts = layout.split(key)
    if parts is None:
        return key
    head, b, rest = parts
    return f"{head}{new_index[b]}.{rest}"


def write_pruned_files(
    src: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    layers: Iterable[int],
    provenance: Mapping[str, Any],
    *,
    changes: FileChanges | None = None,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    experts: Mapping[int, Sequence[int]] | None = None,
) -> Path:
    """Write checkpoint `src` without blocks `layers` (with the tensors `changes` names rewritten:
    a repair's fold, `lorp.repair.fold.file_folds`) to
    `out_dir`: safetensors shards, config.json, generation config, tokenizer files and
    `lorp_pruning.json`. `experts`: block -> routed experts removed from every MoE layer
    (`lorp.experts.files`; blocks as `src` numbers them). Returns `out_dir`."""
    from transformers import AutoConfig

    src, out = Path(src), Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"output directory already exists: {str(out)!r}")
    config = AutoConfig.from_pretrained(str(src))
    model = model_of(config)
    layout = disk_layout(model)
    n = layout.n_blocks
    layers = list(layers)
    kept = kept_layers(n, check_layers(layers, n)) if layers or not experts else list(range(n))
    cut_config = check_cut(config, kept, model_class(config))
    index = tensor_index(src)
    cut = None
    if experts:
        from lorp.experts.files import expert_files
        from lorp.experts.surgery import check_expert_cut, with_experts

        cut = expert_files(model, index, experts)
        check_expert_cut(config, with_experts(config, cut.kept), experts, model_class(config))
        cut_config = with_experts(cut_config, cut.kept)
    config = cut_config
    tied = tied_embeddings(model) and "lm_head.weight" not in index
    rewrites = changes(index, model, tied) if changes is not None else {}
    new_index = {old: new for new, old in enumerate(kept)}
    if dtype is not None:
        config.dtype = dtype
    with atomic_dir(out, overwrite=overwrite) as tmp:
        write_shards(tmp, index, layout, new_index, rewrites, dtype, cut)
        config.save_pretrained(tmp)
        copy_side_files(src, tmp, config)
        (tmp / PROVENANCE_FILE).write_text(json.dumps(dict(provenance), indent=2, sort_keys=True))
    log.info("wrote pruned checkpoint %s from %s's files (%d blocks kept)", out, src, len(kept))
    return out


def write_shards(
    out: Path,
    index: Mapping[str, TensorEntry],
    layout: DiskLayout,
    new_index: Mapping[int, int],
    changes: Mapping[str, Any],
    dtype: torch.dtype | None,
    experts: ExpertFiles | None = None,
) -> None:
    """One output shard per source shard, tensors in the source's order: the tensors of
    `index` in kept blocks (`new_index`: old block -> new; also the Nemotron-NAS writer's,
    `lorp.models.nemotron_nas.write_sublayer_files`, with every block kept in place), less
    the experts an expert cut removes (`experts`)."""
    cut = experts or ExpertFiles()
    by_file: dict[Path, list[TensorEntry]] = {}
    for key, entry in index.items():
        b = layout.block_of(key)
        if (b is None or b in new_index) and key not in cut.drop:
            by_file.setdefault(entry.file, []).append(entry)
    files = sorted(by_file)
    weight_map: dict[str, str] = {}
    total = 0
    for file in files:
        name = file.name if len(files) > 1 else "model.safetensors"
        entries = sorted(by_file[file], key=lambda e: e.start)
        total += _write_file(out / name, entries, layout, new_index, changes, dtype, cut)
        weight_map |= {renamed(cut.name(e.key), new_index, layout): name for e in entries}
    if len(files) > 1:
        doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(doc, indent=2))


def _write_file(
    path: Path,
    entries: list[TensorEntry],
    layout: DiskLayout,
    new_index: Mapping[int, int],
    changes: Mapping[str, Any],
    dtype: torch.dtype | None,
    cut: ExpertFiles,
) -> int:
    """One safetensors file, written tensor by tensor; returns its data bytes."""
    from safetensors import safe_open

    def converts(e: TensorEntry) -> bool:
        floating = e.dtype in ("F64", "F32", "F16", "BF16")
        return (
            e.key in changes
            or e.key in cut.slices
            or (dtype is not None and floating and DTYPE_NAMES[dtype] != e.dtype)
        )

    out_dtype = {
        e.key: DTYPE_NAMES[dtype] if dtype is not None and converts(e) else e.dtype for e in entries
    }
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        shape = cut.shape(e.key, e.shape)
        size = math.prod(shape) * DTYPE_BYTES[out_dtype[e.key]]
        name = renamed(cut.name(e.key), new_index, layout)
        header[name] = {
            "dtype": out_dtype[e.key],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    handle = (
        safe_open(str(entries[0].file), framework="pt") if any(map(converts, entries)) else None
    )
    with open(path, "wb") as f, open(entries[0].file, "rb") as source:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for e in entries:
            if converts(e):
                t = handle.get_tensor(e.key)
                if dtype is not None and t.is_floating_point():
                    t = t.to(dtype)
                if e.key in changes:
                    t = changes[e.key](t)
                if e.key in cut.slices:
                    t = cut.cut(e.key)(t)
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
                continue
            source.seek(e.start)
            left = e.end - e.start
            while left:
                chunk = source.read(min(left, COPY_CHUNK))
                f.write(chunk)
                left -= len(chunk)
    return offset


def copy_side_files(src: Path, out: Path, config: Any) -> None:
    """Generation config and tokenizer files, copied (or the generation config derived
    from the model's config, as `save_pretrained` does for a model without one)."""
    from transformers import GenerationConfig

    generation = src / "generation_config.json"
    if generation.is_file():
        shutil.copy2(generation, out / generation.name)
    else:
        GenerationConfig.from_model_config(config).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
