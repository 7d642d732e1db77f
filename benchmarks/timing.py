"""How the benchmark scripts time what they measure: the median of repeated calls after a
warm-up, the bare decoder-stack forward a capture is timed against, and the blocks a
timed pruned variant lacks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from lorp.models.architectures import decoder_stack


def timed(
    fn: Callable[[], Any], repeats: int, warmup: int = 1, sync: Callable[[], None] | None = None
) -> tuple[float, Any]:
    """Median seconds of `repeats` calls of `fn` after `warmup` untimed ones, and the last
    call's result; `sync` (a device's) runs before and after each timed call."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        start = time.perf_counter()
        out = fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def median_time(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Median seconds of `repeats` calls of `fn` after `warmup` untimed ones."""
    return timed(fn, repeats, warmup)[0]


def bare_forward(model: Any, batches: list[torch.Tensor]) -> None:
    """The decoder stack alone over `batches`: no hooks, no LM head, no cache."""
    stack = decoder_stack(model)
    with torch.inference_mode():
        for b in batches:
            stack(input_ids=b, use_cache=False)


def deep_blocks(n_blocks: int, k: int) -> list[int]:
    """The `k` deepest blocks but the last, the blocks a timed variant lacks: what a
    forward costs depends on the shapes left, not on which blocks go."""
    return list(range(n_blocks - 1 - k, n_blocks - 1))
