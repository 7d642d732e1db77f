"""Drop whole blocks from a model and save the result as a checkpoint that reloads anywhere.

Measured: without renumbering `layer_idx` the KV cache of `generate()` fails with an
IndexError; without subsetting `layer_types` Gemma 3 fails at `config.layer_types[i]`.
Every per-layer field of the text config is rewritten for the kept blocks, and a cut the
family's config cannot describe is refused in one line before anything changes
(`lorp.models.layer_config`).
A checkpoint is written to a temporary sibling directory and renamed into place
(`lorp.atomic.atomic_dir`), so a crash never leaves a half-written directory that looks
complete; its leftovers are named `.<name>.<random>.partial`.

`blocks_dropped` makes the same model in memory and only for the duration of a `with`
block, so a loss-guided method can score many candidate sets on one loaded model
(`lorp.scoring.removal_loss.LossEvaluator`) without copying weights.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import nn

from lorp.atomic import atomic_dir
from lorp.models.architectures import architecture_of, decoder_blocks, decoder_stack
from lorp.models.layer_config import check_cut, rewrite_layers, text_config

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


def kept_layers(n_blocks: int, pruned: Iterable[int]) -> list[int]:
    """The blocks that stay, in depth order: the complement of `pruned` in 0..N-1. The one
    definition of "kept" for selections, surgery, provenance and the catalog."""
    gone = {int(i) for i in pruned}
    return [i for i in range(n_blocks) if i not in gone]


def drop_layers(model: nn.Module, layers: Iterable[int]) -> list[int]:
    """Remove blocks `layers` from `model` in place; returns the kept original indices.
    `CutRefused` (one line) where the model's config cannot describe the kept blocks."""
    arch = architecture_of(model)
    blocks = decoder_blocks(model)
    n = len(blocks)
    kept = kept_layers(n, check_layers(layers, n))
    check_cut(model.config, kept, type(model))  # before anything changes
    new_blocks = nn.ModuleList([blocks[i] for i in kept])
    _renumber(new_blocks)
    setattr(decoder_stack(model), arch.blocks_attr, new_blocks)
    rewrite_layers(text_config(model.config), kept, n)
    return kept


@contextmanager
def blocks_dropped(model: nn.Module, layers: Iterable[int]) -> Iterator[list[int]]:
    """Inside the block, `model` runs without blocks `layers`; on exit it is restored.

    Nothing is copied: the decoder's ModuleList is swapped for one holding the kept blocks
    (the same modules), the config is subset exactly as `drop_layers` does, and layer_idx
    is renumbered (only KV caches read it; loss evaluation runs with use_cache=False, but
    the model inside is then the one `drop_layers` would make). Every change is undone on
    exit, exceptions included. Empty `layers`: the model as it is. Yields the kept
    original indices. Not thread-safe: one model, one candidate at a time.
    """
    arch = architecture_of(model)
    blocks = decoder_blocks(model)
    n = len(blocks)
    wanted = list(layers)
    if not wanted:
        yield list(range(n))
        return
    kept = kept_layers(n, check_layers(wanted, n))
    config = text_config(model.config)
    saved_config = dict(vars(config))
    saved_idx = [
        (module, module.layer_idx)
        for i in kept
        for module in blocks[i].modules()
        if isinstance(getattr(module, "layer_idx", None), int)
    ]
    stack = decoder_stack(model)
    try:
        new_blocks = nn.ModuleList([blocks[i] for i in kept])
        _renumber(new_blocks)
        setattr(stack, arch.blocks_attr, new_blocks)
        rewrite_layers(config, kept, n, strict=False)
        yield kept
    finally:
        setattr(stack, arch.blocks_attr, blocks)
        for module, idx in saved_idx:
            module.layer_idx = idx
        _restore_attributes(config, saved_config)


def _renumber(blocks: nn.ModuleList) -> None:
    """Attention modules index the KV cache by layer_idx: number them 0..len-1."""
    for new_idx, block in enumerate(blocks):
        for module in block.modules():
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx = new_idx


def _restore_attributes(obj: Any, saved: dict[str, Any]) -> None:
    """Put back `obj`'s instance attributes as `saved` (a shallow `vars` copy) had them."""
    current = vars(obj)
    for key in [k for k in current if k not in saved]:
        delattr(obj, key)
    for key, value in saved.items():
        if key not in current or current[key] is not value:
            setattr(obj, key, value)


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
    clear_gguf_quantizer(model)
    with atomic_dir(out, overwrite=overwrite) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / PROVENANCE_FILE).write_text(json.dumps(dict(provenance), indent=2, sort_keys=True))
    log.info("saved pruned checkpoint to %s", out)
    return out


def clear_gguf_quantizer(model: nn.Module) -> None:
    """Detach the GGUF quantizer so the model can be saved: transformers dequantizes GGUF
    weights on load but then refuses to save while it is attached (measured); the
    weights are plain tensors by now."""
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
