"""Which experts go: the lowest saliency or frequency of every layer, a seeded draw, the
same number everywhere; budgets that would break routing are refused in one line."""

from __future__ import annotations

import numpy as np
import pytest

from lorp.experts.selection import resolve_expert_budget, select_experts
from lorp.experts.stats import ExpertStats


def stats() -> ExpertStats:
    s = ExpertStats([1, 3], 4)
    s.routed = np.array([[10.0, 2.0, 6.0, 6.0], [1.0, 8.0, 8.0, 7.0]])
    s.saliency_sum = np.array([[5.0, 4.0, 0.6, 3.0], [2.0, 0.8, 8.0, 7.0]])
    s.tokens = np.array([12.0, 12.0])
    return s


def test_reap_removes_the_lowest_mean_saliency_and_frequency_the_least_routed() -> None:
    # S_j = saliency / routed: [0.5, 2, 0.1, 0.5] and [2, 0.1, 1, 1]
    reap = select_experts(stats(), 2, "reap")
    assert dict(reap.removed) == {1: (0, 2), 3: (1, 2)}
    assert (reap.per_layer, reap.kept) == (2, 2)
    assert dict(select_experts(stats(), 1, "frequency").removed) == {1: (1,), 3: (0,)}


def test_random_is_seeded_per_layer() -> None:
    a, b = (
        select_experts(stats(), 2, "random", seed=3),
        select_experts(stats(), 2, "random", seed=3),
    )
    assert a.removed == b.removed
    draws = {tuple(select_experts(stats(), 2, "random", seed=s).removed[1]) for s in range(8)}
    assert len(draws) > 1


def test_groups_lose_as_many_experts_each() -> None:
    """Two groups of 2 (DeepSeek's n_group): one from each, the lowest within it."""
    assert dict(select_experts(stats(), 2, "reap", groups=2).removed) == {1: (0, 2), 3: (1, 2)}
    assert dict(select_experts(stats(), 2, "frequency", groups=2).removed) == {1: (1, 2), 3: (0, 3)}


def test_budgets_are_fractions_or_counts_and_must_leave_top_k() -> None:
    assert resolve_expert_budget(0.25, 128, 8) == 32
    assert resolve_expert_budget(0.5, 8, 2) == 4 and resolve_expert_budget(3, 8, 2) == 3
    with pytest.raises(ValueError) as exc:
        resolve_expert_budget(0.9, 8, 2)
    assert str(exc.value) == (
        "expert budget 0.9 (= 7 experts) leaves 1 of 8 experts per layer, fewer than the "
        "2 each token is routed to"
    )
    assert resolve_expert_budget(0.25, 256, 8, groups=8) == 64
    with pytest.raises(ValueError, match=r"remove a multiple of 8 to keep them equal"):
        resolve_expert_budget(4, 256, 8, groups=8)
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\), got 1.5"):
        resolve_expert_budget(1.5, 8, 2)
    with pytest.raises(ValueError, match="removes no expert of 8"):
        resolve_expert_budget(0.01, 8, 2)
