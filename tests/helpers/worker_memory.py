"""Worker memory for the streamed-model tests: a size between what a tiny checkpoint needs
streamed and held whole, and the evaluation those jobs run."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lorp.models.memory import GIB, stage_activations, weight_size
from lorp.models.safetensors_index import tensor_index
from lorp.models.shape import ModelShape
from pipeline.plan.decisions import HEADROOM

EVAL = {"perplexity": ["ptb"], "seq_len": 48, "max_windows": 2, "speed": True}


def between(
    model: Path, stage: str, batch: int, seq_len: int, kept: int = 0, states: int | None = None
) -> float:
    """A worker memory (GiB) under the whole model's need and over the streamed one's
    (`kept`: what the stage holds besides, a repaired point's fit; `states`: the states a
    capture keeps, 2N + 1 for a job with sub-layers)."""
    size = weight_size(tensor_index(model), torch.float32)
    shape = ModelShape.from_config(json.loads((model / "config.json").read_text()))
    acts = stage_activations(stage, shape, batch, seq_len, 4, states) + kept  # type: ignore[arg-type]
    streamed = size.resident + 2 * size.largest_unit + acts
    whole = size.total + acts  # one copy (a CPU point holds two where they fit)
    assert streamed < whole
    return (streamed + whole) / 2 / HEADROOM / GIB
