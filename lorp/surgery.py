"""Drop whole blocks from a model and save the result as a checkpoint that reloads anywhere.

Measured: without renumbering `layer_idx` the KV cache of `generate()` fails with an
IndexError; without subsetting `layer_types` Gemma 3 fails at `config.layer_types[i]`.
A checkpoint is written to a temporary sibling directory and renamed into place, so a crash
never leaves a half-written directory that looks complete.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from torch import nn

from lorp.architectures import architecture_of, decoder_blocks

log = logging.getLogger(__name__)

PROVENANCE_FILE = "lorp_pruning.json"


def check_layers(layers: Iterable[int], n_blocks: int) -> list[int]:
    """Sorted distinct block indices, each in [0, N), leaving at least one block."""
    out = sorted(set(int(i) for i in layers))
    bad = [i for i in out if not 0 <= i < n_blocks]
    if bad:
        raise ValueError(f"layers must be in [0, {n_blocks - 1}], got {bad}")
    if not out:
        raise ValueError("layers to drop are empty")
    if len(out) >= n_blocks:
        raise ValueError(f"cannot drop all {n_blocks} blocks")
    return out


def drop_layers(model: nn.Module, layers: Iterable[int]) -> list[int]:
    """Remove blocks `layers` from `model` in place; returns the kept original indices."""
    arch = architecture_of(model)
    blocks = decoder_blocks(model)
    n = len(blocks)
    pruned = set(check_layers(layers, n))
    kept = [i for i in range(n) if i not in pruned]

    new_blocks = nn.ModuleList([blocks[i] for i in kept])
    for new_idx, block in enumerate(new_blocks):
        # Attention modules index the KV cache by layer_idx.
        for module in block.modules():
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx = new_idx
    stack = model
    for name in arch.decoder_path.split("."):
        stack = getattr(stack, name)
    setattr(stack, arch.blocks_attr, new_blocks)

    _subset_config(model.config, kept, n, arch.per_layer_fields, arch.layer_count_fields)
    return kept


def _subset_config(
    config: Any,
    kept: list[int],
    n: int,
    per_layer_fields: tuple[str, ...],
    layer_count_fields: tuple[str, ...],
) -> None:
    # Declared per-layer lists, and any other list the config holds with one entry per
    # block whose name says so (e.g. mlp_layer_types): subset, never truncate.
    fields = set(per_layer_fields)
    for key, value in vars(config).items():
        if key.endswith("layer_types") and isinstance(value, list | tuple) and len(value) == n:
            fields.add(key)
    for key in sorted(fields):
        value = getattr(config, key, None)
        if value is None:
            continue
        if len(value) != n:
            raise ValueError(f"config.{key} has {len(value)} entries for {n} blocks")
        setattr(config, key, [value[i] for i in kept])
    for key in layer_count_fields:
        value = getattr(config, key, None)
        if isinstance(value, int):
            setattr(config, key, sum(1 for i in kept if i < value))
    config.num_hidden_layers = len(kept)


def save_pruned(
    model: nn.Module,
    tokenizer: Any,
    out_dir: str | os.PathLike[str],
    provenance: Mapping[str, Any],
    *,
    overwrite: bool = False,
) -> Path:
    """Write safetensors, the tokenizer and `lorp_pruning.json` to `out_dir`, atomically."""
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"output directory already exists: {str(out)!r}")
    out.parent.mkdir(parents=True, exist_ok=True)
    _clear_gguf_quantizer(model)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / PROVENANCE_FILE).write_text(json.dumps(dict(provenance), indent=2, sort_keys=True))
        _fsync_tree(tmp)
        if out.exists():
            trash = out.with_name(f".{out.name}.old")
            os.replace(out, trash)
            os.replace(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("saved pruned checkpoint to %s", out)
    return out


def _clear_gguf_quantizer(model: nn.Module) -> None:
    # transformers dequantizes GGUF weights on load but then refuses to save while the GGUF
    # quantizer is attached (measured); the weights are plain tensors by now.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    if hasattr(model, "is_quantized"):
        model.is_quantized = False


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
