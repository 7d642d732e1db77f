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


def test_a_streamed_mixture_plans_its_banks_and_the_experts_tensors_that_build_them(
    tmp_path: Path,
) -> None:
    """A tiny Qwen3-MoE's largest unit is a layer's experts module: its two banks
    (gate_up [4, 64, 64], down [4, 64, 32]: 98,304 bytes in fp32) and, while gate_up is
    built, its 4 experts' gate and up tensors (8 of [32, 64]: 65,536 bytes). That is
    what loading the unit holds at its peak, measured; the files' own modules (one
    expert's projection) would plan for the embeddings' 32,768."""
    from lorp.models.disk_names import model_of
    from lorp.models.streaming import build_streamed, streamer_of
    from tests.helpers.family_models import family_model
    from tests.helpers.held_bytes import HeldBytes

    family_model("qwen3_moe").save_pretrained(tmp_path)
    index = tensor_index(tmp_path)
    model = model_of(in_memory(tmp_path).config)
    planned = weight_size(index, torch.float32, model=model).largest_unit
    assert planned == 98_304 + 65_536
    assert weight_size(index, torch.float32).largest_unit == 128 * 64 * 4  # the embeddings
    streamed = build_streamed(tmp_path)
    streamer = streamer_of(streamed)
    assert streamer is not None
    unit = streamer.units[id(decoder_blocks(streamed)[1].mlp.experts)]
    with HeldBytes() as held:
        streamer.load(unit)
        streamer.unload(unit)
    assert held.peak == planned
