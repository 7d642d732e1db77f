"""What the loss-guided methods (`sleb`, `ppl`, `lorp-loss`) share: a counted, checked call
of the `Losses` callable, the greedy argmin with LoRP's tie rule, and the options that keep
the first and last blocks out of the candidates.

The methods stay pure: they see only `losses(candidates) -> values` and never a model.
Every call goes through `CountedLosses`, which checks the answer (one finite-or-inf
number per candidate) and counts the candidates asked for, the `n_evals` each method
records in its details.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lorp.locality.allocation import tie_key
from lorp.locality.rls import is_int
from lorp.methods.registry import Losses

log = logging.getLogger(__name__)


class CountedLosses:
    """`losses` with its answers checked and its candidate evaluations counted."""

    def __init__(self, losses: Losses) -> None:
        self._losses = losses
        self.n_evals = 0
        self.n_calls = 0

    def __call__(self, candidates: Sequence[Iterable[int]]) -> list[float]:
        """Loss of each candidate set (sorted into a tuple of ints before it is handed on).
        NaN (a diverged model) counts as +inf: the worst candidate, never picked first."""
        sets = [tuple(sorted(int(i) for i in c)) for c in candidates]
        if not sets:
            return []
        values = list(self._losses(sets))
        if len(values) != len(sets):
            raise ValueError(f"losses returned {len(values)} values for {len(sets)} candidates")
        out = []
        for cand, value in zip(sets, values, strict=True):
            v = float(value)
            if math.isnan(v):
                log.warning("loss of dropping %s is NaN; counted as +inf", list(cand))
                v = math.inf
            out.append(v)
        self.n_evals += len(sets)
        self.n_calls += 1
        return out


def argmin_block(blocks: Sequence[int], values: Sequence[float]) -> int:
    """The block of lowest loss; equal to 12 decimals goes to the lower index (as LoRP)."""
    return min(zip(blocks, values, strict=True), key=lambda bv: (tie_key(bv[1]), bv[0]))[0]


def check_keep(options: Mapping[str, Any], n_blocks: int | None) -> None:
    """`keep_first` and `keep_last`: non-negative integers leaving at least one candidate."""
    for name in ("keep_first", "keep_last"):
        value = options[name]
        if not is_int(value) or value < 0:
            raise ValueError(f"option {name!r}: must be a non-negative integer, got {value!r}")
    kept = options["keep_first"] + options["keep_last"]
    if n_blocks is not None and kept >= n_blocks:
        raise ValueError(
            f"options 'keep_first', 'keep_last': {kept} protected blocks leave no candidate "
            f"among {n_blocks}"
        )


def candidate_blocks(n_blocks: int, keep_first: int, keep_last: int, budget: int) -> list[int]:
    """Blocks keep_first..N-1-keep_last, refusing a budget larger than their number."""
    pool = list(range(int(keep_first), n_blocks - int(keep_last)))
    if budget > len(pool):
        raise ValueError(
            f"budget {budget} exceeds the {len(pool)} candidate blocks "
            f"(keep_first={keep_first}, keep_last={keep_last}, N={n_blocks})"
        )
    return pool
