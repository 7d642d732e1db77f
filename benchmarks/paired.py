"""Paired tests between two variants measured on the same windows and the same items,
and the verdict they give (`benchmarks/peers.py`).

- Perplexity: a paired bootstrap over evaluation windows. Each window's mean NLL is
  recorded per variant (the catalog's `window_nll`); perplexity is exp of their mean, so
  the ratio of two variants' perplexities is exp(mean(a - b)) over the shared windows.
  Resampling the windows (with replacement) and taking the 2.5th and 97.5th percentiles
  of exp(mean(a - b)) gives its 95% percentile interval.
- Zero-shot: McNemar's exact test on per-item correctness (the catalog's `zero_shot`,
  `correct`): only the discordant items count, b right for the first variant alone and c
  for the second alone; under no difference b ~ Binomial(b + c, 1/2), two-sided p =
  min(1, 2 P(X <= min(b, c))).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

ALPHA = 0.05
DRAWS = 10_000
FIRST, SECOND, TIE = "first", "second", "tie"


def paired_bootstrap(
    first: Sequence[float],
    second: Sequence[float],
    *,
    draws: int = DRAWS,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float, float]:
    """(ratio, low, high): the first variant's perplexity over the second's from their
    per-window mean NLLs on the same windows, and its `level` percentile interval over
    `draws` resamplings of the windows (numpy's default generator at `seed`)."""
    a, b = np.asarray(first, dtype=np.float64), np.asarray(second, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"paired windows: need two equal 1-d arrays, got {a.shape}, {b.shape}")
    d = a - b
    picks = np.random.default_rng(seed).integers(0, d.size, size=(draws, d.size))
    means = d[picks].mean(axis=1)
    tail = (1.0 - level) / 2
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return math.exp(d.mean()), math.exp(low), math.exp(high)


def interval_side(low: float, high: float) -> str:
    """Which variant the ratio first / second favours: `first` when the whole interval is
    below 1 (the first's perplexity lower), `second` when above, else `tie`."""
    return FIRST if high < 1.0 else SECOND if low > 1.0 else TIE


def discordant(first: str, second: str) -> tuple[int, int]:
    """(b, c): items the first variant got right and the second wrong, and the reverse,
    from two strings of 0/1 per item in the same item order."""
    if len(first) != len(second):
        raise ValueError(f"paired items: {len(first)} against {len(second)}")
    b = sum(x == "1" and y == "0" for x, y in zip(first, second, strict=True))
    c = sum(x == "0" and y == "1" for x, y in zip(first, second, strict=True))
    return b, c


def mcnemar_exact(b: int, c: int) -> float:
    """McNemar's exact two-sided p-value for `b` and `c` discordant items."""
    m = b + c
    if m == 0:
        return 1.0
    tail = sum(math.comb(m, i) for i in range(min(b, c) + 1)) / 2**m
    return min(1.0, 2.0 * tail)


def mcnemar_side(b: int, c: int, alpha: float = ALPHA) -> str:
    """`first` or `second` where McNemar's test rejects no difference at `alpha` (the one
    with more items right alone), else `tie`."""
    if mcnemar_exact(b, c) >= alpha:
        return TIE
    return FIRST if b > c else SECOND


def detectable(items: int, discordant_items: int, alpha: float = ALPHA) -> float | None:
    """The smallest accuracy difference (points of %) McNemar's exact test rejects at
    `alpha` over `items` paired items of which `discordant_items` are discordant: the
    least |b - c| (of the parity of b + c) with p < alpha, over `items`. None where even
    all discordant items on one side would not be enough (fewer than 6 at 0.05)."""
    m = discordant_items
    for gap in range(m % 2 or 2, m + 1, 2):
        if mcnemar_exact((m - gap) // 2, (m + gap) // 2) < alpha:
            return 100.0 * gap / items
    return None


def combined(sides: Sequence[str]) -> str:
    """One side from several tests: the side every deciding test names (the others tie),
    `tie` where none decides or two decide for opposite sides."""
    decided = set(sides) - {TIE}
    return decided.pop() if len(decided) == 1 else TIE
