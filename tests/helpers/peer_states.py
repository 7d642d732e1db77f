"""Hand-taken states for the peer recipes' tests: transformers' own hidden states and a
plain hook, never `lorp.peers`' capture, as float64 numpy rows."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


@torch.no_grad()
def hidden_rows(model: nn.Module, windows: torch.Tensor) -> list[np.ndarray]:
    """transformers' hidden states as rows [tokens, d]: entry k is block k's input (the
    last one is after the final norm, and not used here)."""
    out = model(input_ids=windows, output_hidden_states=True, use_cache=False)
    return [h.reshape(-1, h.shape[-1]).double().numpy() for h in out.hidden_states]


@torch.no_grad()
def mlp_rows(model: nn.Module, windows: torch.Tensor, block: int, name: str = "mlp") -> np.ndarray:
    """What block `block`'s `mlp` module (or `name`) outputs, as rows (a plain hook)."""
    seen = []
    site = getattr(model.model.layers[block], name)

    def hook(m: nn.Module, a: tuple, o: object) -> None:
        o = o[0] if isinstance(o, tuple) else o
        seen.append(o.reshape(-1, o.shape[-1]))

    handle = site.register_forward_hook(hook)
    try:
        model(input_ids=windows, use_cache=False)
    finally:
        handle.remove()
    return torch.cat(seen).double().numpy()


def attention_rows(model: nn.Module, windows: torch.Tensor, block: int) -> np.ndarray:
    """What block `block`'s `self_attn` outputs, as rows."""
    return mlp_rows(model, windows, block, "self_attn")


def mean_cos_distance(a: np.ndarray, b: np.ndarray) -> float:
    """The token mean of 1 - cos(a_t, b_t), by numpy."""
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(np.mean(1.0 - cos))
