"""The cut the repair tests make in the tiny models, their windows in batches, and the
logits of a forward."""

from __future__ import annotations

import torch

from tests.helpers.tiny_models import N_BLOCKS

LAYERS = [2, 3, N_BLOCKS - 1]  # a run inside the stack and one ending at block N-1

RUNS = [(2, 3), (N_BLOCKS - 1, N_BLOCKS - 1)]


def batches(x: torch.Tensor, size: int = 4) -> list[torch.Tensor]:
    """`x` cut into batches of `size` windows."""
    return [x[i : i + size] for i in range(0, len(x), size)]


def logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The logits of `x`, without gradients or a KV cache."""
    with torch.no_grad():
        return model(input_ids=x, use_cache=False).logits
