"""The device side of `benchmarks/gpu.py`: the model shapes it measures, built with random
weights on the device, and the device's clock and memory (no-ops on a CPU)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from benchmarks import timing
from benchmarks.inputs import random_model

SHAPES: dict[str, dict[str, Any]] = {
    "llama-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
    "gemma3-4b": {
        "model_type": "gemma3_text",
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "vocab_size": 262144,
        "max_position_embeddings": 8192,
        "sliding_window": 1024,
        "query_pre_attn_scalar": 256,
        "tie_word_embeddings": True,
    },
}
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 12,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "vocab_size": 512,
    "sliding_window": 16,
    "query_pre_attn_scalar": 32,
}
"""The same families at a size the test suite runs on CPU in seconds."""


def build(shape: str, tiny: bool, device: str) -> Any:
    """Random-init fp32 model of `shape` on `device` (weights made there, not copied)."""
    fields = dict(SHAPES[shape])
    model_type = fields.pop("model_type")
    if tiny:
        fields |= {k: v for k, v in TINY.items() if k in fields or model_type == "gemma3_text"}
        fields["max_position_embeddings"] = 256
    if model_type == "gemma3_text":
        n = fields["num_hidden_layers"]
        # Gemma 3's pattern: five sliding-window blocks, then one global.
        fields["layer_types"] = [
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)
        ]
    model = random_model(model_type, device, **fields)
    if tiny:  # random init is near the identity per block at this size; give S structure
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.ndim == 2 and "embed" not in name:
                    p.mul_(8.0)
    return model


def cuda(device: str) -> bool:
    return device.startswith("cuda")


def sync(device: str) -> None:
    """Wait for the device's queued work (nothing to wait for on a CPU)."""
    if cuda(device):
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str, repeats: int, warmup: int = 1) -> tuple[float, Any]:
    """Median seconds of `repeats` calls after `warmup` untimed ones, the device
    synchronised around each, and the last call's result."""
    return timing.timed(fn, repeats, warmup, sync=lambda: sync(device))


def peak_gib(device: str, fn: Callable[[], Any]) -> tuple[float | None, Any]:
    """Peak GPU memory allocated while `fn` runs (None on CPU), and its result."""
    if not cuda(device):
        return None, fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30, out
