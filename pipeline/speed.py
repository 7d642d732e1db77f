"""Speed and memory of a model, after the paper's Appendix A, measured so that a figure
can be trusted.

- Prefill latency: one forward at batch 1 over `seq_len` tokens with the KV cache off and
  logits for the last position only (`logits_to_keep=1`), as a generation prefill does; a
  full-sequence LM head (Gemma 3's has 262k rows) would time the head, not the blocks.
- `interleaved_speedup` times the dense and the pruned model alternately in one process
  (warm-ups, then pairs in ABBA... order) and reports medians and the spread of the per-pair
  ratio, so drift in machine load hits both sides alike. The pipeline runs it in a
  dedicated pass after the grid, one model at a time on a whole node.
- Peak memory of a variant is measured in a fresh process (`peak_memory_fresh`, forked
  from a server that has imported torch once): load
  its saved checkpoint (or the dense model, then drop and free the blocks), reset the
  high-water mark (CUDA: `reset_peak_memory_stats`;
  Linux CPU: `/proc/self/clear_refs`), one prefill, read the peak. A reused worker's
  `ru_maxrss` only grows, so it cannot show what pruning saves.

Removing k of N blocks cannot speed a prefill up by more than N / (N - k)
(`speedup_bound`); the embedding and LM head make the real bound lower still.
"""

from __future__ import annotations

import functools
import gc
import multiprocessing
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

import torch


def speedup_bound(n_blocks: int, removed: int) -> float:
    """The most a prefill can speed up when `removed` of `n_blocks` blocks go."""
    return n_blocks / (n_blocks - removed)


def _ids(model: Any, seq_len: int, seed: int = 0) -> torch.Tensor:
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, int(model.config.vocab_size), (1, seq_len), generator=g).to(device)


def _time_ms(model: Any, ids: torch.Tensor) -> float:
    _sync(ids.device)
    start = time.perf_counter()
    model(input_ids=ids, use_cache=False, logits_to_keep=1)
    _sync(ids.device)
    return (time.perf_counter() - start) * 1000.0


def prefill_latency(
    model: Any, seq_len: int, *, warmup: int = 2, repeats: int = 5, seed: int = 0
) -> dict[str, float]:
    """Mean and std (ms) of a batch-1 prefill of `seq_len` tokens, cache off."""
    ids = _ids(model, seq_len, seed)
    with torch.inference_mode():
        times = [_time_ms(model, ids) for _ in range(warmup + repeats)][warmup:]
    return {
        "latency_ms": statistics.fmean(times),
        "latency_std_ms": statistics.stdev(times) if len(times) > 1 else 0.0,
    }


def interleaved_speedup(
    dense: Any, pruned: Any | None, seq_len: int, *, pairs: int = 5, warmup: int = 3
) -> dict[str, float]:
    """Median latencies and the median (and std) of the per-pair dense/pruned ratio.
    `pruned=None` times the dense model alone (speed-up 1 by definition). The garbage
    collector is off while timing, as in `timeit`, so a collection cannot land on one side."""
    ids = _ids(dense, seq_len)
    models = [dense] if pruned is None else [dense, pruned]
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with torch.inference_mode():
            for _ in range(warmup):
                for m in models:
                    _time_ms(m, ids)
            runs = [_pair(models, ids, flip=i % 2 == 1) for i in range(max(pairs, 1))]
    finally:
        if was_enabled:
            gc.enable()
    return _summarise(runs)


def _pair(models: list[Any], ids: torch.Tensor, flip: bool) -> list[float]:
    """One timing of each model, [dense, pruned]; every other pair runs pruned first, so
    a drift in machine speed does not favour either side (ABBA...)."""
    order = models[::-1] if flip else models
    times = [_time_ms(m, ids) for m in order]
    return times[::-1] if flip else times


def _summarise(runs: list[list[float]]) -> dict[str, float]:
    dense_ms = statistics.median(r[0] for r in runs)
    if len(runs[0]) == 1:
        return {
            "latency_ms": dense_ms,
            "latency_dense_ms": dense_ms,
            "speedup": 1.0,
            "speedup_std": 0.0,
        }
    ratios = [r[0] / r[1] for r in runs]
    return {
        "latency_ms": statistics.median(r[1] for r in runs),
        "latency_dense_ms": dense_ms,
        "speedup": statistics.median(ratios),
        "speedup_std": statistics.stdev(ratios) if len(ratios) > 1 else 0.0,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    """Reset the high-water mark: the CUDA allocator's, or this process's resident set."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif Path("/proc/self/clear_refs").exists():
        Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := VmRSS


def peak_memory_gib(device: torch.device) -> float:
    """CUDA peak allocated since the last reset; on CPU the resident high-water mark
    (VmHWM on Linux, reset by `reset_peak_memory`; ru_maxrss elsewhere)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # kB
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def peak_memory_fresh(
    model_path: str, layers: Sequence[int], dtype: str, device: str, seq_len: int
) -> dict[str, float]:
    """`peak_mem_gib` of a variant, measured in a fresh process.

    The process is forked from a server that imported torch and transformers once
    (multiprocessing's forkserver), so each variant costs a fork, not an interpreter start
    and those imports (seconds per variant on a small machine). It starts as a fresh
    interpreter with the same imports would: no model, no CUDA context, no allocator
    history, and it ends after one measurement."""
    ctx = _fresh_processes()
    with ProcessPoolExecutor(1, mp_context=ctx, max_tasks_per_child=1) as pool:
        job = pool.submit(_peak_memory_here, model_path, list(layers), dtype, device, seq_len)
        try:
            peak = job.result(timeout=1800)
        except Exception as exc:
            reason = str(exc).strip().splitlines()[-1:] or [type(exc).__name__]
            raise RuntimeError(f"peak-memory process failed: {reason[0]}") from None
    return {"peak_mem_gib": float(peak)}


@functools.cache
def _fresh_processes() -> BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", "lorp.sources", "pipeline.speed"])
    return ctx


def _peak_memory_here(model_path: str, layers: list[int], dtype: str, device: str, n: int) -> float:
    import gc

    from lorp.sources import load_model
    from lorp.surgery import drop_layers

    lm = load_model(model_path, dtype=dtype, device=device, with_tokenizer=False)
    if layers:
        drop_layers(lm.model, layers)
    gc.collect()  # the dropped blocks' tensors go before the mark is reset
    dev = torch.device(device)
    reset_peak_memory(dev)
    with torch.inference_mode():
        lm.model(input_ids=_ids(lm.model, n), use_cache=False, logits_to_keep=1)
    return peak_memory_gib(dev)


def count_params(model: Any) -> int:
    """Parameters, each tied tensor counted once."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel()
    return total
