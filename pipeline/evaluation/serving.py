"""Serving throughput through vLLM's engine: what a deployment of a variant would see.

`measure_serving(llm, spec, vocab_size)` drives the engine of a `vllm.LLM` (its
`llm_engine`: `add_request` / `step`) closed-loop: `concurrency` requests in flight, a new
one added as each finishes, until `requests` have been served. Every prompt is
`prompt_len` fixed synthetic token ids (seeded by round, different per request and per
round, so no prefix cache can serve one from another) and generates exactly `output_len`
tokens (`ignore_eos`, greedy). Per request, as vLLM's serving benchmark defines them:

- TTFT, time to first token: from the request's submission to the step that returns its
  first token;
- TPOT, time per output token after the first: (finish - first token) / (output_len - 1);
- output throughput: every request's output tokens over the round's wall time.

One untimed warm-up round, then `rounds` timed rounds; the row keeps each round's figures
(`serving` column) and the medians (`serve_output_tps`, `serve_ttft_ms`,
`serve_tpot_ms`).

A variant's serving speed-up, output tokens/s over dense's, is judged like the prefill
speed-up (`pipeline.evaluation.speed`), from rounds of two separate engines (the dense
point's and the variant's), which are independent samples, not pairs: the estimate is
the median of every variant/dense round ratio (the Hodges-Lehmann estimator on the log
scale) with Moses' distribution-free 95% interval from the Mann-Whitney distribution
(`ratio_interval`); it is published when the interval's half-width is within the job's
`speed_half_width` and the figure within [0.97, 1.05 x N/(N-k)]: at a fixed concurrency
every generated token still passes through N-k blocks.
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

from pipeline.evaluation.speed import CONFIDENCE, lower_index, publishable
from pipeline.spec.evaluation import ServingSpec


def synthetic_prompts(spec: ServingSpec, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """`requests` prompts of `prompt_len` token ids, fixed by `seed`, distinct per request
    (their first token differs), away from the low ids where special tokens live."""
    import random

    rng = random.Random(seed)
    low = min(1000, vocab_size // 4)
    out = []
    for i in range(spec.requests):
        ids = [rng.randrange(low, vocab_size) for _ in range(spec.prompt_len)]
        ids[0] = low + i % (vocab_size - low)
        out.append(ids)
    return out


def round_prompts(spec: ServingSpec, vocab_size: int) -> list[list[list[int]]]:
    """The warm-up's prompts (one wave), then each timed round's. Every round has its own
    prompts (seeded by the round): an engine's prefix cache (on by default in vLLM) must
    not serve a round's prefills from an earlier round's."""
    warm = synthetic_prompts(spec, vocab_size, seed=0)[: spec.concurrency]
    return [warm, *(synthetic_prompts(spec, vocab_size, seed=1 + i) for i in range(spec.rounds))]


def serve_round(llm: Any, spec: ServingSpec, prompts: Sequence[Sequence[int]]) -> dict[str, float]:
    """One closed-loop round over `prompts` (see the module): its output tokens/s, and
    the medians of TTFT and TPOT over its requests (ms)."""
    from vllm import SamplingParams, TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(
        max_tokens=spec.output_len,
        min_tokens=spec.output_len,
        ignore_eos=True,
        temperature=0.0,
        detokenize=False,
    )
    waiting = list(enumerate(prompts))[::-1]
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    ended: dict[str, tuple[float, int]] = {}
    start = time.perf_counter()
    while waiting or len(ended) < len(sent):
        while waiting and len(sent) - len(ended) < spec.concurrency:
            i, ids = waiting.pop()
            rid = f"serve-{i}"
            engine.add_request(rid, TokensPrompt(prompt_token_ids=list(ids)), params)
            sent[rid] = time.perf_counter()
        for out in engine.step():
            now = time.perf_counter()
            n = len(out.outputs[0].token_ids) if out.outputs else 0
            if n and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                ended[out.request_id] = (now, n)
    wall = time.perf_counter() - start
    return _round_figures(sent, first, ended, wall)


def _round_figures(
    sent: dict[str, float],
    first: dict[str, float],
    ended: dict[str, tuple[float, int]],
    wall: float,
) -> dict[str, float]:
    """A round's figures from its clock readings: output tokens over the round's wall
    time; TTFT per request from its own submission to its first token; TPOT per request
    over its n - 1 tokens after the first (a one-token request has none)."""
    tokens = sum(n for _, n in ended.values())
    ttft = [(first[r] - sent[r]) * 1000 for r in sent if r in first]
    tpot = [(end - first[r]) * 1000 / (n - 1) for r, (end, n) in ended.items() if n > 1]
    return {
        "output_tps": tokens / wall,
        "ttft_ms": statistics.median(ttft) if ttft else math.nan,
        "tpot_ms": statistics.median(tpot) if tpot else math.nan,
        "output_tokens": float(tokens),
    }


def measure_serving(llm: Any, spec: ServingSpec, vocab_size: int) -> dict[str, Any]:
    """A warm-up round, then `spec.rounds` timed rounds. Returns the row's medians
    (`serve_output_tps`, `serve_ttft_ms`, `serve_tpot_ms`) and, under `serving`, the
    settings and every round's figures."""
    warm, *timed = round_prompts(spec, vocab_size)
    serve_round(llm, spec, warm)  # warm-up: one wave, untimed
    rounds = [serve_round(llm, spec, prompts) for prompts in timed]
    return {
        "serve_output_tps": statistics.median(r["output_tps"] for r in rounds),
        "serve_ttft_ms": statistics.median(r["ttft_ms"] for r in rounds),
        "serve_tpot_ms": statistics.median(r["tpot_ms"] for r in rounds),
        "serving": {
            "concurrency": spec.concurrency,
            "prompt_len": spec.prompt_len,
            "output_len": spec.output_len,
            "requests": spec.requests,
            "rounds": rounds,
        },
    }


# -- the serving speed-up ----------------------------------------------------------------


def ratio_interval(
    variant: Sequence[float], dense: Sequence[float], confidence: float = CONFIDENCE
) -> tuple[float, float, float, bool]:
    """Variant over dense from two independent samples: the median of every pairwise
    ratio v_i / d_j (Hodges-Lehmann on the log scale) and Moses' interval, the ratios'
    order statistics [R_(k), R_(mn+1-k)] with the largest k whose Mann-Whitney tail
    P(U <= k-1) is at most (1 - confidence) / 2. The last value says whether the samples
    were large enough for `confidence` (4 rounds a side at 95%); if not, the interval is
    [min, max]."""
    ratios = sorted(v / d for v, d in itertools.product(variant, dense))
    k = _moses_index(len(variant), len(dense), confidence)
    enough = k is not None
    k = k or 0
    return statistics.median(ratios), ratios[k], ratios[len(ratios) - 1 - k], enough


@functools.cache
def _moses_index(m: int, n: int, confidence: float) -> int | None:
    """0-based index of the interval's lower ratio, None when [min, max] falls short."""
    return lower_index(_mann_whitney_counts(m, n), confidence)


@functools.cache
def _mann_whitney_counts(m: int, n: int) -> tuple[int, ...]:
    """How many of the C(m+n, m) orderings give U = 0, 1, ..., mn (exact, no ties)."""
    if m == 0 or n == 0:
        return (1,)
    a = _mann_whitney_counts(m - 1, n)  # the largest value is from the first sample: +n
    b = _mann_whitney_counts(m, n - 1)
    out = [0] * (m * n + 1)
    for u, c in enumerate(a):
        out[u + n] += c
    for u, c in enumerate(b):
        out[u] += c
    return tuple(out)


def serving_speedup(
    variant_tps: Sequence[float], dense_tps: Sequence[float], bound: float, half_width: float
) -> dict[str, float]:
    """The row's serving speed-up columns from each side's per-round output tokens/s."""
    mid, lo, hi, enough = ratio_interval(variant_tps, dense_tps)
    resolved = enough and publishable(mid, lo, hi, bound, half_width)
    return {
        "serve_speedup": mid if resolved else math.nan,
        "serve_speedup_measured": mid,
        "serve_speedup_low": lo,
        "serve_speedup_high": hi,
        "serve_resolved": 1.0 if resolved else 0.0,
    }
