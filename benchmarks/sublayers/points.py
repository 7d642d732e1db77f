"""The points of the sub-layer grid: (granularity, method, budget), whole blocks at each
block budget and, at each, the attention, MLP and mixed budgets matched to its decode
cost at 4k; and the units each point's method removes."""

from __future__ import annotations

from typing import Any

from benchmarks.sublayers.costs import unit_cost

BLOCK_BUDGETS = (4, 8)
METHODS = ("shortgpt", "lorp", "sleb", "ppl", "finercut", "window")
MIXED_ONLY = ("window",)
"""The methods run at mixed granularity only (a window of consecutive units)."""
UNIT_ONLY = {"mlp": ("shortgpt", "sleb", "ppl", "finercut")}
"""The methods run at MLP granularity (LoRP's clusters are spent on attentions there)."""


def matched_budget(model: Any, shape: Any, granularity: str, target: float, dtype: str) -> int:
    """The fewest units of `granularity` (attention or MLP: every one costs the same)
    whose removal brings decode bytes at 4k to at most `target`."""
    from lorp.models.sublayers import eligible_units

    pool = eligible_units(granularity, shape.n_blocks)
    cost = unit_cost(model, shape, dtype)
    for k in range(1, len(pool) + 1):
        if cost(pool[:k]) <= target:
            return k
    return len(pool)


def choose(
    similarity: Any, budget: int, granularity: str, method: str, losses: Any = None
) -> list[int]:
    """The units `method` removes; a loss-guided method asked for every eligible unit of a
    granularity takes them all without scoring (there is nothing to rank)."""
    from lorp.methods.sublayer_selection import LOSS_METHODS, loss_measure, select_units
    from lorp.models.sublayers import eligible_units

    if method == "window":  # by the held-out loss of each repaired window
        scores = losses.repair_scores
        sel = select_units(
            similarity, budget, granularity, method, repair_scores=scores, score="loss"
        )
        return list(sel.layers)
    asks = losses is not None and method in LOSS_METHODS
    scored = losses.by(loss_measure(method)) if asks else None
    if method in ("sleb", "finercut") and granularity != "block":
        pool = eligible_units(granularity, similarity.n_blocks // 2)
        if budget >= len(pool):
            return pool
    sel = select_units(similarity, budget, granularity, method, losses=scored)
    return list(sel.layers)


def matched_mixed(
    model: Any,
    shape: Any,
    similarity: Any,
    method: str,
    target: float,
    dtype: str,
    losses: Any = None,
) -> int:
    """The fewest mixed units `method` removes (its own choice at each count: an MLP saves
    more than an attention) whose decode bytes at 4k are at most `target`; for `window`,
    the fewest with which every window of that many consecutive units costs no more
    (chosen without scoring any: each count would need its own pass)."""
    from lorp.models.sublayers import budget_limit, eligible_units

    cost = unit_cost(model, shape, dtype)
    limit = budget_limit("mixed", shape.n_blocks)
    if method in MIXED_ONLY:
        pool = eligible_units("mixed", shape.n_blocks)
        for k in range(1, limit + 1):
            runs = [pool[i : i + k] for i in range(len(pool) - k + 1)]
            if all(cost(u) <= target for u in runs):
                return k
        return limit
    for k in range(1, limit + 1):
        if cost(choose(similarity, k, "mixed", method, losses)) <= target:
            return k
    return limit


def grid(
    model: Any,
    shape: Any,
    dtype: str,
    budgets: tuple[int, ...] = BLOCK_BUDGETS,
    similarity: Any = None,
    methods: tuple[str, ...] = METHODS,
    losses: Any = None,
) -> list[tuple[str, str, int]]:
    """(granularity, method, budget) points: whole blocks at `budgets`, and at each the
    attention, MLP and (given the sub-layer S, and `losses` for a loss-guided method)
    each method's mixed budget matched to its decode cost at 4k."""
    from lorp.models.sublayers import block_units

    points = []
    for b in [b for b in budgets if b <= shape.n_blocks - 2]:
        target = unit_cost(model, shape, dtype)(block_units(range(1, b + 1)))
        points += [("block", m, b) for m in methods if m not in MIXED_ONLY]
        k_attn = matched_budget(model, shape, "attention", target, dtype)
        points += [("attention", m, k_attn) for m in methods if m not in MIXED_ONLY]
        for m in methods:
            k = (
                k_attn
                if similarity is None
                else matched_mixed(model, shape, similarity, m, target, dtype, losses)
            )
            points.append(("mixed", m, k))
        k_mlp = matched_budget(model, shape, "mlp", target, dtype)
        points += [("mlp", m, k_mlp) for m in methods if m in UNIT_ONLY["mlp"]]
    return points
