"""Speed and memory of a model, after the paper's Appendix A, measured so that a figure
can be trusted.

- Prefill latency: one forward at batch 1 over `seq_len` tokens with the KV cache off and
  logits for the last position only (`logits_to_keep=1`), as a generation prefill does; a
  full-sequence LM head (Gemma 3's has 262k rows) would time the head, not the blocks.
- `timed_speedups` times the dense model and its variants in rounds in one process (the
  dense model once per round, every unresolved variant once, the order reversed every
  other round; warm-ups first; the garbage collector off, as in `timeit`). A variant's
  speed-up is the **median of its paired ratios**, dense time over variant time within
  one round: whatever slows the machine for a round (another process, a migrating
  thread, frequency) slows both sides of that round's ratio, and the median ignores the
  rounds where it hit one side only. Its 95% interval comes from the ratios' own order
  statistics (`median_interval`, distribution-free); the figure is *resolved* once the
  interval's half-width is within 2% of the median and the median is physically
  possible (0.97 to 1.05 x N/(N-k)). Timing goes on until every variant is resolved, a
  round limit, or the model's time budget. The pipeline runs it in a dedicated pass
  after the grid, one model at a time on a whole node. (The earlier rule, the ratio of
  each side's minimum with a 2% floor-agreement test, resolved almost nothing on 2
  shared cores, and a minimum over 40 runs still moved by +-3% between conditions:
  `benchmarks/speed_bound.py`.)
- `interleaved_speedup`, the first estimator (medians and the median per-pair ratio,
  a fixed number of pairs), is kept for `benchmarks/run.py`.
- Peak memory of a variant, in a fresh process: `pipeline.evaluation.peak_memory`.

Removing k of N blocks cannot speed a prefill up by more than N / (N - k)
(`speedup_bound`); the embedding and LM head make the real bound lower still.
"""

from __future__ import annotations

import functools
import gc
import math
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from lorp.models.architectures import text_config
from lorp.models.streaming import device_of


def speedup_bound(n_blocks: int, removed: int) -> float:
    """The most a prefill can speed up when `removed` of `n_blocks` blocks go."""
    return n_blocks / (n_blocks - removed)


def _ids(model: Any, seq_len: int, seed: int = 0) -> torch.Tensor:
    device = device_of(model)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(
        0, int(text_config(model.config).vocab_size), (1, seq_len), generator=g
    ).to(device)


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

SLOWDOWN_FLOOR = 0.97
"""Removing blocks cannot slow a prefill down: a ratio under 0.97 is a broken timing too."""

HALF_WIDTH = 0.02
"""The relative half-width of the median's 95% interval a published speed-up needs."""

CONFIDENCE = 0.95


def _now() -> float:
    return time.perf_counter()


def median_interval(
    ratios: Sequence[float], confidence: float = CONFIDENCE
) -> tuple[float, float, float]:
    """The median of `ratios` and a distribution-free interval for it: the order statistics
    [r_(k), r_(n+1-k)] with the largest k whose binomial tail P(B(n, 1/2) <= k-1) is at
    most (1 - confidence) / 2, so the interval covers the true median with at least
    `confidence`. With too few ratios for that confidence (n <= 5 at 95%) the interval is
    [min, max] and `_order_index` says it is short."""
    r = sorted(ratios)
    lo = _order_index(len(r), confidence)
    k = 0 if lo is None else lo
    return statistics.median(r), r[k], r[len(r) - 1 - k]


@functools.cache
def _order_index(n: int, confidence: float) -> int | None:
    """0-based index of the interval's lower order statistic, None when even [min, max]
    covers the median with less than `confidence` (1 - 2 / 2**n)."""
    return lower_index([math.comb(n, i) for i in range(n + 1)], confidence)


def lower_index(counts: Sequence[int], confidence: float) -> int | None:
    """The largest u whose lower tail P(X <= u) under the null distribution `counts`
    (how many outcomes give X = 0, 1, ...; symmetric) is at most (1 - confidence) / 2:
    the 0-based index of a distribution-free interval's lower order statistic. None when
    even u = 0 has a larger tail (too few samples for `confidence`)."""
    total, tail, index = sum(counts), 0, None
    for u in range((len(counts) - 1) // 2):
        tail += counts[u]  # outcomes with X <= u
        if tail / total > (1 - confidence) / 2:
            break
        index = u
    return index


def publishable(mid: float, lo: float, hi: float, bound: float, half_width: float) -> bool:
    """Whether a speed-up `mid` with 95% interval [lo, hi] is a result: physically
    possible (0.97 to 1.05 x `bound`) and its interval's half-width within `half_width`
    of it. The rule of the prefill (`timed_speedups`) and serving speed-ups alike."""
    plausible = SLOWDOWN_FLOOR <= mid <= BOUND_SLACK * bound
    return plausible and (hi - lo) / 2 <= half_width * mid


def rounds_for(confidence: float = CONFIDENCE) -> int:
    """The fewest rounds whose ratios can give an interval at `confidence` (6 at 95%)."""
    return next(n for n in range(2, 64) if _order_index(n, confidence) is not None)


def timed_speedup(
    dense: Any,
    pruned: Any | None,
    seq_len: int,
    *,
    n_blocks: int,
    removed: int,
    min_runs: int = 6,
    max_runs: int = 40,
    budget_s: float | None = None,
    warmup: int = 2,
    half_width: float = HALF_WIDTH,
) -> dict[str, float]:
    """The prefill speed-up of `pruned` over `dense`, timed alternately (ABBA...) until
    its 95% interval is narrow enough: `timed_speedups` for one variant. `pruned=None`
    times the dense model alone."""
    variants = {} if pruned is None else {"pruned": (pruned, removed)}
    out = timed_speedups(
        dense,
        variants,
        seq_len,
        n_blocks=n_blocks,
        min_runs=min_runs,
        max_runs=max_runs,
        budget_s=budget_s,
        warmup=warmup,
        half_width=half_width,
    )
    return out["" if pruned is None else "pruned"]


def timed_speedups(
    dense: Any,
    variants: dict[str, tuple[Any, int]],
    seq_len: int,
    *,
    n_blocks: int,
    min_runs: int = 6,
    max_runs: int = 40,
    budget_s: float | None = None,
    warmup: int = 1,
    half_width: float = HALF_WIDTH,
) -> dict[str, dict[str, float]]:
    """Prefill speed-ups of many variants of one dense model, timed in rounds.

    Each round times the dense model once and every variant still unresolved once, the
    order reversed every other round (dense first, then last), so a drift in machine
    speed favours no side; the garbage collector is off, as in `timeit`. A variant's
    figure is the **median of its paired ratios** (the dense time of a round over the
    variant's time in the same round: what slows the machine for a round slows both),
    with the median's distribution-free 95% interval (`median_interval`). It is
    *resolved*, and leaves the rounds, once after at least `min_runs` rounds (never under
    `rounds_for()` = 6) the interval's half-width is at most `half_width` of the median
    and the median lies in [0.97, 1.05 x N/(N-k)]. Rounds stop at `max_runs`, or once
    `budget_s` seconds (from the call, warm-ups included) are spent; what is unresolved
    then stays so. `variants` maps a key to (model, blocks removed).

    Returns per key (all floats, as catalog metric columns are):
    - `latency_ms`, `latency_dense_ms`: the variant's median time and the dense model's
      median over the same rounds;
    - `speedup_measured`: the median paired ratio, always;
    - `speedup`: the same when resolved, else NaN;
    - `speedup_low`, `speedup_high`, `speedup_std`: the 95% interval and its half-width;
    - `speed_runs`: the variant's rounds; `speed_resolved`: 1.0 or 0.0.
    Under the key "" the dense model alone: speed-up 1 by definition (resolved), its
    median latency over every round."""
    ids = _ids(dense, seq_len)
    need = max(min_runs, rounds_for())
    models = {k: model for k, (model, _) in variants.items()}
    bounds = {k: _bound(n_blocks, r) for k, (_, r) in variants.items()}
    rule = _Rule(need, bounds, half_width)
    start = _now()  # the budget counts from the call, before the warm-ups
    with _quiet():
        _warm_up([dense, *models.values()], ids, warmup)
        rounds = _group_rounds(dense, models, ids, max_runs, rule, start=start, budget_s=budget_s)
    out = {k: _figures(rounds.paired(k), rule, k) for k in variants}
    return out | {"": _dense_alone(rounds.dense)}


def _bound(n_blocks: int, removed: int) -> float:
    """`speedup_bound`, or no bound at all where every block goes (it would divide by 0)."""
    return speedup_bound(n_blocks, removed) if removed < n_blocks else math.inf


@dataclass(frozen=True)
class _Rule:
    """When a variant's paired ratios make a published figure."""

    need: int
    bounds: dict[str, float]
    half_width: float

    def resolved(self, paired: list[tuple[float, float]], key: str) -> bool:
        if len(paired) < self.need:
            return False
        mid, lo, hi = median_interval([d / v for d, v in paired])
        return publishable(mid, lo, hi, self.bounds[key], self.half_width)


@dataclass
class _Rounds:
    """Every timing of the rounds: the dense model's per round, and per variant the
    (round, time) of each round it was in."""

    dense: list[float] = field(default_factory=list)
    times: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    def paired(self, key: str) -> list[tuple[float, float]]:
        """(dense time, variant time) of each round the variant was timed in."""
        return [(self.dense[i], t) for i, t in self.times.get(key, [])]


def _warm_up(models: Sequence[Any], ids: torch.Tensor, warmup: int) -> None:
    """Untimed rounds, so one-off costs (kernel selection, first-touch allocation) land
    on no side's timings."""
    for _ in range(warmup):
        for m in models:
            _time_ms(m, ids)


def _group_rounds(
    dense: Any,
    models: dict[str, Any],
    ids: torch.Tensor,
    max_runs: int,
    rule: _Rule,
    *,
    start: float,
    budget_s: float | None,
) -> _Rounds:
    """`timed_speedups`' rounds: a resolved variant leaves them; they stop once every
    variant has (the dense model alone: after `rule.need` rounds), at `max_runs`, or
    when `budget_s` seconds from `start` are spent (None: no budget)."""
    rounds = _Rounds(times={k: [] for k in models})
    done: set[str] = set()
    for i in range(max(max_runs, 1)):
        order = [k for k in models if k not in done]
        dense_ms, variant_ms = _group_round(dense, models, ids, order, flip=i % 2 == 1)
        rounds.dense.append(dense_ms)
        for k, t in variant_ms.items():
            rounds.times[k].append((i, t))
        done |= {k for k in order if rule.resolved(rounds.paired(k), k)}
        if len(done) == len(models) and len(rounds.dense) >= rule.need:
            break
        if budget_s is not None and _now() - start >= budget_s:
            break
    return rounds


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


def _figures(paired: list[tuple[float, float]], rule: _Rule, key: str) -> dict[str, float]:
    """A variant's figures from its paired rounds (see `timed_speedups`)."""
    nan = math.nan
    if not paired:
        return {
            "latency_ms": nan,
            "latency_dense_ms": nan,
            "speedup": nan,
            "speedup_measured": nan,
            "speedup_low": nan,
            "speedup_high": nan,
            "speedup_std": nan,
            "speed_runs": 0.0,
            "speed_resolved": 0.0,
        }
    mid, lo, hi = median_interval([d / v for d, v in paired])
    resolved = rule.resolved(paired, key)
    return {
        "latency_ms": statistics.median(v for _, v in paired),
        "latency_dense_ms": statistics.median(d for d, _ in paired),
        "speedup": mid if resolved else nan,
        "speedup_measured": mid,
        "speedup_low": lo,
        "speedup_high": hi,
        "speedup_std": (hi - lo) / 2,
        "speed_runs": float(len(paired)),
        "speed_resolved": 1.0 if resolved else 0.0,
    }


def _dense_alone(times: list[float]) -> dict[str, float]:
    """The dense model's own row: speed-up 1 by definition, its median latency."""
    latency = statistics.median(times) if times else math.nan
    return {
        "latency_ms": latency,
        "latency_dense_ms": latency,
        "speedup": 1.0,
        "speedup_measured": 1.0,
        "speedup_low": 1.0,
        "speedup_high": 1.0,
        "speedup_std": 0.0,
        "speed_runs": float(len(times)),
        "speed_resolved": 1.0,
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


def count_params(model: Any) -> int:
    """Parameters, each tied tensor counted once. A streamed model's matrices are on the
    meta device, where every tensor's pointer is 0: those count by identity."""
    seen, total = set(), 0
    for p in model.parameters():
        key = id(p) if p.is_meta else p.data_ptr()
        if key not in seen:
            seen.add(key)
            total += p.numel()
    return total
