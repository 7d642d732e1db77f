"""Speed and memory of a model, after the paper's Appendix A, measured so that a figure
can be trusted.

- Prefill latency: one forward at batch 1 over `seq_len` tokens with the KV cache off and
  logits for the last position only (`logits_to_keep=1`), as a generation prefill does; a
  full-sequence LM head (Gemma 3's has 262k rows) would time the head, not the blocks.
- `timed_speedup` times the dense and the pruned model alternately in one process
  (warm-ups, then rounds in ABBA... order) and takes each side's latency as the minimum
  of its runs, as `timeit` recommends: interference (other processes, a collection, a
  migrating thread) only ever adds time, so a minimum cannot be flattered by it while a
  median or mean of a noisy side can. It keeps timing until the estimate is resolved:
  on each side two runs agree on the floor (the second-smallest time within 2% of the
  smallest) and the ratio of the minima is within 5% of the bound below; a ratio above
  that is never published. The pipeline runs it in a dedicated pass after the grid, one
  model at a time on a whole node.
- `interleaved_speedup`, the earlier estimator (medians and the median per-pair ratio),
  is kept for callers that have not moved to `timed_speedup`.
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
import math
import multiprocessing
import resource
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
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


BOUND_SLACK = 1.05
"""A measured speed-up more than 5% above N/(N-k) is a broken timing, never a result."""


def _now() -> float:
    return time.perf_counter()


def timed_speedup(
    dense: Any,
    pruned: Any | None,
    seq_len: int,
    *,
    n_blocks: int,
    removed: int,
    min_runs: int = 5,
    max_runs: int = 30,
    budget_s: float | None = None,
    warmup: int = 2,
    tolerance: float = 0.02,
) -> dict[str, float]:
    """Prefill latencies of `dense` and `pruned` (the minimum of each side's runs) and
    their ratio, timed alternately until the estimate is resolved.

    After `warmup` untimed rounds, rounds of one prefill per model (ABBA... order) are
    added until, after at least `min_runs` rounds, the estimate is resolved: on each
    side the second-smallest time is within `tolerance` of the smallest (two runs agree
    on the floor), and min(dense) / min(pruned) is at most 1.05 x
    `speedup_bound(n_blocks, removed)`. Timing stops unresolved after `max_runs` rounds,
    or once `budget_s` seconds (from the call, warm-ups included) are spent; a budget
    that ends it before `min_runs` rounds leaves it unresolved. The garbage collector is
    off while timing, as in `timeit`.

    Returns (all floats, as catalog metric columns are):
    - `latency_ms`, `latency_dense_ms`: the pruned and the dense minimum;
    - `speedup_measured`: min(dense) / min(pruned), always;
    - `speedup`: the same when resolved, else NaN (a ratio above the bound never is);
    - `speedup_std`: the ratio's half-width from the floors' agreement: with g the
      relative gap between a side's two smallest times, half the width of
      [r / (1 + g_pruned), r * (1 + g_dense)], the range r spans if either floor were
      that side's second-smallest time (NaN with fewer than two runs a side);
    - `speed_runs`: rounds timed (runs per side);
    - `speed_resolved`: 1.0 or 0.0.

    `pruned=None` times the dense model alone: speed-up 1 by definition, resolved when
    its own floor is stable."""
    ids = _ids(dense, seq_len)
    models = [dense] if pruned is None else [dense, pruned]
    bound, need = _bound(n_blocks, removed), _runs_needed(min_runs, max_runs)
    start = _now()  # the budget counts from the call, before the warm-ups
    with _quiet():
        _warm_up(models, ids, warmup)
        times = _alternate_rounds(
            models, ids, need, max_runs, bound, tolerance, start=start, budget_s=budget_s
        )
    return _judged(times, need, bound, tolerance)


def _bound(n_blocks: int, removed: int) -> float:
    """`speedup_bound`, or no bound at all where every block goes (it would divide by 0)."""
    return speedup_bound(n_blocks, removed) if removed < n_blocks else math.inf


def _runs_needed(min_runs: int, max_runs: int) -> int:
    """Rounds before an estimate may count as resolved: `min_runs`, capped by `max_runs`,
    and never under two, since one run cannot show a stable floor."""
    return max(2, min(min_runs, max_runs))


def _warm_up(models: Sequence[Any], ids: torch.Tensor, warmup: int) -> None:
    """Untimed rounds, so one-off costs (kernel selection, first-touch allocation) land
    on no side's timings."""
    for _ in range(warmup):
        for m in models:
            _time_ms(m, ids)


def _alternate_rounds(
    models: list[Any],
    ids: torch.Tensor,
    need: int,
    max_runs: int,
    bound: float,
    tolerance: float,
    *,
    start: float,
    budget_s: float | None,
) -> list[list[float]]:
    """`timed_speedup`'s rounds, ABBA..., up to `max_runs`: they stop once resolved after
    `need` rounds, or once `budget_s` seconds from `start` are spent (None: no budget).
    Returns each side's times, [dense, pruned]."""
    times: list[list[float]] = [[] for _ in models]
    for i in range(max(max_runs, 1)):
        for side, t in zip(times, _pair(models, ids, flip=i % 2 == 1), strict=True):
            side.append(t)
        if i + 1 >= need and _resolved(times, bound, tolerance):
            break
        if budget_s is not None and _now() - start >= budget_s:
            break
    return times


def _judged(
    times: list[list[float]], need: int, bound: float, tolerance: float
) -> dict[str, float]:
    """`_minima` of the final times, resolved only after `need` rounds: a budget that
    ended the timing earlier leaves it unresolved, however settled it looks."""
    resolved = len(times[-1]) >= need and _resolved(times, bound, tolerance)
    return _minima(times, resolved)


def timed_speedups(
    dense: Any,
    variants: dict[str, tuple[Any, int]],
    seq_len: int,
    *,
    n_blocks: int,
    min_runs: int = 5,
    max_runs: int = 15,
    warmup: int = 1,
    tolerance: float = 0.02,
) -> dict[str, dict[str, float]]:
    """`timed_speedup` for many variants of one dense model at once: each round times the
    dense model once and every variant still unresolved once (the order reversed every
    other round), so the dense side is not re-timed per variant. `variants` maps a key to
    (the pruned model, blocks removed); `{}` times the dense model alone. The estimate,
    its resolution and the returned figures per key are `timed_speedup`'s, the dense
    minimum shared; after `min_runs` rounds a resolved variant leaves the rounds."""
    ids = _ids(dense, seq_len)
    need = _runs_needed(min_runs, max_runs)
    models = {k: model for k, (model, _) in variants.items()}
    bounds = {k: _bound(n_blocks, r) for k, (_, r) in variants.items()}
    with _quiet():
        _warm_up([dense, *models.values()], ids, warmup)
        dense_times, times = _group_rounds(
            dense, models, ids, need, max_runs, bounds=bounds, tolerance=tolerance
        )
    out = {  # judged on the final floors: a dense floor that moved later counts too
        k: _judged([dense_times, times[k]], need, bounds[k], tolerance) for k in variants
    }
    return out | {"": _minima([dense_times], _floor_gap(dense_times) <= tolerance)}


def _group_rounds(
    dense: Any,
    models: dict[str, Any],
    ids: torch.Tensor,
    need: int,
    max_runs: int,
    *,
    bounds: dict[str, float],
    tolerance: float,
) -> tuple[list[float], dict[str, list[float]]]:
    """`timed_speedups`' rounds, up to `max_runs`: after `need` rounds a resolved variant
    leaves them, and they stop once every variant has (the dense model alone: once its
    floor is stable). Returns the dense times and each variant's."""
    dense_times: list[float] = []
    times: dict[str, list[float]] = {k: [] for k in models}
    done: set[str] = set()
    for i in range(max(max_runs, 1)):
        order = [k for k in models if k not in done]
        dense_ms, variant_ms = _group_round(dense, models, ids, order, flip=i % 2 == 1)
        dense_times.append(dense_ms)
        for k, t in variant_ms.items():
            times[k].append(t)
        if i + 1 >= need:
            done |= {k for k in order if _resolved([dense_times, times[k]], bounds[k], tolerance)}
            alone = _floor_gap(dense_times) <= tolerance
            if len(done) == len(models) and (models or alone):
                break
    return dense_times, times


def _group_round(
    dense: Any, models: dict[str, Any], ids: torch.Tensor, order: list[str], *, flip: bool
) -> tuple[float, dict[str, float]]:
    """One timing of the dense model and of each variant in `order`: dense first, or
    (`flip`, every other round) last with the variants reversed, so a drift in machine
    speed favours neither side. Returns the dense time and each variant's."""
    if flip:
        variant_ms = {k: _time_ms(models[k], ids) for k in reversed(order)}
        return _time_ms(dense, ids), variant_ms
    dense_ms = _time_ms(dense, ids)
    return dense_ms, {k: _time_ms(models[k], ids) for k in order}


def _floor_gap(times: list[float]) -> float:
    """How far the second-smallest time is above the smallest, relative (inf: one run)."""
    if len(times) < 2:
        return math.inf
    first, second = sorted(times)[:2]
    return (second - first) / first if first > 0 else math.inf


def _resolved(times: list[list[float]], bound: float, tolerance: float) -> bool:
    if any(_floor_gap(side) > tolerance for side in times):
        return False
    return len(times) == 1 or min(times[0]) / min(times[1]) <= BOUND_SLACK * bound


def _minima(times: list[list[float]], resolved: bool) -> dict[str, float]:
    dense_ms = min(times[0])
    pruned_ms = min(times[-1])
    gaps = [_floor_gap(side) for side in times]
    if len(times) == 1:  # the dense model alone: 1 by definition
        ratio, spread = 1.0, 0.0
    else:
        ratio = dense_ms / pruned_ms
        spread = (ratio * (1 + gaps[0]) - ratio / (1 + gaps[1])) / 2
    if not all(math.isfinite(g) for g in gaps):
        spread = math.nan
    return {
        "latency_ms": pruned_ms,
        "latency_dense_ms": dense_ms,
        "speedup": ratio if resolved or len(times) == 1 else math.nan,
        "speedup_measured": ratio,
        "speedup_std": spread,
        "speed_runs": float(len(times[-1])),  # the variant's runs (the dense side's alone)
        "speed_resolved": 1.0 if resolved else 0.0,
    }


def interleaved_speedup(
    dense: Any, pruned: Any | None, seq_len: int, *, pairs: int = 5, warmup: int = 3
) -> dict[str, float]:
    """Median latencies and the median (and std) of the per-pair dense/pruned ratio.
    `pruned=None` times the dense model alone (speed-up 1 by definition). The garbage
    collector is off while timing, as in `timeit`, so a collection cannot land on one side."""
    ids = _ids(dense, seq_len)
    models = [dense] if pruned is None else [dense, pruned]
    with _quiet():
        _warm_up(models, ids, warmup)
        runs = [_pair(models, ids, flip=i % 2 == 1) for i in range(max(pairs, 1))]
    return _summarise(runs)


@contextmanager
def _quiet() -> Iterator[None]:
    """Timing conditions: inference mode, and the garbage collector off (after one
    collection), as in `timeit`, so a collection cannot land on one side."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with torch.inference_mode():
            yield
    finally:
        if was_enabled:
            gc.enable()


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
    ctx.set_forkserver_preload(
        ["torch", "transformers", "lorp.sources", "pipeline.evaluation.speed"]
    )
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
