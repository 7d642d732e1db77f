"""The routed experts' sums over calibration tokens (`lorp.experts.saliency` says what they
are and how they are taken): plain arrays that shard, merge and save beside S."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT = "lorp-expert-stats/1"


class ExpertStats:
    """Per MoE layer (`layers`: the block indices, bottom first) and routed expert, the
    sums of the module docstring, float64 [n_layers, n_experts]."""

    def __init__(self, layers: Sequence[int], n_experts: int) -> None:
        if not layers or n_experts < 1:
            raise ValueError(f"expert stats need MoE layers and experts, got {layers}, {n_experts}")
        self.layers = tuple(int(b) for b in layers)
        self.n_experts = int(n_experts)
        shape = (len(self.layers), self.n_experts)
        self.routed = np.zeros(shape)
        self.gate = np.zeros(shape)
        self.saliency_sum = np.zeros(shape)
        self.tokens = np.zeros(len(self.layers))

    def add(
        self, row: int, index: torch.Tensor, weights: torch.Tensor, norms: torch.Tensor
    ) -> None:
        """Add one batch of layer `row`: each token's routed experts `index` [T, k], their
        weights [T, k] and the norms of their outputs [T, k]."""
        flat = index.reshape(-1).long().cpu()
        real = flat < self.n_experts  # an index of E is a family's "no expert" slot
        e = flat[real].numpy()
        g = weights.reshape(-1).double().cpu()[real].numpy()
        a = norms.reshape(-1).double().cpu()[real].numpy()
        np.add.at(self.routed[row], e, 1.0)
        np.add.at(self.gate[row], e, g)
        np.add.at(self.saliency_sum[row], e, g * a)
        self.tokens[row] += index.shape[0]

    def merge(self, other: ExpertStats) -> ExpertStats:
        """Both shards' statistics together."""
        if (other.layers, other.n_experts) != (self.layers, self.n_experts):
            raise ValueError(
                f"cannot merge expert stats of layers {self.layers} x {self.n_experts} experts "
                f"with {other.layers} x {other.n_experts}"
            )
        out = ExpertStats(self.layers, self.n_experts)
        for name in ("routed", "gate", "saliency_sum", "tokens"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        return out

    def saliency(self) -> np.ndarray:
        """S_j per layer and expert (0 where no token reached it)."""
        return np.divide(
            self.saliency_sum, self.routed, out=np.zeros_like(self.routed), where=self.routed > 0
        )

    def frequency(self) -> np.ndarray:
        """|X_j| / |X| per layer and expert."""
        tokens = np.maximum(self.tokens, 1)[:, None]
        return self.routed / tokens

    # -- files ----------------------------------------------------------------------------

    def arrays(self, prefix: str = "experts_") -> dict[str, np.ndarray]:
        """The statistics as named arrays (beside S in its .npz)."""
        return {
            f"{prefix}layers": np.asarray(self.layers, dtype=np.int64),
            f"{prefix}routed": self.routed,
            f"{prefix}gate": self.gate,
            f"{prefix}saliency": self.saliency_sum,
            f"{prefix}tokens": self.tokens,
        }

    @classmethod
    def from_arrays(cls, data: Any, prefix: str = "experts_") -> ExpertStats | None:
        """The statistics `arrays` wrote, or None where `data` holds none."""
        if f"{prefix}layers" not in data:
            return None
        routed = np.asarray(data[f"{prefix}routed"], dtype=np.float64)
        out = cls([int(b) for b in data[f"{prefix}layers"]], routed.shape[1])
        out.routed, out.tokens = routed, np.asarray(data[f"{prefix}tokens"], dtype=np.float64)
        out.gate = np.asarray(data[f"{prefix}gate"], dtype=np.float64)
        out.saliency_sum = np.asarray(data[f"{prefix}saliency"], dtype=np.float64)
        return out

    def save(self, path: str | os.PathLike[str]) -> None:
        np.savez(Path(path), format=np.asarray(FORMAT), **self.arrays())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ExpertStats:
        with np.load(Path(path), allow_pickle=False) as data:
            stats = cls.from_arrays(data)
        if stats is None:
            raise ValueError(f"{str(path)!r} is not a lorp expert stats file")
        return stats
