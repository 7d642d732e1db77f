"""A hidden "true damage" loss the loss-guided methods are checked against, the `Losses`
callable that answers from it and remembers every batch, and the brute-force argmin with
the methods' tie rule (lower block first)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

Candidates = list[tuple[int, ...]]


def damage(n: int, seed: int = 0, pair: float = 0.3) -> Callable[[tuple[int, ...]], float]:
    """A hidden loss: each block costs its own weight, and dropping two neighbours costs
    `pair` more, so the greedy's second pick depends on its first."""
    w = np.random.default_rng(seed).uniform(0.1, 1.0, size=n)

    def true_loss(dropped: tuple[int, ...]) -> float:
        gone = set(dropped)
        return 2.0 + float(sum(w[b] for b in gone)) + pair * sum(b + 1 in gone for b in gone)

    return true_loss


class Recorder:
    """`Losses` over `true_loss`, remembering every batch it was handed."""

    def __init__(self, true_loss: Callable[[tuple[int, ...]], float]) -> None:
        self.true_loss = true_loss
        self.calls: list[Candidates] = []

    def __call__(self, candidates: Candidates) -> list[float]:
        assert all(c == tuple(sorted(set(c))) for c in candidates)
        self.calls.append(list(candidates))
        return [self.true_loss(c) for c in candidates]

    @property
    def n_evals(self) -> int:
        return sum(len(c) for c in self.calls)


def argmin(blocks: list[int], loss: Callable[[int], float]) -> int:
    """The block of lowest `loss`, ties to the lower block."""
    return min(blocks, key=lambda b: (loss(b), b))


def js_oracle(dense: torch.Tensor, pruned: torch.Tensor) -> float:
    """Mean JS divergence (nats) per position, from logits, written out from the
    definition in float64: 0.5 KL(P || M) + 0.5 KL(Q || M), M = (P + Q) / 2."""
    p, q = dense.double().softmax(-1), pruned.double().softmax(-1)
    m = 0.5 * (p + q)
    kl = lambda a: (a * (a / m).log()).sum(-1)  # noqa: E731
    return float((0.5 * kl(p) + 0.5 * kl(q)).mean())
