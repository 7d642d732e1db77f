"""The tiny models in a test: a padded batch, a checkpoint loaded whole in float32 (what
the streamed and file-rewriting paths are compared with), a snapshot that says a
model was left exactly as it was found, and the full copy of a repaired variant with the
check that another checkpoint holds the same tensors and config."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from lorp.models.architectures import decoder_blocks
from tests.helpers.tiny_models import VOCAB


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Two seeded sequences of 24 ids, the second right-padded after 17."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0  # right padding on the second sequence
    return {"input_ids": ids, "attention_mask": mask}


def in_memory(path: Path) -> torch.nn.Module:
    """The checkpoint at `path` loaded whole by transformers, float32, eval mode."""
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def snapshot(model: torch.nn.Module) -> tuple:
    """Everything `assert_unchanged` compares: blocks, weights, config, layer indices."""
    return (
        decoder_blocks(model),
        list(decoder_blocks(model)),
        {k: v.clone() for k, v in model.state_dict().items()},
        model.config.to_dict(),
        dict(vars(model.config)),
        [getattr(m, "layer_idx", None) for m in model.modules()],
    )


def assert_unchanged(model: torch.nn.Module, before: tuple) -> None:
    blocks, members, state, config, attrs, idx = before
    assert decoder_blocks(model) is blocks and list(decoder_blocks(model)) == members
    now = model.state_dict()
    assert now.keys() == state.keys() and all(torch.equal(now[k], state[k]) for k in state)
    assert model.config.to_dict() == config
    assert vars(model.config).keys() == attrs.keys()
    assert [getattr(m, "layer_idx", None) for m in model.modules()] == idx


def tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory's safetensors files, by name."""
    from safetensors import safe_open

    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out |= {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    return out


def config_of(path: Path) -> dict:
    config = json.loads((path / "config.json").read_text())
    config.pop("transformers_version", None)
    return config


def full_copy(
    dense: torch.nn.Module,
    fits: Sequence[Any],
    layers: Sequence[int],
    out: Path,
    provenance: dict[str, Any],
) -> Path:
    """The repaired variant as the in-memory path writes it: fits folded, blocks dropped,
    saved whole (`dense` is changed)."""
    from lorp.models.surgery import drop_layers, save_pruned
    from lorp.repair.fold import fold

    fold(dense, fits)
    drop_layers(dense, layers)
    return save_pruned(dense, None, out, provenance)


def assert_same_checkpoint(a: Path, b: Path) -> None:
    """The same tensor names, every tensor equal bit for bit, the same config."""
    ta, tb = tensors(a), tensors(b)
    assert sorted(ta) == sorted(tb)
    for key in ta:
        assert torch.equal(ta[key], tb[key]), key
    assert config_of(a) == config_of(b)
