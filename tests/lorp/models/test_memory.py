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
            # The files are float32: a bfloat16 load converts every tensor and holds the
            # file's copy at its end; a float32 load converts none.
            stored = weight_size(tensor_index(path), torch.float32).total
            assert size.converted == (stored if dtype == torch.bfloat16 else 0), family
            assert size.load_peak == size.total + size.converted, family


def test_a_sub_layer_capture_plans_for_its_2n_plus_1_states() -> None:
    """Capture keeps every state's normalised fp32 copy: 2N + 1 of them for the sub-layer
    S, N + 1 for the block S; the block's own forward is the same either way."""
    from lorp.models.memory import stage_activations
    from lorp.models.shape import ModelShape

    shape = ModelShape.from_config(
        {
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_hidden_layers": 6,
            "intermediate_size": 128,
            "vocab_size": 100,
        }
    )
    tokens, d = 2 * 16, 64
    blocks = stage_activations("capture", shape, 2, 16, 4)
    units = stage_activations("capture", shape, 2, 16, 4, states=13)
    assert units - blocks == 4 * (13 - 7) * tokens * d
    assert stage_activations("evaluate", shape, 2, 16, 4, states=13) == stage_activations(
        "evaluate", shape, 2, 16, 4
    )
