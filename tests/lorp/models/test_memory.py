"""Memory read from the headers before any weight: the loaded model's bytes exactly, and
the figures by which the pipeline's policy holds a model whole, streams it or refuses it."""

from __future__ import annotations

from pathlib import Path

import torch

from lorp.models.architectures import decoder_blocks
from lorp.models.memory import weight_size
from lorp.models.safetensors_index import tensor_index
from tests.helpers.model_checks import in_memory


def test_sizes_from_headers_are_the_loaded_bytes(checkpoints: dict[str, Path]) -> None:
    for family, path in checkpoints.items():
        model = in_memory(path)
        for dtype in (torch.float32, torch.bfloat16):
            size = weight_size(tensor_index(path), dtype)
            itemsize = 2 if dtype == torch.bfloat16 else 4
            blocks = [
                sum(p.numel() for p in b.parameters()) * itemsize for b in decoder_blocks(model)
            ]
            assert list(size.blocks) == blocks, family
            distinct = {p.data_ptr(): p.numel() for p in model.parameters()}
            assert size.total == sum(distinct.values()) * itemsize, family
            assert (size.head == 0) == (family == "gemma3_text"), family
