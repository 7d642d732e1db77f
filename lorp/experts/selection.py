"""Which routed experts to remove: the same number from every MoE layer (so the config stays
a valid config of its family), the lowest-ranked of each layer.

- `reap`: the lowest saliency S_j (`lorp.experts.saliency`): router weight times output
  norm, averaged over the tokens routed to the expert.
- `frequency`: the least routed (|X_j| / |X|).
- `random`: a seeded draw per layer (the baseline a measure must beat).

A budget is a fraction of each layer's routed experts in (0, 1), or a count. It must leave
at least top-k experts (a token is routed to k distinct experts), and where the router
first chooses among groups of experts (DeepSeek's `n_group`) it removes as many from each
group, so the groups stay equal. Shared experts are never candidates: they are not routed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from lorp.experts.stats import ExpertStats

EXPERT_METHODS = ("reap", "frequency", "random")


@dataclass(frozen=True)
class ExpertSelection:
    """The experts a variant removes: block -> routed expert indices, ascending."""

    method: str
    removed: Mapping[int, tuple[int, ...]]
    n_experts: int

    @property
    def per_layer(self) -> int:
        """Experts removed from each MoE layer."""
        return len(next(iter(self.removed.values()))) if self.removed else 0

    @property
    def kept(self) -> int:
        """Routed experts each MoE layer keeps."""
        return self.n_experts - self.per_layer

    def as_dict(self) -> dict[str, list[int]]:
        """JSON-ready: block (as a string) -> removed experts."""
        return {str(b): list(e) for b, e in sorted(self.removed.items())}


def check_expert_method(method: object, field: str = "method") -> str:
    if method not in EXPERT_METHODS:
        raise ValueError(f"{field}: must be one of {', '.join(EXPERT_METHODS)}, got {method!r}")
    return str(method)


def resolve_expert_budget(budget: int | float, n_experts: int, top_k: int, groups: int = 1) -> int:
    """Experts to remove from each layer: `budget` as a count (an int >= 1) or a fraction of
    `n_experts` in (0, 1); one line naming the budget where a layer would keep fewer than
    `top_k`, or where `groups` would not stay equal."""
    if isinstance(budget, bool) or not isinstance(budget, int | float):
        raise ValueError(
            f"expert budget must be a count or a fraction of the experts, got {budget!r}"
        )
    if isinstance(budget, float):
        if not 0.0 < budget < 1.0:
            raise ValueError(f"expert budget fraction must be in (0, 1), got {budget}")
        count = round(budget * n_experts)
    else:
        count = budget
    shown = f"{budget}" + (f" (= {count} experts)" if count != budget else "")
    if count < 1:
        raise ValueError(f"expert budget {shown} removes no expert of {n_experts}")
    if n_experts - count < max(top_k, 1):
        raise ValueError(
            f"expert budget {shown} leaves {n_experts - count} of {n_experts} experts per "
            f"layer, fewer than the {top_k} each token is routed to"
        )
    if count % groups:
        raise ValueError(
            f"expert budget {shown}: the router chooses among {groups} groups of "
            f"{n_experts // groups} experts; remove a multiple of {groups} to keep them equal"
        )
    return count


def select_experts(
    stats: ExpertStats,
    count: int,
    method: str = "reap",
    *,
    seed: int = 0,
    groups: int = 1,
) -> ExpertSelection:
    """The `count` lowest-ranked routed experts of every MoE layer of `stats` by `method`
    (module docstring), `count / groups` from each group of consecutive experts."""
    check_expert_method(method)
    scores = _scores(stats, method, seed)
    size = stats.n_experts // groups
    removed = {}
    for row, block in enumerate(stats.layers):
        chosen: list[int] = []
        for g in range(groups):
            part = scores[row, g * size : (g + 1) * size]
            order = np.argsort(part, kind="stable")[: count // groups]
            chosen += [g * size + int(i) for i in order]
        removed[block] = tuple(sorted(chosen))
    return ExpertSelection(method, removed, stats.n_experts)


def _scores(stats: ExpertStats, method: str, seed: int) -> np.ndarray:
    """Per layer and expert, lower removed first."""
    if method == "reap":
        return stats.saliency()
    if method == "frequency":
        return stats.frequency()
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(stats.n_experts) for _ in stats.layers]).astype(float)
