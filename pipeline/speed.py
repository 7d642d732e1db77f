"""Speed and memory of a model, after the paper's Appendix A.

Prefill latency: one forward at batch 1 over `seq_len` tokens with the KV cache off,
`warmup` untimed runs, then `repeats` timed runs (mean and std). Peak memory: the CUDA
allocator's peak on GPU (reset per measurement); on CPU, the process's peak RSS, which
includes everything the process held before (so compare models measured in one process
back to back, dense first).
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from typing import Any

import torch


def prefill_latency(
    model: Any, seq_len: int, *, warmup: int = 2, repeats: int = 5, seed: int = 0
) -> dict[str, float]:
    """Mean and std (ms) of a batch-1 prefill of `seq_len` tokens, cache off."""
    device = next(model.parameters()).device
    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, seq_len), generator=g).to(device)
    times = []
    with torch.inference_mode():
        for i in range(warmup + repeats):
            _sync(device)
            start = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            _sync(device)
            if i >= warmup:
                times.append((time.perf_counter() - start) * 1000.0)
    return {
        "latency_ms": statistics.fmean(times),
        "latency_std_ms": statistics.stdev(times) if len(times) > 1 else 0.0,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float:
    """CUDA peak allocated since the last reset, or this process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def count_params(model: Any) -> int:
    """Parameters, each tied tensor counted once."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel()
    return total
